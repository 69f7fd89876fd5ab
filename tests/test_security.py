"""Security: weights load from safetensors (or GGUF) only, never by unpickling; model
code shipped in a model folder runs only when the user asks (trust_remote_code); config files
cannot build Python objects. Output paths are covered in test_pipeline_resume.py.

Each case plants a payload that would create a sentinel file if it ever ran, and checks that
the file is absent (the remote-code case also shows that the payload does run when allowed, so
the check can fail)."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_support import TINY_NAME, build_tiny_model_dir  # noqa: E402

from dspark.models import load_model, resolve_model_dir  # noqa: E402
from pipelines import generate as cli  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("models") / TINY_NAME)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


class Payload:
    """Unpickling this creates the sentinel file (what a malicious checkpoint would do)."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


def test_a_pickle_next_to_safetensors_is_never_unpickled(model_dir, tmp_path):
    folder = copy_model(model_dir, tmp_path / "m")
    sentinel = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(sentinel)))
    pickle.loads(pickle.dumps(Payload(tmp_path / "control")))  # the payload works when unpickled
    assert (tmp_path / "control").exists()
    model = load_model(str(folder), dtype="float32", device="cpu")
    assert model.vocab_size > 0 and not sentinel.exists()


def test_a_pickle_only_folder_is_refused_before_anything_is_read(model_dir, tmp_path):
    folder = copy_model(model_dir, tmp_path / "m")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    sentinel = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(sentinel)))
    with pytest.raises(ValueError, match="safetensors or GGUF only"):
        load_model(str(folder), dtype="float32", device="cpu")
    assert not sentinel.exists()


@pytest.mark.parametrize("name", ["weights.pt", "model.bin", "model.safetensors", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_only_model_folders_gguf_files_and_the_embedded_name_resolve(tmp_path, name):
    """A bare checkpoint file (pickle or not) or a hub id is not a target: nothing is loaded or
    downloaded."""
    path = tmp_path / name
    if "/" not in name:
        path.write_bytes(b"\x80\x04N.")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model_dir(str(path) if "/" not in name else name)


REMOTE_CODE = """
from pathlib import Path
Path({sentinel!r}).touch()  # runs on import
from transformers import LlamaConfig, LlamaForCausalLM
class EvilConfig(LlamaConfig):
    model_type = "llama"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


def with_remote_code(model_dir: Path, folder: Path, sentinel: Path) -> Path:
    """The tiny model, plus a config.json `auto_map` to model code in the folder (as hub repos
    with custom architectures ship it)."""
    copy_model(model_dir, folder)
    (folder / "evil.py").write_text(REMOTE_CODE.format(sentinel=str(sentinel)))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_model_code_in_the_folder_runs_only_with_trust_remote_code(model_dir, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # keep ~/.cache clean
    sentinel = tmp_path / "remote-code-ran"
    folder = with_remote_code(model_dir, tmp_path / "m", sentinel)
    options, _ = cli.resolve_options(["--target", str(folder)])
    engine = cli.job_spec(options).engine
    assert engine.trust_remote_code is False  # the pipeline's default
    try:
        load_model(str(folder), dtype="float32", device="cpu", trust_remote_code=engine.trust_remote_code)
    except ValueError as exc:  # transformers may refuse outright; it must not run the code either way
        assert "trust_remote_code" in str(exc)
    assert not sentinel.exists()

    try:  # the control: asked for, the folder's code does run
        load_model(str(folder), dtype="float32", device="cpu", trust_remote_code=True)
    except Exception:  # whatever the toy code then does; only its having run matters here
        pass
    assert sentinel.exists()
    options, _ = cli.resolve_options(["--target", str(folder), "--trust-remote-code"])
    assert cli.job_spec(options).engine.trust_remote_code is True


def test_config_files_cannot_build_python_objects(tmp_path):
    sentinel = tmp_path / "yaml-ran"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"max_new_tokens: !!python/object/apply:pathlib.Path.touch [{str(sentinel)!r}]\n")
    with pytest.raises(SystemExit):
        cli.resolve_options(["--config", str(cfg)])
    assert not sentinel.exists()
