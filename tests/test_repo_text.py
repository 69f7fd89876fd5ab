"""The repository stands on its own and speaks of what it is: no tracked text points outside
it or names an issue or a numbered work period, every link in the docs resolves inside it, the
README stays one screen and CI runs exactly the README's commands."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Third-party prompt text is quoted as published (a SWE-bench problem statement may well cite
# its tracker's numbers); everything else is ours.
THIRD_PARTY = re.compile(r"^data/prompts/.*\.jsonl$")
OUTSIDE_OR_HISTORY = re.compile(
    r"\.\./shared\b|(?<![\w.])/(?:work|root|home)/\w"  # paths outside the repository
    r"|\bissues?\s*#?\d+|\bsessions?\s+\d+"  # issue numbers, numbered work periods
    , re.IGNORECASE
)
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in out.splitlines() if (REPO / name).is_file()]


def text_of(name: str) -> str | None:
    data = (REPO / name).read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary: Parquet, safetensors, PNG
    return data.decode("utf-8", errors="replace")


def test_no_tracked_text_points_outside_the_repo_or_names_an_issue():
    hits = []
    for name in tracked_files():
        if THIRD_PARTY.match(name) or (text := text_of(name)) is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_OR_HISTORY.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


def markdown_files() -> list[str]:
    return [name for name in tracked_files() if name.endswith(".md")]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+\s+(.*)$", page.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_resolves_inside_the_repo():
    broken = []
    for name in markdown_files():
        page = REPO / name
        for target in MARKDOWN_LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file_part, _, anchor = target.partition("#")
            path = (page.parent / file_part).resolve() if file_part else page
            if not path.exists() or (path != REPO and REPO not in path.parents):
                broken.append(f"{name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_one_screen_and_the_model_card_one_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
    card = REPO / "dspark" / "checkpoints" / "dspark-smollm2-135m-instruct" / "README.md"
    assert len(card.read_text().splitlines()) <= 150


def test_ci_runs_the_readme_commands():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## The three commands\s+```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    setup, job, tests = commands
    assert job == "python -m pipelines.generate"
    ci = (REPO / ".ci" / "run").read_text()
    ci_commands = [line.replace("python -m pip install --quiet", "pip install") for line in ci.splitlines()]
    assert setup in ci_commands
    assert ci.rstrip().splitlines()[-1] == tests
