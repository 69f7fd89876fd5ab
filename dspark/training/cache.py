"""The target cache: hidden states of the injected target layers and the final hidden state,
for every self-distilled sequence, in safetensors shards on disk.

Shard k holds answer rows [k*S, (k+1)*S) of the answers file (file order), so shards are
deterministic and a rerun only builds the missing ones (each written atomically). Per row only
positions from max(0, P-1-N) on are kept (P = prompt length, N = context length): anchors sit
in the answer, and their context reaches N positions back.

Shard tensors (T = stored positions of all rows):
    tokens  int32 [T]          token ids
    feats   bf16  [T, m*d_t]   concatenated hidden_states[l] for l in the injected layers
    final   bf16  [T, d_t]     final (normed) hidden state: target logits = LMHead(final)
    offsets int64 [n+1]        row r occupies [offsets[r], offsets[r+1])
    answer_start int64 [n]     local index of the row's first answer token
plus metadata "rows": JSON list of {id, domain, source, split}.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark.training.data import read_jsonl


def shard_name(k: int) -> str:
    return f"shard_{k:05d}.safetensors"


def _forward_rows(target, rows: list[list[int]], layers: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the target over right-padded rows -> per row (feats [L, m*d], final [L, d]) in bf16."""
    lmax = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), lmax, dtype=torch.long)
    att = torch.zeros(len(rows), lmax, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
    with torch.no_grad():
        out = target.model(
            input_ids=ids.to(target.device), attention_mask=att.to(target.device), output_hidden_states=True, logits_to_keep=1
        )
    hs = out.hidden_states
    feats = torch.cat([hs[l] for l in layers], dim=-1).to(torch.bfloat16).cpu()
    final = hs[-1].to(torch.bfloat16).cpu()
    return [(feats[i, : len(r)], final[i, : len(r)]) for i, r in enumerate(rows)]


def shard_item(prompt_ids: list[int], output_ids: list[int], feats: torch.Tensor, final: torch.Tensor, context_len: int, meta: dict) -> dict:
    """One row of a shard. feats/final cover (at least) positions 0..L-2 of prompt + output;
    only positions from max(0, P-1-N) on are kept."""
    seq = list(prompt_ids) + list(output_ids)
    p = len(prompt_ids)
    s0 = max(0, p - 1 - context_len)
    n = len(seq) - s0
    f, h = feats[s0 : s0 + n].to(torch.bfloat16), final[s0 : s0 + n].to(torch.bfloat16)
    if f.shape[0] < n:  # the last token's states are never computed during generation: pad
        pad = n - f.shape[0]
        f = torch.cat([f, f.new_zeros(pad, f.shape[1])])
        h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
    return dict(
        tokens=torch.tensor(seq[s0:]),
        feats=f,
        final=h,
        answer_start=p - s0,
        meta={k: meta[k] for k in ("id", "domain", "source", "split")},
    )


def write_shard(path: Path, items: list[dict]) -> None:
    tokens, feats, final, offsets, starts, meta = [], [], [], [0], [], []
    for it in items:
        tokens.append(it["tokens"])
        feats.append(it["feats"])
        final.append(it["final"])
        offsets.append(offsets[-1] + len(it["tokens"]))
        starts.append(it["answer_start"])
        meta.append(it["meta"])
    tensors = {
        "tokens": torch.cat(tokens).to(torch.int32),
        "feats": torch.cat(feats).contiguous(),
        "final": torch.cat(final).contiguous(),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "answer_start": torch.tensor(starts, dtype=torch.int64),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"rows": json.dumps(meta)})
    tmp.replace(path)


def build_cache(
    target,
    answers_path: str | Path,
    out_dir: str | Path,
    layers: tuple[int, ...],
    context_len: int,
    shard_size: int = 64,
    batch_tokens: int = 4096,
    finalize: bool = True,
    log: Callable[[str], None] = print,
    deadline: float | None = None,
) -> int:
    """Build missing shards; `finalize` also writes the last, partial shard. Returns shards built."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps({"layers": list(layers), "context_len": context_len, "shard_size": shard_size}))
    rows = read_jsonl(answers_path)
    n_shards = (len(rows) + shard_size - 1) // shard_size if finalize else len(rows) // shard_size
    built, t0, tok = 0, time.time(), 0
    for k in range(n_shards):
        path = out / shard_name(k)
        chunk = rows[k * shard_size : (k + 1) * shard_size]
        if path.is_file():
            # a partial last shard is rebuilt once more rows exist
            with safe_open(str(path), "pt") as f:
                if len(json.loads(f.metadata()["rows"])) == len(chunk):
                    continue
        if deadline is not None and time.time() > deadline:
            log("deadline reached")
            break
        seqs = [r["prompt_ids"] + r["output_ids"] for r in chunk]
        order = sorted(range(len(chunk)), key=lambda i: len(seqs[i]))
        results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        i = 0
        while i < len(order):  # length-sorted batches of about batch_tokens padded tokens
            j = i + 1
            while j < len(order) and (j + 1 - i) * len(seqs[order[j]]) <= batch_tokens:
                j += 1
            batch = order[i:j]
            for idx, res in zip(batch, _forward_rows(target, [seqs[b] for b in batch], layers)):
                results[idx] = res
            i = j
        items = []
        for idx, r in enumerate(chunk):
            feats, final = results[idx]
            items.append(shard_item(r["prompt_ids"], r["output_ids"], feats, final, context_len, r))
            tok += len(items[-1]["tokens"])
        write_shard(path, items)
        built += 1
        dt = time.time() - t0
        log(f"cache shard {k + 1}/{n_shards}: {tok} stored positions in {dt:.0f}s")
    return built


# ------------------------------------------------------------------ reading


@dataclass
class RowInfo:
    shard: int
    row: int
    length: int  # stored positions
    answer_start: int
    id: str
    domain: str
    source: str


class CacheReader:
    """Index of a cache directory; shards are loaded one at a time on demand."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        spec_path = self.folder / "spec.json"
        if not spec_path.is_file():
            raise FileNotFoundError(f"{self.folder} is not a target cache (no spec.json)")
        self.spec = json.loads(spec_path.read_text())
        self.shards = sorted(self.folder.glob("shard_*.safetensors"))
        self.rows: list[RowInfo] = []
        for s, path in enumerate(self.shards):
            with safe_open(str(path), "pt") as f:
                meta = json.loads(f.metadata()["rows"])
                offsets = f.get_tensor("offsets").tolist()
                starts = f.get_tensor("answer_start").tolist()
            for r, m in enumerate(meta):
                self.rows.append(RowInfo(s, r, offsets[r + 1] - offsets[r], starts[r], m["id"], m["domain"], m["source"]))

    def load_shard(self, s: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.shards[s]))

    @staticmethod
    def row(shard: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
        a, b = int(shard["offsets"][r]), int(shard["offsets"][r + 1])
        return {"tokens": shard["tokens"][a:b].long(), "feats": shard["feats"][a:b], "final": shard["final"][a:b]}

    def num_positions(self) -> int:
        return sum(r.length for r in self.rows)


def anchors_for(info: RowInfo, gamma: int, stride: int, offset: int = 0, full_blocks: bool = False) -> list[int]:
    """Anchor positions (local indices) of a row: from the last prompt token through the
    answer, every `stride` positions starting at `offset`; `full_blocks` keeps only anchors
    whose whole gamma block lies inside the sequence (used for evaluation)."""
    first = info.answer_start - 1
    last = info.length - 1 - (gamma if full_blocks else 1)
    return list(range(first + offset, last + 1, stride))


@dataclass
class Batch:
    ctx_feats: torch.Tensor  # [S, L, m*d_t] bf16: one context row per sequence, left-aligned
    ctx_valid: torch.Tensor  # [B, L] bool: the context positions block b may see
    tokens: torch.Tensor  # [B, G+1] anchor, y_1..y_G
    final: torch.Tensor  # [B, G, d_t] bf16: target final states predicting y_1..y_G
    valid: torch.Tensor  # [B, G] bool
    ctx_index: torch.Tensor  # [B] long: block b's context row
    block_pos: torch.Tensor  # [B] long: position of block b's anchor in its context row


def make_batch(groups: list[tuple[dict[str, torch.Tensor], list[int]]], gamma: int, context_len: int) -> Batch:
    """Training blocks, grouped by sequence: groups = [(row, anchors)]. Each sequence's context
    is stored once (its positions from the first block's window to the last anchor) and shared
    by its blocks; block b sees the `context_len` positions right before its anchor.

    Why grouped: projecting the context is most of a step's work, and with a window of a whole
    prompt (hundreds of positions) per block it would grow with blocks x window; shared, it grows
    with sequences x length (how DFlash-style drafters train several anchors per sequence)."""
    md = groups[0][0]["feats"].shape[1]
    d = groups[0][0]["final"].shape[1]
    spans = [(max(0, min(anchors) - context_len), max(anchors)) for _, anchors in groups]  # [lo, hi) per row
    width = max(1, max(hi - lo for lo, hi in spans))
    b = sum(len(anchors) for _, anchors in groups)
    ctx = torch.zeros(len(groups), width, md, dtype=torch.bfloat16)
    ctx_valid = torch.zeros(b, width, dtype=torch.bool)
    ctx_index = torch.zeros(b, dtype=torch.long)
    block_pos = torch.zeros(b, dtype=torch.long)
    tokens = torch.zeros(b, gamma + 1, dtype=torch.long)
    final = torch.zeros(b, gamma, d, dtype=torch.bfloat16)
    valid = torch.zeros(b, gamma, dtype=torch.bool)
    i = 0
    for s, ((row, anchors), (lo, hi)) in enumerate(zip(groups, spans)):
        ctx[s, : hi - lo] = row["feats"][lo:hi]  # committed positions before the anchors
        for a in anchors:
            ctx_valid[i, max(lo, a - context_len) - lo : a - lo] = True
            ctx_index[i], block_pos[i] = s, a - lo
            t = row["tokens"][a : a + gamma + 1]
            tokens[i, : t.shape[0]] = t
            f = row["final"][a : a + gamma]
            final[i, : f.shape[0]] = f
            valid[i, : t.shape[0] - 1] = True
            i += 1
    return Batch(ctx, ctx_valid, tokens, final, valid, ctx_index, block_pos)
