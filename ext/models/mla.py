"""Attention kind "mla": DeepSeek's multi-head latent attention over a compressed cache.

Per layer (transformers 5 `DeepseekV3Attention`): the query is q_proj(h), or
q_b_proj(RMSNorm(q_a_proj(h))) when `q_lora_rank` is set, split per head into
qk_nope_head_dim and qk_rope_head_dim dims; kv_a_proj_with_mqa(h) gives the latent
(kv_lora_rank dims, then RMSNorm'd) and one rotary key shared by every head;
kv_b_proj expands the latent into each head's key (qk_nope_head_dim) and value
(v_head_dim) rows. The two RMSNorms use epsilon 1e-6 whatever rms_norm_eps says,
as transformers builds them.

What is cached, per token and layer, is the latent and the rotary key — kv_lora_rank
+ qk_rope_head_dim floats (576 for DeepSeek-V3), not nH × (qk_head_dim + v_head_dim)
— and no key is ever expanded: kv_b_proj's key rows are folded into the query
(q_latent[h] = W_UK[h]^T q_nope[h]), attention runs against the latents
(`_kernels.latent_attention`), and its value rows are applied to the attended latent
(o[h] = W_UV[h] u[h]) — DeepSeek-V2 §2.1.2's weight absorption. The order of
arithmetic differs from transformers' expanded form, which the reference tolerance
absorbs; every row is still computed alone in a fixed order, so prefill at once, one
token at a time, batching and threads give the same bits.

Shape legend: T tokens of the step, H hidden_size, nH heads, r kv_lora_rank, dn
qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim, qr q_lora_rank, S capacity.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ext.formats.quant import ATTENTION
from ext.kernels import _kernels as K_
from ext.models.attention import Segments
from ext.models.config import ModelConfig
from ext.models.kvcache import CacheShapes, KVCache, cache_bytes_per_token
from ext.models.rope import Rope, yarn_mscale
from ext.models.weights import Weight

F32 = np.float32
MLA_NORM_EPS = 1e-6   # DeepseekV3RMSNorm's default, used for q_a_layernorm and kv_a_layernorm


@dataclass
class MlaWeights:
    """One layer's MLA weights: linear weights in their stored format, norm vectors
    and biases in f32."""

    q: Weight | None                 # [nH*(dn+dr), H] q_proj, when q_lora_rank is None
    q_a: Weight | None               # [qr, H]
    q_a_bias: np.ndarray | None      # [qr] (attention_bias)
    q_a_norm: np.ndarray | None      # [qr]
    q_b: Weight | None               # [nH*(dn+dr), qr]
    kv_a: Weight                     # [r+dr, H] kv_a_proj_with_mqa
    kv_a_bias: np.ndarray | None     # [r+dr]
    kv_a_norm: np.ndarray            # [r]
    kv_b: Weight                     # [nH*(dn+dv), r]: per head dn key rows, then dv value rows
    o: Weight                        # [H, nH*dv]
    o_bias: np.ndarray | None        # [H]


class LatentAttention:
    """The "mla" attention kind of one model: loads each layer's weights, computes a
    layer's attention for a step, and owns the step's buffers (for up to `chunk`
    tokens) and RoPE tables. Not thread-safe (one engine thread)."""

    def __init__(self, config: ModelConfig, chunk: int, n_threads: int, fast: bool = False):
        c = self.config = config
        m = self.mla = config.mla
        self.n_threads = n_threads
        self.fast = fast          # fast numerics for quantised projections (not kv_b's heads)
        nH = c.num_attention_heads
        self.q_a = np.empty((chunk, m.q_lora_rank or 1), F32)
        self.q = np.empty((chunk, nH * m.qk_head_dim), F32)
        self.kv_a = np.empty((chunk, m.kv_lora_rank + m.qk_rope_head_dim), F32)
        self.latent = np.empty((chunk, m.kv_lora_rank), F32)
        self.q_nope = np.empty((chunk, nH, m.qk_nope_head_dim), F32)
        self.q_latent = np.empty((chunk, nH, m.kv_lora_rank + m.qk_rope_head_dim), F32)
        self.u = np.empty((chunk, nH, m.kv_lora_rank), F32)
        self.attn = np.empty((chunk, nH, m.v_head_dim), F32)
        self.o = np.empty((chunk, c.hidden_size), F32)
        self.rope = Rope(c, chunk)
        scale = float(m.qk_head_dim) ** -0.5
        y = c.rope_scaling
        if y is not None and y.mscale_all_dim:                  # transformers' yarn_apply_mscale
            scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
        self.scale = scale

    @staticmethod
    def cache_shapes(config: ModelConfig) -> CacheShapes:
        """Per layer: one [S, r + dr] array, the latent then the rotary key of each token."""
        m = config.mla
        return [((m.kv_lora_rank + m.qk_rope_head_dim,),)] * config.num_hidden_layers

    @classmethod
    def kv_bytes_per_token(cls, config: ModelConfig) -> int:
        return cache_bytes_per_token(cls.cache_shapes(config))

    @staticmethod
    def weights_per_token(config: ModelConfig) -> int:
        """Multiply-adds of one layer's projections for one token: q (through q_lora_rank
        or not), kv_a, kv_b's key rows folded into the query and value rows into the
        output (per head), o."""
        m, H, nH = config.mla, config.hidden_size, config.num_attention_heads
        q_rows = nH * m.qk_head_dim
        q = H * q_rows if m.q_lora_rank is None else m.q_lora_rank * (H + q_rows)
        kv = H * (m.kv_lora_rank + m.qk_rope_head_dim)
        folded = nH * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + folded + nH * m.v_head_dim * H

    def new_cache(self, capacity: int, max_capacity: int) -> KVCache:
        return KVCache(self.cache_shapes(self.config), capacity, max_capacity)

    def load(self, layer: int, tensor, linear) -> MlaWeights:
        """Layer `layer`'s weights: linear weights through `linear(module, shape, role)`
        (in their stored format: FP8 stays FP8), norms and biases through
        `tensor(name, shape, f32=False)`."""
        c, m = self.config, self.mla
        H, nH = c.hidden_size, c.num_attention_heads
        a = f"model.layers.{layer}.self_attn"
        q_rows, lat = nH * m.qk_head_dim, m.kv_lora_rank + m.qk_rope_head_dim
        lora = m.q_lora_rank
        bias = c.qkv_bias
        return MlaWeights(
            q=linear(f"{a}.q_proj", (q_rows, H), ATTENTION) if lora is None else None,
            q_a=linear(f"{a}.q_a_proj", (lora, H), ATTENTION) if lora else None,
            q_a_bias=tensor(f"{a}.q_a_proj.bias", (lora,), f32=True) if lora and bias else None,
            q_a_norm=tensor(f"{a}.q_a_layernorm.weight", (lora,), f32=True) if lora else None,
            q_b=linear(f"{a}.q_b_proj", (q_rows, lora), ATTENTION) if lora else None,
            kv_a=linear(f"{a}.kv_a_proj_with_mqa", (lat, H), ATTENTION),
            kv_a_bias=tensor(f"{a}.kv_a_proj_with_mqa.bias", (lat,), f32=True) if bias else None,
            kv_a_norm=tensor(f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,), f32=True),
            kv_b=linear(f"{a}.kv_b_proj", (nH * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                        ATTENTION),
            o=linear(f"{a}.o_proj", (H, nH * m.v_head_dim), ATTENTION),
            o_bias=tensor(f"{a}.o_proj.bias", (H,), f32=True) if c.o_bias else None,
        )

    def begin_step(self, positions: np.ndarray) -> None:
        """The step's positions ([T] float32): its RoPE angles."""
        self.rope.set_positions(positions)

    def __call__(self, l: int, w: MlaWeights, segments: Segments, h: np.ndarray) -> np.ndarray:
        """Layer l's attention output [T, H] (a view of this object's buffer) for the
        normed hidden state h [T, H]; appends the step's latents and rotary keys to each
        segment's cache at its current length (the caller advances the lengths)."""
        c, m, nt = self.config, self.mla, self.n_threads
        T, nH = h.shape[0], c.num_attention_heads
        r, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q = self.q[:T]                                           # [T, nH*(dn+dr)]
        if w.q is not None:
            K_.matmul(w.q, h, q, nt, fast=self.fast)
        else:
            q_a = self.q_a[:T]
            K_.matmul(w.q_a, h, q_a, nt, fast=self.fast)         # [T, qr]
            if w.q_a_bias is not None:
                q_a += w.q_a_bias
            K_.rmsnorm(q_a, w.q_a_norm, MLA_NORM_EPS, q_a, nt)
            K_.matmul(w.q_b, q_a, q, nt, fast=self.fast)
        kv_a = self.kv_a[:T]
        K_.matmul(w.kv_a, h, kv_a, nt, fast=self.fast)           # [T, r+dr]: latent | rotary key
        if w.kv_a_bias is not None:
            kv_a += w.kv_a_bias
        latent = self.latent[:T]                                 # [T, r]
        np.copyto(latent, kv_a[:, :r])
        K_.rmsnorm(latent, w.kv_a_norm, MLA_NORM_EPS, latent, nt)
        kv_a[:, :r] = latent
        q3 = q.reshape(T, nH, dn + dr)
        self.rope.apply(q3, offset=dn)
        self.rope.apply(kv_a.reshape(T, 1, r + dr), offset=r)
        q_nope, u = self.q_nope[:T], self.u[:T]                  # u: [T, nH, r]
        np.copyto(q_nope, q3[:, :, :dn])
        K_.matmul_heads(w.kv_b, 0, dn, q_nope, u, True, nt)      # W_UK^T q_nope, per head
        q_latent = self.q_latent[:T]                             # [T, nH, r+dr]
        q_latent[:, :, :r] = u
        q_latent[:, :, r:] = q3[:, :, dn:]
        for kv, r0, r1 in segments:                              # each row sees its own cache
            pos0 = kv.length
            (cache,) = kv.layers[l]                              # [S, r+dr]
            cache[pos0:pos0 + r1 - r0] = kv_a[r0:r1]
            K_.latent_attention(q_latent[r0:r1], cache, pos0, self.scale, u[r0:r1], nt)
        attn = self.attn[:T]                                     # [T, nH, dv]
        K_.matmul_heads(w.kv_b, dn, dv, u, attn, False, nt)      # W_UV u, per head
        o = self.o[:T]
        K_.matmul(w.o, attn.reshape(T, nH * dv), o, nt, fast=self.fast)  # [T, H]
        if w.o_bias is not None:
            o += w.o_bias
        return o
