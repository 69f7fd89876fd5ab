"""Self-distillation through the project's own engine, recording the target cache on the way.

`HiddenRecorder` is a drafter that never drafts: with the `fixed:1` scheduler and empty trees
every round verifies only the anchor, i.e. plain decoding (greedy or sampled), while the engine hands it
the target's hidden states of every committed token (it asks for the injected layers plus the
final normed layer). So one pass yields both the answers and their target cache: no second
forward over the data (which on a 2-core CPU would double the cost of the stage).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from dspark.drafters.base import DraftRequest, DrafterBase, VerifyOutcome
from dspark.training.cache import shard_item, shard_name, write_shard
from dspark.training.data import Prompt
from dspark.tree import DraftTree


class HiddenRecorder(DrafterBase):
    name = "recorder"

    def __init__(self, layers: tuple[int, ...], final_layer: int) -> None:
        self.layers = tuple(layers)
        self.target_layers = self.layers + (final_layer,)
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, request: DraftRequest, prompt_hidden: list[torch.Tensor] | None) -> None:
        request.state["chunks"] = [self._pack(prompt_hidden)] if prompt_hidden and prompt_hidden[0].shape[0] else []

    def _pack(self, hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        m = len(self.layers)
        feats = torch.cat([h.to(torch.bfloat16) for h in hidden[:m]], dim=-1).cpu()
        return feats, hidden[m].to(torch.bfloat16).cpu()

    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        return [DraftTree() for _ in requests]

    def observe(self, request: DraftRequest, outcome: VerifyOutcome) -> None:
        if outcome.hidden is not None:
            request.state["chunks"].append(self._pack(outcome.hidden))

    def finish(self, request: DraftRequest) -> None:
        chunks = request.state.get("chunks", [])
        if chunks:
            self.records[request.request_id] = (torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]))
        request.state.clear()


def answer_tokens(path: str | Path) -> Iterator[list[int]]:
    """The target's answer token ids from an answers.jsonl, streamed one line at a time."""
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["output_ids"]


def row_id(prompt_id: str, tag: str = "") -> str:
    """Cache row name: the prompt id, plus `~tag` for an extra sampled answer to it."""
    return f"{prompt_id}~{tag}" if tag else prompt_id


def row_seed(rid: str) -> int:
    return int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16)


def done_ids(out_dir: Path) -> tuple[set[str], int]:
    """Prompt ids already in the shards of `out_dir`, and the index the next shard takes: one
    past the highest (not the count, so a shard moved out never gets another written over it)."""
    ids: set[str] = set()
    shards = sorted(out_dir.glob("shard_*.safetensors"))
    for path in shards:
        with safe_open(str(path), "pt") as f:
            ids.update(r["id"] for r in json.loads(f.metadata()["rows"]))
    return ids, 1 + max((int(p.name[len("shard_") : -len(".safetensors")]) for p in shards), default=-1)


def generate_with_cache(
    target,
    plan: list[tuple[Prompt, list[int]]],
    out_dir: str | Path,
    layers: tuple[int, ...],
    context_len: int,
    batch_size: int = 32,
    max_new_tokens: int = 128,
    shard_size: int = 64,
    log: Callable[[str], None] = print,
    deadline: float | None = None,
    temperature: float = 0.0,
    tag: str = "",
) -> int:
    """Answer the planned prompts through DSparkGenerator and write cache shards of
    `shard_size` answers each (plus answers.jsonl). Resumable: prompts already in a shard are
    skipped; a shard is the unit of work. Returns the number of answers added.

    Greedy by default. With `temperature` > 0 the answers are sampled (seeded per row from
    its id and `tag`, so reruns give the same text) and their rows are named `id~tag`: a
    second, different answer to the same prompt, in the same split. That is extra
    self-distillation data: the training labels are the target's own distributions at every
    position (recomputed from the cached final states), whichever token was then emitted."""
    from dspark.generator import DSparkGenerator

    if temperature > 0 and not tag:
        raise ValueError("a sampled pass needs a tag, so its rows are told apart from the greedy answers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps({"layers": list(layers), "context_len": context_len, "shard_size": shard_size}))
    done, k = done_ids(out)
    todo = [(p, ids) for p, ids in plan if row_id(p.id, tag) not in done]
    recorder = HiddenRecorder(layers, target.model.config.num_hidden_layers)
    gen = DSparkGenerator(target, drafter=recorder, scheduler="fixed:1", max_batch_size=batch_size)
    t0, c0, n_new, n_tok = time.time(), time.process_time(), 0, 0
    stats_path = out / "gen_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {"wall_s": 0.0, "cpu_s": 0.0, "answers": 0, "new_tokens": 0}
    for i in range(0, len(todo), shard_size):
        if deadline is not None and time.time() > deadline:
            log(f"deadline reached after {n_new} answers")
            break
        chunk = sorted(todo[i : i + shard_size], key=lambda x: len(x[1]))  # similar lengths share a prefill
        recorder.records.clear()
        seeds = [row_seed(row_id(p.id, tag)) for p, _ in chunk]
        results = gen.generate([ids for _, ids in chunk], max_new_tokens=max_new_tokens, temperature=temperature, seeds=seeds)
        items, rows = [], []
        for j, ((p, ids), r) in enumerate(zip(chunk, results)):
            if j not in recorder.records:
                continue
            feats, final = recorder.records[j]
            meta = {"id": row_id(p.id, tag), "domain": p.domain, "source": p.source, "split": p.split}
            items.append(shard_item(ids, r.token_ids, feats, final, context_len, meta))
            rows.append({**meta, "prompt_ids": ids, "output_ids": list(r.token_ids), "finish_reason": r.finish_reason})
            n_tok += len(r.token_ids)
        write_shard(out / shard_name(k), items)
        with (out / "answers.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        k += 1
        n_new += len(items)
        # cumulative generation cost (all runs into this folder), for the checkpoint card
        now = {"wall_s": time.time() - t0, "cpu_s": time.process_time() - c0, "answers": n_new, "new_tokens": n_tok}
        stats_path.write_text(json.dumps({key: stats[key] + now[key] for key in stats}))
        dt = time.time() - t0
        log(f"{out.name}{'~' + tag if tag else ''}: {shard_name(k - 1)} +{n_new} answers ({len(plan) - len(todo) + n_new}/{len(plan)}), {n_tok} new tokens in {dt:.0f}s = {n_tok / max(dt, 1e-9):.1f} tok/s")
    return n_new
