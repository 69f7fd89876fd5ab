"""The drafter interface: one strategy contract, many drafters (n-gram, draft model, DSpark).

The engine owns the target and its KV cache; a drafter only sees token ids (and, when it
asks for them, the target's hidden states of committed tokens) and returns one
`DraftTree` per active request. Per-request state lives in `DraftRequest.state`, a dict the
drafter owns; the engine creates it on admission and drops it when the request leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from dspark.sampling import SamplingNoise, SamplingParams
from dspark.tree import DraftTree


@dataclass
class DraftRequest:
    """What a drafter sees of one active request."""

    request_id: int
    token_ids: list[int]  # prompt + generated so far; token_ids[-1] is the anchor (not yet in the target cache)
    sampling: SamplingParams
    state: dict[str, Any] = field(default_factory=dict)  # drafter-owned
    # sampled requests: the noise the target draws with; a drafter that samples its proposal
    # for the token at index t of token_ids draws it with `noise.draw(q, t)`
    noise: SamplingNoise | None = None

    def sampling_noise(self) -> SamplingNoise:
        if self.noise is None:
            raise ValueError(f"request {self.request_id} samples but has no SamplingNoise")
        return self.noise


@dataclass
class VerifyOutcome:
    """What verification decided for one request in one round (fed back to the drafter)."""

    request_id: int
    tree: DraftTree  # the tree that was verified (after scheduling)
    accepted_nodes: list[int]  # node indices on the accepted path, root to leaf
    next_token: int  # correction or bonus token: the new anchor
    # Target hidden states of the tokens committed this round (anchor + accepted nodes), one
    # tensor [n_committed, hidden] per layer in `Drafter.target_layers`; None unless asked for.
    hidden: list[torch.Tensor] | None = None


@runtime_checkable
class Drafter(Protocol):
    name: str
    # Indices into the target's `hidden_states` tuple (0 = embeddings, i = output of layer i)
    # the drafter wants for committed tokens; empty if it needs none.
    target_layers: tuple[int, ...]
    # False when `propose` must always see every active request (e.g. a drafter whose own
    # batched cache is aligned to the engine's rows); the engine then drafts all or none.
    drafts_row_subsets: bool

    def start(self, request: DraftRequest, prompt_hidden: list[torch.Tensor] | None) -> None:
        """A request joined. `prompt_hidden`: target states of token_ids[:-1], if asked for."""

    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        """Draft up to `max_depth` tokens deep after each request's anchor."""
        ...

    def observe(self, request: DraftRequest, outcome: VerifyOutcome) -> None:
        """Verification result for one request (token_ids already include the new tokens)."""

    def finish(self, request: DraftRequest) -> None:
        """The request left the batch."""


class DrafterBase:
    """Default no-op hooks, so simple drafters implement `propose` only."""

    name = "base"
    target_layers: tuple[int, ...] = ()
    drafts_row_subsets = True

    def start(self, request: DraftRequest, prompt_hidden: list[torch.Tensor] | None) -> None:
        return None

    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        raise NotImplementedError

    def observe(self, request: DraftRequest, outcome: VerifyOutcome) -> None:
        return None

    def finish(self, request: DraftRequest) -> None:
        request.state.clear()


class NoDrafter(DrafterBase):
    """Plain autoregressive decoding: never drafts."""

    name = "none"

    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        return [DraftTree() for _ in requests]
