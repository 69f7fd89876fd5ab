"""Drafter checkpoints: a directory with `model.safetensors` (trainable weights only),
`config.json` (architecture, STS temperatures, target fingerprint, training notes) and,
optionally, `draft_vocab.safetensors` (the reduced draft vocabulary, `vocab.py`).

The target's embedding and LM head are not stored: they are shared, frozen and re-attached
from the target at load time, which is why loading checks the target's fingerprint first.
Only safetensors is read: no pickle, ever.

With a draft vocabulary, the Markov head's W2 may be stored over its rows only (version 2,
`markov_w2.draft_rows` [Vd, r]): W2[v] scores token v as the next draft token, and a drafter
trained over the draft vocabulary never learns the other rows (`confine_markov_head` zeroes
them). At rank 256 that is 2 MB in bf16 instead of 25.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dspark.dspark_drafter.copy_prior import CopyRule, copy_rule_from_dict
from dspark.dspark_drafter.model import DSparkConfig, DSparkModel, build_model
from dspark.dspark_drafter.vocab import VOCAB_FILE, read_draft_vocab, save_draft_vocab

FORMAT = "dspark-drafter"
VERSION = 2  # 2: W2 may be stored over the draft vocabulary's rows; version 1 files still load
WEIGHTS = "model.safetensors"
W2_ROWS = "markov_w2.draft_rows"  # W2[draft_vocab] [Vd, r]; the other rows are zero
CONFIG = "config.json"


class TargetMismatchError(ValueError):
    """The checkpoint was trained for a different target model."""


@dataclass
class Fingerprint:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tokenizer_hash: str

    @staticmethod
    def of(target) -> "Fingerprint":
        """Fingerprint of a `dspark.models.TargetModel`."""
        cfg = target.model.config
        return Fingerprint(
            name=target.name,
            vocab_size=int(target.vocab_size),
            hidden_size=int(cfg.hidden_size),
            num_layers=int(cfg.num_hidden_layers),
            tokenizer_hash=target.tokenizer_hash(),
        )


def check_fingerprint(saved: dict, target, where: str = "checkpoint", allow_name_mismatch: bool = False) -> None:
    """Raise TargetMismatchError naming every field that differs."""
    have = Fingerprint.of(target).__dict__
    diffs = []
    for key in ("vocab_size", "hidden_size", "num_layers", "tokenizer_hash", "name"):
        if key == "name" and allow_name_mismatch:
            continue
        if key in saved and saved[key] != have[key]:
            diffs.append(f"{key}: drafter expects {saved[key]!r}, target has {have[key]!r}")
    if diffs:
        raise TargetMismatchError(
            f"The DSpark drafter at {where} was trained for target {saved.get('name')!r}, "
            f"not for {have['name']!r}: " + "; ".join(diffs)
            + ". Train a drafter for this target (python -m pipelines.train_drafter) or pick the matching target."
        )


@dataclass
class Checkpoint:
    config: DSparkConfig
    state: dict[str, torch.Tensor]
    temperatures: list[float] | None = None
    offsets: list[float] | None = None  # per-position confidence offsets (None: temperatures only)
    target: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # calibration figures, training card data
    draft_vocab: torch.Tensor | None = None  # sorted token ids the drafter proposes from; None = all
    copy_prior: CopyRule | None = None  # n-gram copy rule (bonuses or a scorer) fitted on the calibration split


def save_checkpoint(
    path: str | Path,
    model: DSparkModel,
    target_fingerprint: Fingerprint | dict,
    temperatures: list[float] | None = None,
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    offsets: list[float] | None = None,
    copy_prior: CopyRule | None = None,
    draft_vocab: torch.Tensor | None = None,
) -> Path:
    """Write weights (in `dtype`, bf16 by default: half the size) and config atomically.
    With `draft_vocab` (sorted token ids) the vocabulary is written too, and W2 over its rows
    only: the model's other W2 rows must be zero (`confine_markov_head`), so nothing is lost."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fp = target_fingerprint.__dict__ if isinstance(target_fingerprint, Fingerprint) else dict(target_fingerprint)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    compact = draft_vocab is not None and model.markov
    if compact:
        w2 = model.markov_w2.detach()
        if bool(w2[_outside(draft_vocab, len(w2), w2.device)].any()):
            raise ValueError("W2 has non-zero rows outside the draft vocabulary: confine_markov_head(model, draft_vocab) first")
        state[W2_ROWS] = state.pop("markov_w2")[draft_vocab.cpu()].contiguous()
    if draft_vocab is not None:
        save_draft_vocab(out, draft_vocab)
    meta = {
        "format": FORMAT,
        "version": VERSION if compact else 1,  # a file older readers can read stays version 1
        "architecture": model.cfg.to_dict(),
        "calibration": {
            "temperatures": temperatures,
            **({"offsets": offsets} if offsets is not None else {}),
            **({"copy_prior": copy_prior.to_dict()} if copy_prior is not None else {}),
        },
        "target": fp,
        "extra": extra or {},
    }
    tmp_w, tmp_c = out / (WEIGHTS + ".tmp"), out / (CONFIG + ".tmp")
    save_file(state, str(tmp_w), metadata={"format": "pt", "dspark": FORMAT})
    tmp_c.write_text(json.dumps(meta, indent=2, sort_keys=True))
    tmp_w.replace(out / WEIGHTS)
    tmp_c.replace(out / CONFIG)
    return out


def read_checkpoint(path: str | Path) -> Checkpoint:
    p = Path(path)
    if not (p / CONFIG).is_file() or not (p / WEIGHTS).is_file():
        raise FileNotFoundError(f"{p} is not a DSpark drafter checkpoint (needs {CONFIG} and {WEIGHTS})")
    meta = json.loads((p / CONFIG).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{p / CONFIG} is not a {FORMAT} config (format={meta.get('format')!r})")
    if int(meta.get("version", 0)) > VERSION:
        raise ValueError(f"{p} has checkpoint version {meta['version']}; this DSpark reads up to {VERSION}")
    config = DSparkConfig.from_dict(meta["architecture"])
    state = load_file(str(p / WEIGHTS))
    vocab = read_draft_vocab(p, config.vocab_size)
    if W2_ROWS in state:
        rows = state.pop(W2_ROWS)
        if vocab is None or rows.shape[0] != len(vocab):
            raise ValueError(f"{p}: W2 is stored over {rows.shape[0]} draft-vocabulary rows, but the checkpoint's "
                             f"{VOCAB_FILE} {'is missing' if vocab is None else f'has {len(vocab)} tokens'}")
        state["markov_w2"] = rows.new_zeros(config.vocab_size, rows.shape[1]).index_copy_(0, vocab, rows)
    return Checkpoint(
        config=config,
        state=state,
        temperatures=(meta.get("calibration") or {}).get("temperatures"),
        offsets=(meta.get("calibration") or {}).get("offsets"),
        target=meta.get("target") or {},
        extra=meta.get("extra") or {},
        draft_vocab=vocab,
        copy_prior=copy_rule_from_dict((meta.get("calibration") or {}).get("copy_prior")),
    )


def load_model_for_target(
    path: str | Path, target, allow_name_mismatch: bool = False, dtype: torch.dtype | None = None
) -> tuple[DSparkModel, Checkpoint]:
    """Read a checkpoint, check it belongs to `target` (a TargetModel), attach the target's
    shared weights. The model is returned in eval mode in `dtype` (default: the target's)."""
    ck = read_checkpoint(path)
    check_fingerprint(ck.target, target, where=str(path), allow_name_mismatch=allow_name_mismatch)
    model = build_model(ck.config, target.model)
    _load_weights(model, ck, str(path))
    model.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)
    return model, ck


@torch.no_grad()
def confine_markov_head(model: DSparkModel, draft_vocab: torch.Tensor) -> int:
    """Zero W2's rows outside the draft vocabulary; returns how many were non-zero.

    W2[v] is the Markov head's half of token v's bias as the next draft token. The drafter
    proposes only draft-vocabulary tokens, and a drafter trained over them (`reduced_vocab`)
    never learns the other rows: they keep whatever a warm start brought and only shrink under
    weight decay. Their one use: a token the copy prior copies from outside the vocabulary was
    scored with its row; it is now scored from its LM-head row and the copy bonus alone. Call
    before calibrating, so that the calibration and the figures are of what is saved."""
    if not model.markov:
        return 0
    outside = _outside(draft_vocab, model.cfg.vocab_size, model.markov_w2.device)
    nonzero = int(model.markov_w2[outside].any(dim=1).sum())
    model.markov_w2[outside] = 0.0
    return nonzero


def _outside(draft_vocab: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] bool: True for the tokens not in the draft vocabulary."""
    mask = torch.ones(vocab_size, dtype=torch.bool, device=device)
    mask[draft_vocab.to(device)] = False
    return mask


def _load_weights(model: DSparkModel, ck: Checkpoint, where: str) -> None:
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in ck.state.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the architecture (missing {missing}, unexpected {unexpected})")


# Architecture fields a warm start may grow: the grown model starts as the same function
# (grow_state), so training continues from the checkpoint instead of from scratch.
GROWABLE = ("num_layers", "markov_rank")


def _may_differ(key: str, mine: dict, theirs: dict) -> bool:
    """Whether a warm start may change architecture field `key` from `theirs` to `mine`."""
    if key == "context_len":  # how many committed positions a block may attend to, not a shape
        return True
    if key in GROWABLE and mine.get(key, 0) > theirs.get(key, 0):
        return True
    # markov_rank -> 0: the parallel-only ablation continued from a trained drafter's backbone,
    # so that it can be compared with that drafter at the same amount of training
    return key == "markov_rank" and mine.get(key) == 0


def warm_start(model: DSparkModel, path: str | Path, target) -> Checkpoint:
    """Copy a checkpoint's trained weights into `model` (built for training, same target) so
    that training continues from it instead of from random weights: more data, more steps, a
    wider context window, or a deeper drafter / a higher Markov rank (see grow_state) without
    paying again for the steps already done. A model with markov_rank 0 takes everything but
    the Markov head (the parallel-only ablation of the checkpoint; unlike growing, it does not
    start as the same function). Calibration temperatures are not carried over; the calibrate
    stage fits new ones."""
    ck = read_checkpoint(path)
    check_fingerprint(ck.target, target, where=str(path))
    mine, theirs = model.cfg.to_dict(), ck.config.to_dict()
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k) and not _may_differ(k, mine, theirs))
    if differ:
        detail = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
        grow = " (num_layers and markov_rank may only grow, or markov_rank drop to 0)" if set(differ) & set(GROWABLE) else ""
        raise ValueError(f"{path}: cannot warm-start from a different drafter architecture ({detail}){grow}")
    state = grow_state(model.state_dict(), {k: v.float() for k, v in ck.state.items()}, ck.config.num_layers, ck.config.markov_rank)
    _load_weights(model, Checkpoint(config=model.cfg, state=state), str(path))
    return ck


def grow_state(fresh: dict[str, torch.Tensor], old: dict[str, torch.Tensor], old_layers: int, old_rank: int) -> dict[str, torch.Tensor]:
    """The state of a deeper / higher-rank drafter that computes what the old one computed.

    `fresh` is the new model's freshly initialised state. Layers past `old_layers` are appended
    with zero output projections (o_proj, down_proj): their residual branches add nothing until
    training moves them. Markov rank r_old -> r: W1 keeps its first r_old columns and gets fresh
    random ones; the new columns of W2 and of the confidence head's W1 part are zero, so the
    bias B = W1[x] W2 and the confidence logits are unchanged. Rank r_old -> 0 drops W1, W2 and
    the confidence head's W1 part (fresh has no Markov keys; the head keeps w_h and b)."""
    out: dict[str, torch.Tensor] = {}
    d = fresh["final_norm.weight"].shape[0]
    for key, init in fresh.items():
        if key in old and old[key].shape == init.shape:
            out[key] = old[key]
        elif key.startswith("layers.") and int(key.split(".")[1]) >= old_layers:
            zero = key.endswith(("o_proj.weight", "down_proj.weight"))
            out[key] = torch.zeros_like(init) if zero else init
        elif key == "markov_w1.weight" and old_rank > 0:
            out[key] = torch.cat([old[key], init[:, old_rank:]], dim=1)  # [V, r]
        elif key == "markov_w2" and old_rank > 0:
            out[key] = torch.cat([old[key], torch.zeros_like(init[:, old_rank:])], dim=1)  # [V, r]
        elif key in ("markov_w1.weight", "markov_w2"):  # rank 0 -> r: W2 = 0 gives B = 0
            out[key] = torch.zeros_like(init) if key == "markov_w2" else init
        elif key == "conf_head.weight" and init.shape[1] == d:  # rank -> 0: keep w_h
            out[key] = old[key][:, :d]
        elif key == "conf_head.weight":  # [1, d + r]: w_h, then the W1 part
            out[key] = torch.cat([old[key], torch.zeros_like(init[:, d + old_rank:])], dim=1)
        else:
            out[key] = old[key]  # a shape that cannot grow: _load_weights reports the mismatch
    return out
