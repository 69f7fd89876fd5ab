"""Every command-line entry point explains itself: `--help` names the command as users run it
(`python -m pipelines.NAME`) and says what every option does."""

from __future__ import annotations

import contextlib
import importlib
import io
import re

import pytest

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
