"""Self-distillation data: prompts, the deterministic split, and the target's own answers.

Split: a prompt's split is a pure function of its `id` (sha256 bucket out of 64), so every
stage and every rerun agrees on it, whatever files or order:
    eval   buckets  0..7  (1/8)   offline evaluation and the drafter report
    calib  buckets  8..11 (1/16)  STS calibration (held out from training and from eval)
    train  the rest
A derived prompt (`rewrite_prompts`: the same text under another instruction) is named
`<base id>+<tag>` and takes its base's split, so an eval article never reaches training
under a new instruction.

Answers are appended to a JSON Lines file one batch at a time; a rerun skips ids already
there, so generation is resumable and can be stopped at any point.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "calib", "eval")
DERIVED = "+"  # separates a derived prompt's base id from its tag


def base_id(prompt_id: str) -> str:
    """The prompt a derived one was made from ("cnndm-0003+brief" -> "cnndm-0003")."""
    return prompt_id.split(DERIVED, 1)[0]


def split_of(prompt_id: str) -> str:
    bucket = int(hashlib.sha256(base_id(prompt_id).encode()).hexdigest()[:8], 16) % 64
    return "eval" if bucket < 8 else "calib" if bucket < 12 else "train"


@dataclass
class Prompt:
    id: str
    source: str
    domain: str
    text: str  # the first user turn

    @property
    def split(self) -> str:
        return split_of(self.id)


def load_prompts(folder: str | Path, files: Iterable[str] | None = None) -> list[Prompt]:
    """Prompts of the given files (all *.jsonl when None), in file order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"prompt folder {folder} not found (the bundled prompt sets are in data/prompts)")
    paths = sorted(folder.glob("*.jsonl")) if files is None else [folder / (f if f.endswith(".jsonl") else f + ".jsonl") for f in files]
    out: list[Prompt] = []
    for p in paths:
        for line in p.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                r = json.loads(line)
                out.append(Prompt(r["id"], r.get("source", p.stem), r.get("domain", "unknown"), r["turns"][0]))
    return out


@dataclass(frozen=True)
class Rewrite:
    """Another instruction over a domain's prompts: `find` (the instruction the prompts carry,
    e.g. "Summarise the article:") replaced by `replace`, rows named `<id>+<tag>`. More greedy
    answers of the target on texts the drafter may train on, where a domain has few prompts."""

    tag: str
    domain: str
    find: str
    replace: str

    @classmethod
    def from_dict(cls, d: dict) -> Rewrite:
        missing = [k for k in ("tag", "domain", "find", "replace") if not d.get(k)]
        if missing:
            raise ValueError(f"a rewrite needs {missing}: {d}")
        if DERIVED in d["tag"] or "~" in d["tag"]:
            raise ValueError(f"a rewrite's tag may not contain {DERIVED!r} or '~': {d['tag']!r}")
        return cls(str(d["tag"]), str(d["domain"]), str(d["find"]), str(d["replace"]))


def rewrite_prompts(prompts: Iterable[Prompt], rewrite: Rewrite) -> list[Prompt]:
    """`rewrite` applied to every prompt of its domain whose text carries `find` (others are
    left out); each derived prompt keeps its base's source, domain and split."""
    return [
        Prompt(f"{p.id}{DERIVED}{rewrite.tag}", p.source, p.domain, p.text.replace(rewrite.find, rewrite.replace, 1))
        for p in prompts
        if p.domain == rewrite.domain and DERIVED not in p.id and rewrite.find in p.text
    ]


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from an interrupted write: ignore it (it is regenerated)
    return rows


PromptLimit = int | dict[str, int]  # one limit, or per domain with a "default"


def prompt_limit(limit: PromptLimit, domain: str) -> int:
    """The longest prompt (in tokens) to answer for `domain`: `limit` itself, or its entry for
    the domain, else its "default". Per-domain limits let long-prompt domains (summarisation:
    news articles of 380-530 tokens) in without paying their prefill for every domain."""
    if isinstance(limit, dict):
        return int(limit.get(domain, limit["default"]))
    return int(limit)


def plan_generation(
    prompts: list[Prompt],
    encode: Callable[[str], list[int]],
    split: str,
    max_prompt_tokens: PromptLimit,
    per_source: int | None = None,
) -> list[tuple[Prompt, list[int]]]:
    """The prompts of `split` to answer, shortest first (short prompts generate faster),
    at most `per_source` per source file (the shortest ones), prompts over the limit (see
    `prompt_limit`) dropped. Deterministic: ties break by id."""
    if isinstance(max_prompt_tokens, dict) and "default" not in max_prompt_tokens:
        raise ValueError(f"a per-domain max_prompt_tokens needs a 'default' entry, got {max_prompt_tokens}")
    chosen = []
    for p in prompts:
        if p.split != split:
            continue
        ids = encode(p.text)
        if len(ids) <= prompt_limit(max_prompt_tokens, p.domain):
            chosen.append((p, ids))
    if per_source is not None:
        by_src: dict[str, list] = {}
        for item in sorted(chosen, key=lambda x: (len(x[1]), x[0].id)):
            by_src.setdefault(item[0].source, []).append(item)
        chosen = [it for items in by_src.values() for it in items[:per_source]]
    return sorted(chosen, key=lambda x: (len(x[1]), x[0].id))

