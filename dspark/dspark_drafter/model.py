"""The DSpark drafter network: a parallel block backbone, a Markov head and a confidence head.

One forward drafts a whole block of gamma tokens after the anchor:

    input   [anchor, mask, mask, ..., mask]              (gamma embeddings, shared + frozen)
    context H_ctx = RMSNorm(W_c [n(h_l1); ...; n(h_lm)])  (last N committed target positions)
    layers  Llama-style blocks whose keys/values are [K(H_ctx); K(block)], bidirectional
    output  h_k (k = 1..gamma) and base logits U_k = LMHead(h_k)  (shared + frozen)

Block position k-1 predicts draft token x_k (position 0 holds the anchor and predicts x_1).

Markov head: p_k(v) ∝ exp(U_k(v) + B(x_{k-1}, v)), B = W1[x_{k-1}] · W2 (rank r), x_0 = anchor.
Confidence head: c_k = sigmoid(w · [h_k ; W1[x_{k-1}]] + b): it sees the PREVIOUS token only,
so a node's confidence never depends on its own token (the draft-tree invariant).
markov_rank = 0 gives the parallel-only ablation (no bias; confidence from h_k alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dspark.cpu_matmul import PackedLinear


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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [S] -> cos, sin [S, head_dim] (Llama's half-split layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
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
    than `h @ weight.T` (one thread, 7 rows through SmolLM2's 49k-vocabulary head: 47 -> 27 ms;
    the drafter's small layers gain nothing); training batches keep the usual layout. Only the
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

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.hd).transpose(1, 2)  # [B, n, S, D]

    def forward(
        self,
        x: torch.Tensor,  # [B, G, d]
        ctx: torch.Tensor,  # [B, N, d] H_ctx (already normed)
        mask: torch.Tensor,  # [B, 1, G, N+G] bool
        rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin [N+G, D]
    ) -> torch.Tensor:
        g, n = x.shape[1], ctx.shape[1]
        hn = self.input_norm(x)
        both = torch.cat([ctx, hn], dim=1)  # [B, N+G, d]: context enters keys/values only
        q = self._heads(self.q_proj(hn), self.h)  # [B, H, G, D]
        k = self._heads(self.k_proj(both), self.kv)  # [B, KV, N+G, D]
        v = self._heads(self.v_proj(both), self.kv)
        cos, sin = rope
        q = apply_rope(q, cos[n:], sin[n:])
        k = apply_rope(k, cos, sin)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, G, D]
        x = x + self.o_proj(a.transpose(1, 2).reshape(x.shape[0], g, self.h * self.hd))
        hn = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn))


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
        # The target's oneDNN-packed LM head (dspark.cpu_matmul) when it has one: a bound
        # method, not a submodule, so it stays out of state_dict() and .to()
        self.packed_head: Callable[[torch.Tensor], torch.Tensor] | None = None
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

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()}

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

    def backbone(self, ctx: torch.Tensor, ctx_valid: torch.Tensor, anchor: torch.Tensor, depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, N, d] projected context (right-aligned, oldest first), ctx_valid [B, N],
        anchor [B] -> final-normed states h [B, G', d] and conf_h [B, G'] for block positions
        1..G' (G' = depth or G): everything but the vocabulary-sized heads."""
        g, n = self.cfg.gamma, ctx.shape[1]
        x = self.block_inputs(anchor)
        # Positions: context 0..N-1, anchor N, masks N+1..; RoPE is relative so the absolute
        # offset in the real sequence does not matter.
        pos = torch.arange(n + g, device=x.device)
        rope = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        mask = block_attention_mask(ctx_valid, g)
        ctx = ctx.to(x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, mask, rope)
        h = self.final_norm(x)[:, : depth or g]  # [B, G', d]
        d = self.cfg.hidden_size
        conf_h = (h @ self.conf_head.weight[0, :d].to(h.dtype)).float() + self.conf_head.bias.float()  # [B, G']
        return h, conf_h

    def forward_block(self, ctx: torch.Tensor, ctx_valid: torch.Tensor, anchor: torch.Tensor, depth: int | None = None) -> BlockOutput:
        """`backbone` plus base logits over the whole vocabulary (logits only for the first
        `depth` positions: the LM head is most of the drafter's cost)."""
        h, conf_h = self.backbone(ctx, ctx_valid, anchor, depth)
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
        self, ctx: torch.Tensor, ctx_valid: torch.Tensor, tokens: torch.Tensor, vocab: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training/eval path. tokens [B, G+1] = [anchor, y_1..y_G]; the Markov head and the
        confidence at position k condition on the TRUE previous token y_{k-1} (exactly what
        inference sees whenever positions < k were accepted).
        Returns draft logits [B, G, V] float32 and confidence logits [B, G]. With `vocab`
        (sorted token ids, the reduced draft vocabulary) the logits are [B, G, Vd], column i
        scoring token vocab[i]: the distribution the drafter samples from at run time."""
        h, conf_h = self.backbone(ctx, ctx_valid, tokens[:, 0])
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
    return model


def final_norm_weight(target_model) -> torch.Tensor | None:
    norm = getattr(getattr(target_model, "model", None), "norm", None)
    return None if norm is None else norm.weight.detach()
