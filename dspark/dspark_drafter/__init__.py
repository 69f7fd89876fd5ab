"""DSpark's semi-autoregressive drafter: model, engine plug-in, checkpoints, calibration.

Engine entry point: `load_drafter(path_or_default, target) -> DSparkDrafter`.
"""

from __future__ import annotations

from pathlib import Path

from dspark.dspark_drafter.checkpoint import (
    Fingerprint,
    TargetMismatchError,
    confine_markov_head,
    load_model_for_target,
    read_checkpoint,
    save_checkpoint,
)
from dspark.dspark_drafter.drafter import DrafterOptions, DSparkDrafter
from dspark.dspark_drafter.model import DSparkConfig, DSparkModel, build_model

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
# target name -> shipped checkpoint directory
DEFAULT_CHECKPOINTS = {"smollm2-135m-instruct": CHECKPOINTS / "dspark-smollm2-135m-instruct"}


def default_checkpoint(target) -> Path:
    path = DEFAULT_CHECKPOINTS.get(target.name)
    if path is None or not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No shipped DSpark drafter for target {target.name!r}; train one with "
            "`python -m pipelines.train_drafter --config configs/train_smollm2.yaml` and pass its directory"
        )
    return path


def load_drafter(
    path_or_default: str | Path | None,
    target,
    options: DrafterOptions | None = None,
    allow_name_mismatch: bool = False,
    full_vocab: bool = False,
    copy_prior: bool = True,
) -> DSparkDrafter:
    """Build the engine plug-in from a checkpoint directory (or None / "default" / "dspark"
    for the shipped one) for `target` (a dspark.models.TargetModel). Raises
    TargetMismatchError when the checkpoint belongs to another target. The drafter proposes
    from the checkpoint's reduced vocabulary when it has one, unless `full_vocab`, and with
    the checkpoint's copy prior when it has one, unless `copy_prior` is False."""
    if path_or_default in (None, "", "default", "dspark"):
        path = default_checkpoint(target)
    else:
        path = Path(path_or_default)
    model, ck = load_model_for_target(path, target, allow_name_mismatch=allow_name_mismatch)
    vocab = None if full_vocab else ck.draft_vocab
    return DSparkDrafter(
        model,
        ck.temperatures,
        options=options,
        eos_token_ids=target.eos_token_ids,
        draft_vocab=vocab,
        offsets=ck.offsets,
        copy=ck.copy_prior if copy_prior else None,
    )


__all__ = [
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkModel",
    "DrafterOptions",
    "Fingerprint",
    "TargetMismatchError",
    "build_model",
    "confine_markov_head",
    "default_checkpoint",
    "load_drafter",
    "load_model_for_target",
    "read_checkpoint",
    "save_checkpoint",
]
