"""Attention kind "gqa": grouped-query attention over a per-layer K/V cache.

Used by Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5 and GPT-OSS. Per layer: q/k/v
projections (optional biases), optional RMSNorm of q and k (per head, Qwen3-MoE and
GLM-4.5; over the whole projection, OLMoE), optional clamp of q, k, v (OLMoE
`clip_qkv`), RoPE (on the first rotary_dim dims of each head when partial, GLM-4.5;
YaRN-scaled, GPT-OSS), causal attention (optionally sliding-window, per layer) over the
sequence's cache, with GPT-OSS's per-head sink logits in the softmax, o projection
(optional bias). Source: transformers 5 `modeling_<family>.py`, `*Attention.forward`.

Shape legend: T tokens of the step, H hidden_size, nH attention heads, nKV key/value
heads, D head_dim, S cache capacity. Activations and the cache are float32; weights
stay in their stored dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ext.formats.quant import ATTENTION
from ext.kernels import _kernels as K_
from ext.models.config import ModelConfig
from ext.models.weights import Weight
from ext.models.kvcache import CacheShapes, KVCache, cache_bytes_per_token
from ext.models.rope import Rope

F32 = np.float32

# (kv, r0, r1): rows r0:r1 of the step continue that sequence's cache, in order.
Segments = list[tuple[KVCache, int, int]]


@dataclass
class GqaWeights:
    """One layer's attention weights: projections in their stored format (arrays or
    QuantizedWeights, ext/models/weights.py), norm vectors and biases in f32."""

    q: Weight                        # [nH*D, H]
    k: Weight                        # [nKV*D, H]
    v: Weight                        # [nKV*D, H]
    o: Weight                        # [H, nH*D]
    q_bias: np.ndarray | None        # [nH*D]
    k_bias: np.ndarray | None        # [nKV*D]
    v_bias: np.ndarray | None        # [nKV*D]
    q_norm: np.ndarray | None        # [D] ("head") or [nH*D] ("full")
    k_norm: np.ndarray | None        # [D] or [nKV*D]
    o_bias: np.ndarray | None = None  # [H] (GPT-OSS)
    sinks: np.ndarray | None = None   # [nH] (GPT-OSS)


class GroupedQueryAttention:
    """The "gqa" attention kind of one model: loads each layer's weights, computes a
    layer's attention for a step, and owns the step's buffers (for up to `chunk`
    tokens) and RoPE tables. Not thread-safe (one engine thread)."""

    def __init__(self, config: ModelConfig, chunk: int, n_threads: int, fast: bool = False):
        c = self.config = config
        self.n_threads = n_threads
        self.fast = fast          # fast numerics for quantised projections (_kernels docstring)
        D = c.head_dim
        q_dim, kv_dim = c.num_attention_heads * D, c.num_key_value_heads * D
        self.q = np.empty((chunk, q_dim), F32)
        self.k = np.empty((chunk, kv_dim), F32)
        self.v = np.empty((chunk, kv_dim), F32)
        self.attn = np.empty((chunk, q_dim), F32)
        self.o = np.empty((chunk, c.hidden_size), F32)
        self.rope = Rope(c, chunk)
        self.scale = float(D) ** -0.5

    @staticmethod
    def cache_shapes(config: ModelConfig) -> CacheShapes:
        """Per layer: K and V, each [nKV, S, D]."""
        kv = (config.num_key_value_heads, config.head_dim)
        return [(kv, kv)] * config.num_hidden_layers

    @classmethod
    def kv_bytes_per_token(cls, config: ModelConfig) -> int:
        return cache_bytes_per_token(cls.cache_shapes(config))

    @staticmethod
    def weights_per_token(config: ModelConfig) -> int:
        """Multiply-adds of one layer's projections for one token (q, k, v, o)."""
        H, D = config.hidden_size, config.head_dim
        return H * D * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)

    def new_cache(self, capacity: int, max_capacity: int) -> KVCache:
        return KVCache(self.cache_shapes(self.config), capacity, max_capacity)

    def load(self, layer: int, tensor, linear) -> GqaWeights:
        """Layer `layer`'s weights: linear weights through `linear(module, shape, role)`
        (in their stored format), norms and biases through `tensor(name, shape, f32=False)`."""
        c = self.config
        H, D = c.hidden_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * D, c.num_key_value_heads * D
        a = f"model.layers.{layer}.self_attn"
        bias = c.qkv_bias
        norm_q = {"head": (D,), "full": (q_dim,)}.get(c.qk_norm)
        norm_k = {"head": (D,), "full": (kv_dim,)}.get(c.qk_norm)
        return GqaWeights(
            q=linear(f"{a}.q_proj", (q_dim, H), ATTENTION),
            k=linear(f"{a}.k_proj", (kv_dim, H), ATTENTION),
            v=linear(f"{a}.v_proj", (kv_dim, H), ATTENTION),
            o=linear(f"{a}.o_proj", (H, q_dim), ATTENTION),
            q_bias=tensor(f"{a}.q_proj.bias", (q_dim,), f32=True) if bias else None,
            k_bias=tensor(f"{a}.k_proj.bias", (kv_dim,), f32=True) if bias else None,
            v_bias=tensor(f"{a}.v_proj.bias", (kv_dim,), f32=True) if bias else None,
            q_norm=tensor(f"{a}.q_norm.weight", norm_q, f32=True) if norm_q else None,
            k_norm=tensor(f"{a}.k_norm.weight", norm_k, f32=True) if norm_k else None,
            o_bias=tensor(f"{a}.o_proj.bias", (H,), f32=True) if c.o_bias else None,
            sinks=tensor(f"{a}.sinks", (c.num_attention_heads,), f32=True) if c.attention_sinks else None,
        )

    def begin_step(self, positions: np.ndarray) -> None:
        """The step's positions ([T] float32): its RoPE angles."""
        self.rope.set_positions(positions)

    def __call__(self, l: int, w: GqaWeights, segments: Segments, h: np.ndarray) -> np.ndarray:
        """Layer l's attention output [T, H] (a view of this object's buffer) for the
        normed hidden state h [T, H]; appends the step's keys and values to each
        segment's cache at its current length (the caller advances the lengths)."""
        c, nt = self.config, self.n_threads
        T, D = h.shape[0], c.head_dim
        nH, nKV = c.num_attention_heads, c.num_key_value_heads
        q, k, v = self.q[:T], self.k[:T], self.v[:T]
        K_.matmul(w.q, h, q, nt, fast=self.fast)                 # [T, nH*D]
        K_.matmul(w.k, h, k, nt, fast=self.fast)                 # [T, nKV*D]
        K_.matmul(w.v, h, v, nt, fast=self.fast)                 # [T, nKV*D]
        if w.q_bias is not None:
            q += w.q_bias
            k += w.k_bias
            v += w.v_bias
        if c.qk_norm == "head":                                  # Qwen3-MoE: per head over D
            K_.rmsnorm(q.reshape(T * nH, D), w.q_norm, c.rms_norm_eps, q.reshape(T * nH, D), nt)
            K_.rmsnorm(k.reshape(T * nKV, D), w.k_norm, c.rms_norm_eps, k.reshape(T * nKV, D), nt)
        elif c.qk_norm == "full":                                # OLMoE: over the projection
            K_.rmsnorm(q, w.q_norm, c.rms_norm_eps, q, nt)
            K_.rmsnorm(k, w.k_norm, c.rms_norm_eps, k, nt)
        if c.clip_qkv is not None:
            for t in (q, k, v):
                np.clip(t, -c.clip_qkv, c.clip_qkv, out=t)
        q3, k3 = q.reshape(T, nH, D), k.reshape(T, nKV, D)
        self.rope.apply(q3)
        self.rope.apply(k3)
        v3 = v.reshape(T, nKV, D)
        attn3 = self.attn[:T].reshape(T, nH, D)
        window = c.sliding_windows[l] or 0
        for kv, r0, r1 in segments:                              # each row sees its own cache
            pos0 = kv.length
            k_cache, v_cache = kv.layers[l]                      # [nKV, S, D] each
            k_cache[:, pos0:pos0 + r1 - r0] = k3[r0:r1].transpose(1, 0, 2)
            v_cache[:, pos0:pos0 + r1 - r0] = v3[r0:r1].transpose(1, 0, 2)
            K_.attention(q3[r0:r1], k_cache, v_cache, pos0, window, self.scale, attn3[r0:r1],
                         nt, w.sinks)
        o = self.o[:T]
        K_.matmul(w.o, self.attn[:T], o, nt, fast=self.fast)    # [T, H]
        if w.o_bias is not None:
            o += w.o_bias
        return o

