"""Drafter registry: build a drafter from its name.

    none                 no drafting (plain autoregressive)
    ngram[:MAX[:MIN]]    model-free context lookup of the last MAX..MIN tokens (default 4..1),
                         multi-candidate trees
    draft-model:PATH     a smaller causal LM sharing the target's tokenizer (dir or .gguf)
    dspark[:PATH]        the trained DSpark block drafter (default: the shipped checkpoint),
                         drafting from the checkpoint's reduced vocabulary when it has one
    dspark-full[:PATH]   the same drafter over the whole vocabulary (for comparisons)
    dspark-nocopy[:PATH] the same drafter without its copy prior (for comparisons)
    dspark-chain[:PATH]  the same drafter proposing chains only, no branches (the paper's
                         block; for comparisons)
    auto                 dspark when a checkpoint is shipped for the target, else ngram
    A+B[+...]            every listed drafter each round, their trees merged into one
                         (e.g. dspark+ngram: the block drafter plus lookup in the whole prompt)
"""

from __future__ import annotations

import logging
from pathlib import Path

from dspark.drafters.base import DraftRequest, Drafter, DrafterBase, NoDrafter, VerifyOutcome
from dspark.drafters.ngram import NgramDrafter
from dspark.models import TargetModel

__all__ = ["DraftRequest", "Drafter", "DrafterBase", "NoDrafter", "NgramDrafter", "VerifyOutcome", "check_drafter_spec", "make_drafter"]

DSPARK_NAMES = ("dspark", "dspark-full", "dspark-nocopy", "dspark-chain")

LOG = logging.getLogger(__name__)


def make_drafter(spec: str, target: TargetModel) -> Drafter:
    if "+" in spec:
        from dspark.drafters.union import UnionDrafter

        return UnionDrafter([make_drafter(part, target) for part in spec.split("+")])
    name, _, arg = spec.strip().partition(":")
    if name == "auto":  # a default that works for any target: the trained drafter where one exists
        from dspark.dspark_drafter import default_checkpoint

        try:
            path = default_checkpoint(target)
        except FileNotFoundError:
            LOG.info("Drafter auto -> ngram (no DSpark drafter is shipped for target %r)", target.name)
            return NgramDrafter()
        LOG.info("Drafter auto -> dspark (%s)", path.name)
        return make_drafter("dspark", target)
    if name in ("none", "ar", ""):
        return NoDrafter()
    if name == "ngram":
        return ngram_from_arg(arg)
    if name == "draft-model":
        if not arg:
            raise ValueError("draft-model needs a path: draft-model:/path/to/model")
        from dspark.drafters.draft_model import DraftModelDrafter
        from dspark.models import load_model

        draft = load_model(arg, device=str(target.device), dtype=target.dtype)
        return DraftModelDrafter(draft, target)
    if name in DSPARK_NAMES:
        from dspark.dspark_drafter import DrafterOptions, load_drafter  # the trained block drafter

        options = DrafterOptions(branch_width=1) if name == "dspark-chain" else None
        return load_drafter(arg or None, target, options=options, full_vocab=name == "dspark-full", copy_prior=name != "dspark-nocopy")
    raise unknown_drafter(spec)


def ngram_from_arg(arg: str) -> NgramDrafter:
    """`ngram[:MAX[:MIN]]`'s argument -> the drafter (ValueError for sizes it refuses)."""
    max_n, _, min_n = arg.partition(":")
    kwargs = {"max_ngram": int(max_n)} if max_n else {}
    if min_n:
        kwargs["min_ngram"] = int(min_n)
    return NgramDrafter(**kwargs)


def unknown_drafter(spec: str) -> ValueError:
    return ValueError(
        f"unknown drafter {spec!r}; choose auto, none, ngram, draft-model:PATH, dspark[:PATH], dspark-full[:PATH], "
        "dspark-nocopy[:PATH], dspark-chain[:PATH] or a union A+B"
    )


def check_drafter_spec(spec: str, target_name: str) -> None:
    """What `make_drafter` would refuse for a target of this display name, found without
    loading anything: an unknown name, bad n-gram sizes, a missing model or checkpoint.
    Raises ValueError or FileNotFoundError."""
    from dspark.dspark_drafter import DEFAULT_CHECKPOINTS
    from dspark.models import locate_model

    for part in spec.split("+"):
        name, _, arg = part.strip().partition(":")
        if name in ("auto", "none", "ar", ""):
            continue
        if name == "ngram":
            ngram_from_arg(arg)
        elif name == "draft-model":
            if not arg:
                raise ValueError("draft-model needs a path: draft-model:/path/to/model")
            locate_model(arg)
        elif name in DSPARK_NAMES:
            path = Path(arg) if arg else DEFAULT_CHECKPOINTS.get(target_name)
            if path is None or not (path / "config.json").is_file():
                raise FileNotFoundError(f"no DSpark drafter checkpoint at {arg}" if arg else
                                        f"no DSpark drafter is shipped for target {target_name!r}; pass a checkpoint directory")
        else:
            raise unknown_drafter(spec)
