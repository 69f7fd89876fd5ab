"""Every command-line entry point explains itself: `--help` names the command as users run it
(`python -m pipelines.NAME`) and says what every option does; input it refuses ends in one
`error:` line."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))

ENTRY_POINTS = ("generate", "evaluate", "bench_pipeline", "train_drafter", "drafter_report")


def help_text(name: str) -> str:
    module = importlib.import_module(f"pipelines.{name}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    return printed.getvalue()


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_names_the_command_and_explains_every_option(name):
    text = help_text(name)
    assert text.startswith(f"usage: python -m pipelines.{name}")
    lines = []  # the option listing: indented lines and group titles, up to the epilog
    for line in text.split("options:", 1)[1].splitlines():
        if line and not line.startswith(" ") and not line.endswith(":"):
            break
        lines.append(line)
    # an option line is "  --flag ARG   help..." (help on the same line or the next one)
    unexplained = []
    for i, line in enumerate(lines):
        match = re.match(r"^  (-{1,2}[\w-]+)(?:[ ,][^ ].*?)?(?:\s{2,}(\S.*))?$", line)
        if not match:
            continue
        follows = lines[i + 1] if i + 1 < len(lines) else ""
        if not match.group(2) and not re.match(r"^\s{8,}\S", follows):
            unexplained.append(match.group(1))
    assert not unexplained, f"options without help: {unexplained}"


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "missing.jsonl", "--out", "OUT"], "error: prompt file missing.jsonl not found"),
    (["--prompts", "EMPTY", "--out", "OUT"], "no prompts selected"),
    (["--prompts", "GOOD", "--out", "OUT", "--methods", "fixed:zero@ngram"], "error: "),
])
def test_the_tools_refuse_bad_input_in_one_error_line(tmp_path, argv, message):
    """A missing or empty prompt file and a malformed method name end in one `error:` line and
    exit status 2 before any model loads (the tools other than the job share `run_main`)."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "good.jsonl").write_text('{"id": "a", "turns": ["hello"]}\n')
    names = {"EMPTY": str(tmp_path / "empty.jsonl"), "GOOD": str(tmp_path / "good.jsonl"), "OUT": str(tmp_path / "out")}
    argv = [names.get(a, a) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "pipelines.evaluate", *argv], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "outputs.jsonl").exists()
