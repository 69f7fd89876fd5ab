"""The DSpark drafter network: a parallel block backbone, a Markov head and a confidence head.

One forward drafts a whole block of gamma tokens after the anchor:

    input   [anchor, mask, mask, ..., mask]              (gamma embeddings, shared + frozen)
    context H_ctx = RMSNorm(W_c [n(h_l1); ...; n(h_lm)])  (last N committed target positions)
    layers  Llama-style blocks whose keys/values are [K(H_ctx); K(block)], bidirectional
    output  h_k (k = 1..gamma) and base logits U_k = LMHead(h_k)  (shared + frozen)

Block position k-1 predicts draft token x_k (position 0 holds the anchor and predicts x_1).
The context's keys and values depend on the context alone (`context_kv`): training projects
each sequence's context once for all its blocks, and the run-time drafter once per committed
position, so a window of N positions costs attention, not N projections per block.

Markov head: p_k(v) ∝ exp(U_k(v) + B(x_{k-1}, v)), B = W1[x_{k-1}] · W2 (rank r), x_0 = anchor.
Confidence head: c_k = sigmoid(w · [h_k ; W1[x_{k-1}]] + b): it sees the PREVIOUS token only,
so a node's confidence never depends on its own token (the draft-tree invariant).
markov_rank = 0 gives the parallel-only ablation (no bias; confidence from h_k alone).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.cpu_matmul import KernelChoice, PackedLinear, fuse_linears


@dataclass
class DSparkConfig:
    vocab_size: int
    hidden_size: int  # equals the target's: embedding and LM head are shared
    target_hidden_size: int
    target_layers: tuple[int, ...]  # indices into the target's hidden_states tuple
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    gamma: int = 7
    context_len: int = 64  # committed target positions injected as keys/values
    markov_rank: int = 64  # 0 = parallel-only ablation
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        self.target_layers = tuple(int(x) for x in self.target_layers)
        if self.gamma < 1 or self.num_layers < 1 or self.context_len < 1:
            raise ValueError("gamma, num_layers and context_len must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not self.target_layers:
            raise ValueError("target_layers must name at least one target layer")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    @staticmethod
    def from_dict(d: dict) -> "DSparkConfig":
        return DSparkConfig(**d)

    @staticmethod
    def for_target(model_config, **overrides) -> "DSparkConfig":
        """Defaults derived from a Hugging Face (Llama-like) target config."""
        n = model_config.num_hidden_layers
        # low / middle / high layers, as EAGLE-3 and DFlash do
        layers = tuple(sorted({max(1, n // 15), n // 2, max(1, n - 2)}))
        heads = model_config.num_attention_heads
        kv = getattr(model_config, "num_key_value_heads", heads) or heads
        rope = getattr(model_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(model_config, "rope_theta", 10000.0))
        base = dict(
            vocab_size=model_config.vocab_size,
            hidden_size=model_config.hidden_size,
            target_hidden_size=model_config.hidden_size,
            target_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=getattr(model_config, "head_dim", None) or model_config.hidden_size // heads,
            intermediate_size=model_config.intermediate_size,
            rope_theta=float(theta),
            rms_eps=float(getattr(model_config, "rms_norm_eps", 1e-5)),
        )
        base.update(overrides)
        return DSparkConfig(**base)


@dataclass
class BlockOutput:
    hidden: torch.Tensor  # [B, G, d] final-normed drafter states h_k
    base_logits: torch.Tensor  # [B, G, V] U_k (float32)
    conf_h: torch.Tensor  # [B, G] w_h · h_k + b (the token-independent part of the confidence logit)


# ---------------------------------------------------------------- small pure functions


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    return y * weight if weight is not None else y


@functools.lru_cache(maxsize=8)
def rope_inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[head_dim / 2] (cached: every drafting round needs them twice)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [S] -> cos, sin [S, head_dim] (Llama's half-split layout)."""
    inv = rope_inverse_frequencies(head_dim, float(theta), positions.device)
    freqs = positions.float()[:, None] * inv[None, :]  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D]; cos/sin [S, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def lm_head_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [..., d] @ weight[V, d].T -> logits [..., V].

    For a handful of rows (one round's draft block) CPU BLAS runs `weight @ h.T` much faster
    than `h @ weight.T` (for a vocabulary-sized head; the drafter's small layers gain nothing);
    training batches keep the usual layout. Only the
    drafter uses this: its logits steer proposals, so rounding cannot change verified output."""
    rows = h.reshape(-1, h.shape[-1])  # [M, d]
    if rows.shape[0] > 8 or h.device.type != "cpu":
        return h @ weight.T
    return (weight @ rows.T).T.reshape(*h.shape[:-1], weight.shape[0])


def block_attention_mask(ctx_valid: torch.Tensor, gamma: int) -> torch.Tensor:
    """ctx_valid [B, N] bool -> [B, 1, G, N+G] bool: every block query sees the valid context
    and the whole block (bidirectional inside the block)."""
    b = ctx_valid.shape[0]
    blk = torch.ones(b, gamma, dtype=torch.bool, device=ctx_valid.device)
    keys = torch.cat([ctx_valid, blk], dim=1)  # [B, N+G]
    return keys[:, None, None, :].expand(b, 1, gamma, keys.shape[1])


def normalize_context(feats: torch.Tensor, num_layers: int, eps: float) -> torch.Tensor:
    """[..., m*d_t] concatenated target states -> each layer's slice RMS-normalised.

    Why: SmolLM2's middle layers carry massive activations (RMS ~170 vs ~5 elsewhere), which
    would swamp the projection; per-layer normalisation makes every layer count."""
    shape = feats.shape
    x = feats.reshape(*shape[:-1], num_layers, shape[-1] // num_layers)
    return rms_norm(x, eps).reshape(shape)


# ---------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight.to(x.dtype))


class DraftLayer(nn.Module):
    """A Llama decoder layer whose attention also sees the injected context keys/values."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.kv, self.hd = h, kv, hd
        self.input_norm = RMSNorm(d, cfg.rms_eps)
        self.post_norm = RMSNorm(d, cfg.rms_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        # Inference only (`fuse_projections`): q/k/v and gate/up each as one packed matmul.
        # Bound methods, not submodules: they stay out of state_dict() and training.
        self.fused_qkv: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.fused_gate_up: Callable[[torch.Tensor], torch.Tensor] | None = None

    def fuse_projections(self) -> bool:
        """Run q/k/v and gate/up as one matmul each at inference (their linears must be
        packed alike; `fuse_linears` checks the fused outputs equal the parts' to the bit).
        Returns whether both fused."""
        qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        gate_up = fuse_linears([self.gate_proj, self.up_proj])
        self.fused_qkv = None if qkv is None else qkv.forward
        self.fused_gate_up = None if gate_up is None else gate_up.forward
        return qkv is not None and gate_up is not None

    def _qkv(self, hn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fused_qkv is None or torch.is_grad_enabled():  # the fused copy is frozen: never train through it
            return self.q_proj(hn), self.k_proj(hn), self.v_proj(hn)
        return self.fused_qkv(hn).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)

    def _mlp(self, hn: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is None or torch.is_grad_enabled():
            gate, up = self.gate_proj(hn), self.up_proj(hn)
        else:
            gate, up = self.fused_gate_up(hn).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.hd).transpose(1, 2)  # [B, n, S, D]

    def context_kv(self, ctx: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """H_ctx [..., N, d] and cos/sin [N, D] of its positions -> this layer's context keys
        (RoPE applied) and values, [..., N, KV*D] each. They depend on the context alone, so
        the run-time drafter keeps them per request and projects each committed position once."""
        k = self.k_proj(ctx).unflatten(-1, (self.kv, self.hd))  # [..., N, KV, D]
        k = apply_rope(k, rope[0][:, None, :], rope[1][:, None, :])
        return k.flatten(-2), self.v_proj(ctx)

    def forward(
        self,
        x: torch.Tensor,  # [B, G, d]
        ctx_kv: tuple[torch.Tensor, torch.Tensor],  # [S, N, KV*D] each: S context rows shared by the B blocks
        mask: torch.Tensor,  # [B, 1, G, N+G] bool
        rope_blk: tuple[torch.Tensor, torch.Tensor],  # cos/sin [B, 1, G, D] of each block's positions
        ctx_index: torch.Tensor | None = None,  # [B] block -> its context row (None: S == B, in order)
    ) -> torch.Tensor:
        b, g = x.shape[:2]
        rep = self.h // self.kv
        hn = self.input_norm(x)
        q, k, v = self._qkv(hn)
        q = apply_rope(self._heads(q, self.h), *rope_blk)  # [B, H, G, D]
        k = apply_rope(self._heads(k, self.kv), *rope_blk)  # [B, KV, G, D]
        v = self._heads(v, self.kv)
        # context enters keys/values only, each context row once, then shared by its blocks
        k_ctx, v_ctx = (t.to(x.dtype).unflatten(-1, (self.kv, self.hd)).transpose(-3, -2) for t in ctx_kv)  # [S, KV, N, D]
        if ctx_index is not None:
            k_ctx, v_ctx = k_ctx[ctx_index], v_ctx[ctx_index]  # [B, KV, N, D]
        k, v = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)  # [B, KV, N+G, D]
        # every query of a block sees the same keys, so the `rep` query heads of a KV head fold
        # into one [rep*G]-row attention: no copy of the keys/values per query head
        q = q.reshape(b, self.kv, rep * g, self.hd)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, :1])  # [B, KV, rep*G, D]
        a = a.reshape(b, self.h, g, self.hd)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, g, self.h * self.hd))
        return x + self._mlp(self.post_norm(x))


class DSparkModel(nn.Module):
    """Trainable drafter parameters plus the target's frozen embedding and LM head.

    The shared weights are non-persistent buffers: they never train, never enter
    `state_dict()` (so never the checkpoint) and always come from the target."""

    def __init__(self, cfg: DSparkConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embedding {tuple(embed_weight.shape)} does not match config ({cfg.vocab_size}, {cfg.hidden_size})")
        if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"LM head {tuple(lm_head_weight.shape)} does not match config")
        self.cfg = cfg
        d = cfg.hidden_size
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        # The target's packed LM head (dspark.cpu_matmul) when it has one: a bound
        # method, not a submodule, so it stays out of state_dict() and .to()
        self.packed_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.head_kernels: KernelChoice | None = None  # how that head is packed (the draft vocabulary's rows follow it)
        m = len(cfg.target_layers)
        self.ctx_proj = nn.Linear(m * cfg.target_hidden_size, d, bias=False)  # W_c
        self.ctx_norm = RMSNorm(d, cfg.rms_eps)
        # init the mask embedding at the embedding table's mean: an "average token"
        self.mask_embed = nn.Parameter(embed_weight.detach().float().mean(0).clone())
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(d, cfg.rms_eps)
        r = cfg.markov_rank
        if r > 0:
            self.markov_w1 = nn.Embedding(cfg.vocab_size, r)  # W1 [V, r]
            self.markov_w2 = nn.Parameter(torch.zeros(cfg.vocab_size, r))  # W2^T [V, r]; zero: starts parallel-only
            nn.init.normal_(self.markov_w1.weight, std=1.0 / math.sqrt(r))
        self.conf_head = nn.Linear(d + r, 1)  # w = [w_h ; w_r], b
        nn.init.zeros_(self.conf_head.weight)
        self._init_layers()

    def _init_layers(self) -> None:
        for layer in self.layers:
            for name, p in layer.named_parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
            # residual outputs start small so the first steps see a near-identity network
            nn.init.normal_(layer.o_proj.weight, std=0.02 / math.sqrt(2 * len(self.layers)))
            nn.init.normal_(layer.down_proj.weight, std=0.02 / math.sqrt(2 * len(self.layers)))
        nn.init.normal_(self.ctx_proj.weight, std=1.0 / math.sqrt(self.ctx_proj.in_features))

    @property
    def markov(self) -> bool:
        return self.cfg.markov_rank > 0

    # ---- context

    def project_context(self, feats: torch.Tensor) -> torch.Tensor:
        """[..., m*d_t] raw concatenated target states -> H_ctx [..., d]."""
        x = normalize_context(feats.to(self.ctx_proj.weight.dtype), len(self.cfg.target_layers), self.cfg.rms_eps)
        return self.ctx_norm(self.ctx_proj(x))

    # ---- backbone

    def block_inputs(self, anchor: torch.Tensor) -> torch.Tensor:
        """anchor [B] -> [B, G, d]: anchor embedding then G-1 mask embeddings."""
        b, g = anchor.shape[0], self.cfg.gamma
        emb = F.embedding(anchor, self.embed_weight).to(self.mask_embed.dtype)  # [B, d]
        mask = self.mask_embed[None, None, :].expand(b, g - 1, -1)
        return torch.cat([emb[:, None, :], mask], dim=1)

    def context_kv(self, ctx: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """H_ctx [..., N, d] at positions start..start+N-1 (or `positions` [N]) -> every layer's
        context keys (RoPE applied) and values [..., N, KV*D] (see DraftLayer.context_kv)."""
        ctx = ctx.to(self.mask_embed.dtype)
        pos = torch.arange(start, start + ctx.shape[-2], device=ctx.device) if positions is None else positions
        rope = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)  # [N, D]
        return [layer.context_kv(ctx, rope) for layer in self.layers]

    def backbone(
        self,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_valid: torch.Tensor,
        anchor: torch.Tensor,
        depth: int | None = None,
        ctx_index: torch.Tensor | None = None,
        block_pos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's context keys/values [S, N, KV*D] (`context_kv`), ctx_valid [B, N] (what
        block b may see), anchor [B] -> final-normed states h [B, G', d] and conf_h [B, G'] for
        block positions 1..G' (G' = depth or G): everything but the vocabulary-sized heads.

        block_pos [B]: block b's anchor position, in the positions the keys were rotated at
        (None: N, i.e. right after `context_kv(ctx)`'s window, as a right-aligned window at run
        time). RoPE is relative, so only the distances matter. ctx_index [B] lets many blocks
        share one context row (training: several anchors of one sequence, projected once)."""
        b, g, n = anchor.shape[0], self.cfg.gamma, ctx_kv[0][0].shape[1]
        x = self.block_inputs(anchor)
        dev = x.device
        start = torch.full((b,), n, device=dev) if block_pos is None else block_pos.to(dev)
        cos, sin = rope_cos_sin((start[:, None] + torch.arange(g, device=dev)).reshape(-1), self.cfg.head_dim, self.cfg.rope_theta)
        rope_blk = cos.view(b, 1, g, -1), sin.view(b, 1, g, -1)  # [B, 1, G, D]
        mask = block_attention_mask(ctx_valid, g)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, mask, rope_blk, ctx_index)
        h = self.final_norm(x)[:, : depth or g]  # [B, G', d]
        d = self.cfg.hidden_size
        conf_h = (h @ self.conf_head.weight[0, :d].to(h.dtype)).float() + self.conf_head.bias.float()  # [B, G']
        return h, conf_h

    def forward_block(
        self,
        ctx: torch.Tensor,
        ctx_valid: torch.Tensor,
        anchor: torch.Tensor,
        depth: int | None = None,
        ctx_index: torch.Tensor | None = None,
        block_pos: torch.Tensor | None = None,
    ) -> BlockOutput:
        """`backbone` plus base logits over the whole vocabulary (logits only for the first
        `depth` positions: the LM head is most of the drafter's cost)."""
        h, conf_h = self.backbone(self.context_kv(ctx), ctx_valid, anchor, depth, ctx_index, block_pos)
        return BlockOutput(h, self.head_logits(h), conf_h)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> base logits [..., V] float32 through the shared LM head (the target's
        packed copy at inference when it has one)."""
        h = h.to(self.lm_head_weight.dtype)
        if self.packed_head is not None and not torch.is_grad_enabled():
            return self.packed_head(h).float()
        return lm_head_logits(h, self.lm_head_weight).float()

    # ---- Markov and confidence heads

    def markov_features(self, prev: torch.Tensor) -> torch.Tensor | None:
        """prev [...] token ids -> W1[prev] [..., r] (None for the parallel-only ablation)."""
        return self.markov_w1(prev) if self.markov else None

    def markov_bias(self, feat: torch.Tensor | None) -> torch.Tensor | float:
        """W1[prev] [..., r] -> B [..., V] float32."""
        if feat is None:
            return 0.0
        return (feat.float() @ self.markov_w2.float().T)

    def conf_logit(self, conf_h: torch.Tensor, feat: torch.Tensor | None) -> torch.Tensor:
        """conf_h [...] + w_r · W1[prev] -> confidence logit [...] (before calibration)."""
        if feat is None:
            return conf_h
        d = self.cfg.hidden_size
        return conf_h + feat.float() @ self.conf_head.weight[0, d:].float()

    def teacher_forced(
        self,
        ctx: torch.Tensor,
        ctx_valid: torch.Tensor,
        tokens: torch.Tensor,
        vocab: torch.Tensor | None = None,
        ctx_index: torch.Tensor | None = None,
        block_pos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training/eval path. tokens [B, G+1] = [anchor, y_1..y_G]; the Markov head and the
        confidence at position k condition on the TRUE previous token y_{k-1} (exactly what
        inference sees whenever positions < k were accepted).
        Returns draft logits [B, G, V] float32 and confidence logits [B, G]. With `vocab`
        (sorted token ids, the reduced draft vocabulary) the logits are [B, G, Vd], column i
        scoring token vocab[i]: the distribution the drafter samples from at run time."""
        h, conf_h = self.backbone(self.context_kv(ctx), ctx_valid, tokens[:, 0], None, ctx_index, block_pos)
        feat = self.markov_features(tokens[:, :-1])  # [B, G, r]
        if vocab is None:
            logits = self.head_logits(h) + self.markov_bias(feat)
        else:
            head = self.lm_head_weight[vocab]  # [Vd, d], frozen
            logits = lm_head_logits(h.to(head.dtype), head).float()
            if feat is not None:
                logits = logits + feat.float() @ self.markov_w2[vocab].float().T
        return logits, self.conf_logit(conf_h, feat)


def build_model(cfg: DSparkConfig, target_model) -> DSparkModel:
    """A drafter sharing a Hugging Face target's (frozen) input embedding and LM head."""
    emb = target_model.get_input_embeddings().weight
    head = target_model.get_output_embeddings()
    model = DSparkModel(cfg, emb, head.weight)
    if isinstance(head, PackedLinear):
        model.packed_head = head.forward
        model.head_kernels = head.choice
    return model

