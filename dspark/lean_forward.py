"""A lean decoder forward for Llama-family targets: the same arithmetic, less Python.

A small model's step spends a large share of its time outside the matmuls when it runs
through transformers' forward: per-module machinery (hooks, output recording, mask building,
kwargs plumbing) that a speculative round pays once per forward, on every round.
`LeanDecoder` runs the decoder as plain tensor code over the engine's `SlotCache`: per layer
RMSNorm, q/k/v projections, rotary embedding, grouped-query SDPA over the cached keys, output
projection, residual, RMSNorm, SiLU-gated MLP, residual. It calls the model's own modules and
parameters (nothing is copied or re-packed; biases, rope scaling and packed CPU kernels come
with them), so its logits match transformers' forward to float rounding: the tests assert it.
On SmolLM2 in float32 they differ by ~1e-5: one-token steps let SDPA group the KV heads where
transformers expands them, and on CPU blocks of several tokens stack each KV head's queries
(`fold_query_groups`), which reads each KV head's keys once per block instead of once per
query head. On other devices (CUDA) it makes transformers' kernel choices instead of the
fused CPU ones (`transformers_kernels`), so that reduced-precision outputs stay as close to
transformers' as the kernels allow (docs/numerics.md). Design note: docs/cpu-kernels.md.

Where the weights are packed for oneDNN (CPU float32), q/k/v and gate/up run as one matmul each
(`FusedProjections`, checked bit-identical to the separate layers): four calls a layer, not seven.

Only architectures whose forward is exactly the above are taken (`lean_support`); anything
else (other model types, sliding windows, non-SiLU MLPs, non-default attention scaling) keeps
transformers' forward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv  # what transformers' SDPA path runs

from dspark.attention import decoding_sdpa
from dspark.cpu_matmul import PACKED_MAX_ROWS, fuse_linears
from dspark.kv import SlotCache

# model_type -> decoder layers follow Llama's forward (Qwen2 adds q/k/v biases, handled by the
# modules themselves). Sliding-window attention is refused per config below.
LEAN_MODEL_TYPES = ("llama", "qwen2")
# Part of the cost-table cache key: bumping it makes every cached cost table be profiled again;
# bump it when a change here alters what a forward costs.
LEAN_FORWARD_VERSION = 7
# Blocks of 2 to this many tokens per row fold their query groups on CPU (`fold_query_groups`):
# verify blocks and trees, where it cuts attention time. Longer ones (prompt prefills) keep
# grouped SDPA: there the two cost about the same, and copying the mask for every query head
# makes the fold slower.
FOLD_MAX_TOKENS = 64
# One-token steps of several rows fold only in reduced precision: SDPA's grouped kernel for a
# single bfloat16 query is several times slower than the folded call on some CPUs. One row keeps
# the grouped kernel: that is transformers' one-token step to the bit, so bfloat16 `ar` at
# batch 1 stays token-identical to `hf`. In float32 the grouped kernel is the faster one and
# keeps its rounding.
FOLD_ONE_TOKEN_DTYPES = (torch.bfloat16, torch.float16)


def lean_support(model: nn.Module) -> str | None:
    """None when `LeanDecoder` can run this model; otherwise why not (for logs)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in LEAN_MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {LEAN_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no decoder stack with a rotary embedding"
    for layer in inner.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None):
            return "sliding-window attention"
        if abs(attn.scaling - attn.head_dim**-0.5) > 1e-12:
            return "non-default attention scaling"
    return None


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm (normalised in float32, then cast, then scaled) with
    torch's fused kernel: bit-identical to it in float32 and bfloat16, one op instead of six.
    In float32 the weight goes into the same call (no cast between normalising and scaling, and
    a product is the same either way round): one dispatch fewer, and a dispatch right after a
    layer's matmul has streamed its weights through the caches is costly."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype)


def transformers_kernels(device: torch.device) -> bool:
    """Whether to run the ops transformers runs rather than the faster equivalents.

    On CPU the fused RMSNorm and grouped-query SDPA under a mask are bit-identical to
    transformers' ops (tested), and faster; folded query groups for verify blocks are equal to
    float rounding (`fold_query_groups`), and faster still. On CUDA they are not the same
    kernels: grouped SDPA with a mask falls back to the math kernel (transformers expands the KV
    heads instead), and the fused RMSNorm rounds differently, so bfloat16 greedy outputs would
    drift from transformers' for no speed gain. There the lean path takes transformers' choices."""
    return device.type != "cpu"


def fold_mask(mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, 1, W, S] -> [B, 1, n_rep * W, S]: the block's mask repeated for each query head
    that shares a KV head (`fold_query_groups`); built once per forward, not per layer."""
    b, _, w, s = mask.shape
    return mask.expand(b, n_rep, w, s).reshape(b, 1, n_rep * w, s)


def fold_query_groups(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, folded_mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention as plain SDPA over each KV head's stacked queries.

    The n_rep query heads that share a KV head are stacked along the query axis, [B, Hkv,
    n_rep * W, dh], under the mask repeated to match (`fold_mask`). Each KV head's keys are then
    read once per block instead of once per query head. Same arithmetic as SDPA's `enable_gqa`,
    to the last bit or nearly: bit-identical on the CPUs it was checked on, except that on some
    of them 2- and 3-token blocks differ by ~2e-7 in float32 (the kernel's small-query path
    rounds differently), as one-token steps already differ from transformers' expanded-KV
    attention. One-token steps of several rows fold only in bfloat16 and float16
    (`FOLD_ONE_TOKEN_DTYPES`); otherwise they keep `enable_gqa`, its own kernel.
    `folded_mask` None: every key is visible."""
    b, h, w, dh = q.shape
    hk = keys.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, hk, h // hk * w, dh), keys, values, attn_mask=folded_mask)
    return out.view(b, h, w, dh)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., dh] -> sin with its first half negated, for `rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it, x*cos + rotate_half(x)*sin, to the bit:
    rotate_half(x) = [-x2, x1] is x rolled by half a head with the sign moved onto sin
    (`signed_sin`; negating is exact). Three ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


@dataclass(frozen=True)
class FusedProjections:
    """One decoder layer's input projections as two matmuls: [q | k | v] and [gate | up]."""

    qkv: nn.Module  # [T, d] -> [T, (H + 2 Hkv) dh]
    gate_up: nn.Module  # [T, d] -> [T, 2 ff]


# model -> its layers' FusedProjections, built once per model however many runners share it:
# the fused weights are copies (~0.55 GB for SmolLM2-135M in float32).
_FUSED: "weakref.WeakKeyDictionary[nn.Module, list[FusedProjections]]" = weakref.WeakKeyDictionary()


def fused_projections(model: nn.Module) -> list[FusedProjections] | None:
    """Per layer, q/k/v and gate/up fused into one packed matmul each (`fuse_linears`), or None
    where the model's linears are not packed (not CPU float32) or fusing would round
    differently. Checked on the first layer (the kernels depend on shapes, not weights)."""
    if model in _FUSED:
        return _FUSED[model]
    fused = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj], check=i == 0)
        gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj], check=i == 0)
        if qkv is None or gate_up is None:
            return None  # not remembered: the model may be packed later
        fused.append(FusedProjections(qkv, gate_up))
    _FUSED[model] = fused
    return fused


class LeanDecoder:
    """Runs a Llama-family causal LM over a block of tokens per row on a `SlotCache`."""

    def __init__(self, model: nn.Module) -> None:
        why = lean_support(model)
        if why is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {why}")
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = self.inner.layers[0].self_attn.head_dim
        param = next(model.parameters())
        self.transformers_kernels = transformers_kernels(param.device)
        self.fold_one_token = param.dtype in FOLD_ONE_TOKEN_DTYPES
        # blocks of up to PACKED_MAX_ROWS tokens (decode and verify rounds) use them; longer
        # prefills keep the separate layers (MKL's kernels, where fusing is not checked)
        self.fused = None if self.transformers_kernels else fused_projections(model)

    def norm(self, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        return module(x) if self.transformers_kernels else rms_norm(x, module)

    def folds(self, mask: torch.Tensor | None, rows: int, width: int) -> bool:
        """Whether a block of `rows` x `width` tokens runs `fold_query_groups`."""
        if self.num_kv_heads == self.num_heads or self.transformers_kernels:
            return False
        if width == 1:  # with or without a mask: one query sees every key it is given
            return self.fold_one_token and rows > 1
        return mask is not None and width <= FOLD_MAX_TOKENS

    def attention(
        self, q, keys, values, mask: torch.Tensor | None, is_causal: bool, fold: bool = False, folded_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [B, H, W, dh], keys/values [B, Hkv, S + W, dh], mask [B, 1, W, S + W] -> [B, H, W, dh];
        `fold`: the block `folds`, under `folded_mask` = `fold_mask(mask)` (None without a mask)."""
        grouped = self.num_kv_heads != self.num_heads
        n_rep = self.num_heads // self.num_kv_heads
        if mask is not None and grouped and self.transformers_kernels:
            return F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask)
        if fold:
            return fold_query_groups(q, keys, values, folded_mask)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=grouped)

    @torch.no_grad()
    def __call__(
        self,
        ids: torch.Tensor,  # [B, W]
        attention_mask: torch.Tensor | None,  # [B, 1, W, S + W] additive (SlotCache.block_inputs); None: see is_causal
        position_ids: torch.Tensor,  # [B, W]
        cache: SlotCache,
        hidden_layers: tuple[int, ...] = (),
        logits_positions: torch.Tensor | None = None,  # block positions to keep; None = all
        want_logits: bool = True,
        is_causal: bool = False,  # with no mask: causal block on an empty cache (else every key is visible)
        lengths: torch.Tensor | None = None,  # [B] tokens per row (the rest is padding); None = W each
    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """Appends the block's keys/values to `cache`; returns logits [B, W', V] (W' =
        len(logits_positions) or W) and the hidden states of `hidden_layers` [B, W, d] each,
        indexed like transformers' `output_hidden_states` (0 = embeddings, i = after layer i,
        num_layers = after the final norm).

        With `lengths`, the projections, MLPs and LM head run on the rows' real tokens only,
        packed together (`RaggedLayout`); attention keeps the padded [B, W] grid. Padding gets
        zero queries, keys and values, and zeros in the returned logits and hidden states."""
        with decoding_sdpa(ids.device):
            layout = RaggedLayout.of(lengths, *ids.shape)
            return self._forward(ids, attention_mask, position_ids, cache, hidden_layers, logits_positions, want_logits, is_causal, layout)

    def _forward(self, ids, attention_mask, position_ids, cache, hidden_layers, logits_positions, want_logits, is_causal, layout):
        h, hk, dh = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.inner.embed_tokens(layout.pack(ids))  # [T, d]: T = B * W, or the real tokens when packed
        cos, sin = self.inner.rotary_emb(x, position_ids)  # [B, W, dh]
        cos, sin = layout.pack(cos)[:, None], signed_sin(layout.pack(sin)[:, None])  # [T, 1, dh]: broadcast over heads
        fold = self.folds(attention_mask, *ids.shape)
        folded_mask = fold_mask(attention_mask, h // hk) if fold and attention_mask is not None else None
        want = set(hidden_layers)
        hidden: dict[int, torch.Tensor] = {0: x} if 0 in want else {}
        n = len(self.inner.layers)
        fused = self.fused if self.fused is not None and x.shape[0] <= PACKED_MAX_ROWS else None
        for i, layer in enumerate(self.inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            y = self.norm(x, layer.input_layernorm)
            if fused is None:
                q, k, v = attn.q_proj(y), attn.k_proj(y), attn.v_proj(y)
                q = rotate(q.view(-1, h, dh), cos, sin)  # [T, H, dh]
                k = rotate(k.view(-1, hk, dh), cos, sin)  # [T, Hkv, dh]
            else:
                qkv = fused[i].qkv(y)  # [T, (H + 2 Hkv) dh]
                qk = rotate(qkv[:, : (h + hk) * dh].view(-1, h + hk, dh), cos, sin)  # q and k rotated together
                q, k, v = qk[:, :h], qk[:, h:], qkv[:, (h + hk) * dh :]
            v = v.reshape(-1, hk, dh)
            keys, values = cache.layers[i].update(layout.grid(k).transpose(1, 2), layout.grid(v).transpose(1, 2))  # [B, Hkv, S + W, dh]
            o = self.attention(layout.grid(q).transpose(1, 2), keys, values, attention_mask, is_causal, fold, folded_mask)  # [B, H, W, dh]
            x = x + attn.o_proj(layout.pack(o.transpose(1, 2)).reshape(-1, h * dh))
            y = self.norm(x, layer.post_attention_layernorm)
            if fused is None:
                gate, up = mlp.gate_proj(y), mlp.up_proj(y)
            else:
                gate, up = fused[i].gate_up(y).chunk(2, dim=-1)
            x = x + mlp.down_proj(F.silu(gate) * up)
            if i + 1 in want and i + 1 < n:
                hidden[i + 1] = x
        logits = None
        if want_logits or n in want:
            x = self.norm(x, self.inner.norm)
            hidden[n] = x
        if want_logits:
            if logits_positions is None:
                logits = layout.grid(self.model.lm_head(x))
            else:
                logits = self.model.lm_head(layout.grid(x)[:, logits_positions])
        return logits, ([layout.grid(hidden[j]) for j in hidden_layers] if hidden_layers else None)


@dataclass(frozen=True)
class RaggedLayout:
    """Where a batch's real tokens sit in its right-padded [B, W] grid.

    Rows of a verify round carry different numbers of draft tokens (the `dspark` scheduler
    gives each row its own budget), and prompts of a prefill differ in length. Attention works
    on the padded grid (each row has its own cache), but everything else in a decoder layer
    treats tokens independently, so it can run on the real tokens alone, packed row after row:
    a batch priced by its total token count (the paper's B = sum_r (1 + l_r)) rather than by
    rows x the widest row. `index` is None when nothing is padded (then packing is a view).
    """

    rows: int
    width: int
    index: torch.Tensor | None  # [T] flat positions b * W + j of the real tokens, in order

    @staticmethod
    def of(lengths: torch.Tensor | None, rows: int, width: int) -> "RaggedLayout":
        if lengths is None or int(lengths.sum()) == rows * width:
            return RaggedLayout(rows, width, None)
        real = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]  # [B, W]
        return RaggedLayout(rows, width, real.flatten().nonzero().squeeze(1))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """[B, W, ...] -> [T, ...]"""
        flat = t.reshape(self.rows * self.width, *t.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def grid(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, W, ...], zeros at padding."""
        if self.index is None:
            return t.view(self.rows, self.width, *t.shape[1:])
        out = t.new_zeros(self.rows * self.width, *t.shape[1:])
        return out.index_copy_(0, self.index, t).view(self.rows, self.width, *t.shape[1:])
