"""The forward pass of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE decoders.

Shape legend: T tokens of this step, H hidden_size, V vocab_size, nH attention
heads, nKV key/value heads, D head_dim, E num_experts, K top_k (num_experts_per_tok),
I moe_intermediate_size, N token-expert pairs (T*K), S KV-cache capacity.

Conventions: activations, the KV cache and routing are float32; weights stay in
the checkpoint's dtype and are dequantised inside the kernels (`ext.kernels._kernels`).
The forward pass reads in the order the math happens: embed → per layer
(RMSNorm, q/k/v, q/k norm, RoPE, attention, o, residual, RMSNorm, router,
experts, weighted sum, residual) → final RMSNorm → logits. Routed expert weights
come from an `ExpertProvider` (one acquire per MoE layer and step); everything
else is resident. Each output's reduction order depends only on shapes, so a
token's logits are bit-identical whatever the thread count, the chunking of the
prompt, or where the expert weights sit in memory.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ext.formats.checkpoint import Checkpoint, MissingTensorError, TensorRangeError
from ext.kernels import _kernels as K_
from ext.models.config import ModelConfig, load_config
from ext.models.experts import (ExpertLayout, ExpertProvider, MmapExpertProvider,
                                ResidentExpertProvider)

F32 = np.float32
PREFILL_CHUNK = 64  # tokens per forward chunk; any value gives the same logits


def default_threads() -> int:
    """CPUs this process may run on (sched_getaffinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class MLPWeights:
    """A SwiGLU MLP held resident: gate/up [I, H], down [H, I] (dense layers and
    Qwen2-MoE's shared expert)."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass
class LayerWeights:
    """Resident weights of one decoder layer (norm vectors and biases in f32)."""

    input_norm: np.ndarray           # [H]
    post_norm: np.ndarray            # [H]
    q: np.ndarray                    # [nH*D, H]
    k: np.ndarray                    # [nKV*D, H]
    v: np.ndarray                    # [nKV*D, H]
    o: np.ndarray                    # [H, nH*D]
    q_bias: np.ndarray | None        # [nH*D]
    k_bias: np.ndarray | None        # [nKV*D]
    v_bias: np.ndarray | None        # [nKV*D]
    q_norm: np.ndarray | None        # [D] ("head") or [nH*D] ("full")
    k_norm: np.ndarray | None        # [D] or [nKV*D]
    router: np.ndarray | None        # [E, H] on MoE layers
    mlp: MLPWeights | None           # dense layers
    shared_expert: MLPWeights | None  # Qwen2-MoE
    shared_expert_gate: np.ndarray | None  # [1, H]


class KVCache:
    """Keys and values of one sequence: per layer [nKV, S, D] float32.

    Owned by the sequence; grows by doubling (a copy) when a step would pass
    the capacity, up to `max_capacity`.
    """

    def __init__(self, config: ModelConfig, capacity: int, max_capacity: int):
        self.config = config
        self.max_capacity = max_capacity
        self.length = 0
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self._allocate(min(max(capacity, 1), max_capacity))

    def _allocate(self, capacity: int) -> None:
        c = self.config
        shape = (c.num_key_value_heads, capacity, c.head_dim)
        old_k, old_v = self.k, self.v
        self.k = [np.zeros(shape, F32) for _ in range(c.num_hidden_layers)]
        self.v = [np.zeros(shape, F32) for _ in range(c.num_hidden_layers)]
        for new, old in zip(self.k + self.v, old_k + old_v):
            new[:, : self.length] = old[:, : self.length]
        self.capacity = capacity

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` more; ValueError past max_capacity."""
        need = self.length + n_tokens
        if need > self.max_capacity:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_capacity}")
        if need > self.capacity:
            self._allocate(min(self.max_capacity, max(need, 2 * self.capacity)))


class _Workspace:
    """Activation buffers for up to `chunk` tokens, allocated once per model."""

    def __init__(self, c: ModelConfig, chunk: int, n_threads: int):
        H, D = c.hidden_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * D, c.num_key_value_heads * D
        K = c.num_experts_per_tok
        mlp_i = max(c.moe_intermediate_size, c.intermediate_size if not all(c.moe_layers) else 0,
                    c.shared_expert_intermediate_size)
        self.x = np.empty((chunk, H), F32)
        self.h = np.empty((chunk, H), F32)
        self.q = np.empty((chunk, q_dim), F32)
        self.k = np.empty((chunk, kv_dim), F32)
        self.v = np.empty((chunk, kv_dim), F32)
        self.attn = np.empty((chunk, q_dim), F32)
        self.o = np.empty((chunk, H), F32)
        self.router_logits = np.empty((chunk, c.num_experts), F32)
        self.hint_logits = np.empty((chunk, c.num_experts), F32)
        self.hint_h = np.empty((chunk, H), F32)
        self.y_order = np.empty((K, H), F32)
        self.ids = np.empty((chunk, K), np.int32)
        self.weights = np.empty((chunk, K), F32)
        self.xg = np.empty((chunk * K, H), F32)
        self._hbuf = np.empty(chunk * K * mlp_i, F32)
        self.y = np.empty((chunk * K, H), F32)
        self.shared = np.empty((chunk, H), F32)
        self.gate = np.empty((chunk, 1), F32)
        self.cos = np.empty((chunk, D // 2), F32)
        self.sin = np.empty((chunk, D // 2), F32)
        self.scratch = np.empty((n_threads, 0), F32)  # attention scores, grown on demand

    def hbuf(self, rows: int, cols: int) -> np.ndarray:
        """A C-contiguous [rows, cols] view of the MLP activation buffer."""
        return self._hbuf[: rows * cols].reshape(rows, cols)

    def scores(self, n_threads: int, capacity: int) -> np.ndarray:
        if self.scratch.shape[0] < n_threads or self.scratch.shape[1] < capacity:
            self.scratch = np.empty((n_threads, max(capacity, 2 * self.scratch.shape[1])), F32)
        return self.scratch


class Sequence:
    """One generation's state: its KV cache (and, later, its scheduling data)."""

    def __init__(self, kv: KVCache):
        self.kv = kv

    @property
    def length(self) -> int:
        return self.kv.length


def _group_by_expert(ids: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Group the (token, rank) pairs of a [T, K] routing by expert.

    Returns (experts, group_start, order): the distinct expert ids, ascending;
    group_start [len(experts) + 1] int64 with pairs of experts[g] at positions
    group_start[g]:group_start[g+1] of `order`; order [T*K] int64, the flat
    (token * K + rank) index of each pair, stable within an expert. One token
    (decode) has K distinct experts: each group is one pair.
    """
    flat = ids.reshape(-1)                                       # [N]
    if ids.shape[0] == 1:
        order = np.argsort(flat)
        return flat[order].tolist(), np.arange(flat.size + 1, dtype=np.int64), order
    order = np.argsort(flat, kind="stable")
    experts, counts = np.unique(flat, return_counts=True)
    group_start = np.zeros(experts.size + 1, np.int64)
    np.cumsum(counts, out=group_start[1:])
    return experts.tolist(), group_start, order


class Model:
    """A loaded MoE decoder. Not thread-safe: one engine thread drives it.

    Use `Model.load(model_dir)`; `new_sequence()` then `forward(seq, ids)`.
    """

    def __init__(self, config: ModelConfig, checkpoint: Checkpoint, layout: ExpertLayout,
                 experts: ExpertProvider, n_threads: int):
        self.config = config
        self.checkpoint = checkpoint
        self.layout = layout
        self.experts = experts
        self.n_threads = n_threads
        self._load_dense()
        self.ws = _Workspace(config, PREFILL_CHUNK, n_threads)
        moe = [l for l, is_moe in enumerate(config.moe_layers) if is_moe]
        # The first MoE layer after each layer (None after the last one).
        self.next_moe_layer = [next((m for m in moe if m > l), None)
                               for l in range(config.num_hidden_layers)]
        D = config.head_dim
        self.inv_freq = (F32(1.0) / (F32(config.rope_theta) ** (np.arange(0, D, 2, dtype=F32) / F32(D)))).astype(F32)
        self.scale = float(D) ** -0.5

    @classmethod
    def load(cls, model_dir: str | Path, *, n_threads: int | None = None,
             experts: str | ExpertProvider | Callable[..., ExpertProvider] = "mmap") -> Model:
        """Open and validate a model directory, load the dense weights.

        Args:
            model_dir: a Hugging Face model directory (config.json, shards).
            n_threads: compute threads (default: CPUs available to the process).
            experts: "mmap" (page-cache maps, nothing read up front), "resident"
                (all experts read into RAM), an ExpertProvider, or a factory called
                as experts(checkpoint, layout, config) once those are open.
        Raises:
            ConfigError / CheckpointError subclasses naming the field, file or tensor.
        """
        config = load_config(model_dir)
        checkpoint = Checkpoint(model_dir)
        layout = ExpertLayout(checkpoint, config)
        if experts == "mmap":
            provider: ExpertProvider = MmapExpertProvider(layout)
        elif experts == "resident":
            provider = ResidentExpertProvider(checkpoint, layout)
        elif isinstance(experts, ExpertProvider):
            provider = experts
        elif callable(experts):
            provider = experts(checkpoint, layout, config)
        else:
            raise ValueError(f"experts must be 'mmap', 'resident' or an ExpertProvider, got {experts!r}")
        return cls(config, checkpoint, layout, provider, n_threads or default_threads())

    # ------------------------------------------------------------- loading

    def _tensor(self, name: str, shape: tuple[int, ...], *, f32: bool = False) -> np.ndarray:
        if name not in self.checkpoint:
            raise MissingTensorError("required by the config but missing from the checkpoint",
                                     path=self.checkpoint.model_dir, tensor=name)
        info = self.checkpoint.info(name)
        if info.shape != shape:
            raise TensorRangeError(f"shape {list(info.shape)} but the config implies {list(shape)}",
                                   path=info.path, tensor=name)
        arr = self.checkpoint.load(name)
        return np.ascontiguousarray(arr, dtype=F32) if f32 else arr

    def _mlp(self, prefix: str, inter: int) -> MLPWeights:
        H = self.config.hidden_size
        return MLPWeights(gate=self._tensor(f"{prefix}.gate_proj.weight", (inter, H)),
                          up=self._tensor(f"{prefix}.up_proj.weight", (inter, H)),
                          down=self._tensor(f"{prefix}.down_proj.weight", (H, inter)))

    def _load_dense(self) -> None:
        c = self.config
        H, D, V = c.hidden_size, c.head_dim, c.vocab_size
        q_dim, kv_dim = c.num_attention_heads * D, c.num_key_value_heads * D
        self.embed = self._tensor("model.embed_tokens.weight", (V, H))
        if c.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = self._tensor("lm_head.weight", (V, H))
        self.final_norm = self._tensor("model.norm.weight", (H,), f32=True)
        moe = "block_sparse_moe" if c.model_type == "mixtral" else "mlp"
        self.layers: list[LayerWeights] = []
        for l in range(c.num_hidden_layers):
            p = f"model.layers.{l}"
            a = f"{p}.self_attn"
            bias = c.qkv_bias
            norm_q = {"head": (D,), "full": (q_dim,)}.get(c.qk_norm)
            norm_k = {"head": (D,), "full": (kv_dim,)}.get(c.qk_norm)
            is_moe = c.moe_layers[l]
            shared = is_moe and c.shared_expert_intermediate_size > 0
            self.layers.append(LayerWeights(
                input_norm=self._tensor(f"{p}.input_layernorm.weight", (H,), f32=True),
                post_norm=self._tensor(f"{p}.post_attention_layernorm.weight", (H,), f32=True),
                q=self._tensor(f"{a}.q_proj.weight", (q_dim, H)),
                k=self._tensor(f"{a}.k_proj.weight", (kv_dim, H)),
                v=self._tensor(f"{a}.v_proj.weight", (kv_dim, H)),
                o=self._tensor(f"{a}.o_proj.weight", (H, q_dim)),
                q_bias=self._tensor(f"{a}.q_proj.bias", (q_dim,), f32=True) if bias else None,
                k_bias=self._tensor(f"{a}.k_proj.bias", (kv_dim,), f32=True) if bias else None,
                v_bias=self._tensor(f"{a}.v_proj.bias", (kv_dim,), f32=True) if bias else None,
                q_norm=self._tensor(f"{a}.q_norm.weight", norm_q, f32=True) if norm_q else None,
                k_norm=self._tensor(f"{a}.k_norm.weight", norm_k, f32=True) if norm_k else None,
                router=self._tensor(f"{p}.{moe}.gate.weight", (c.num_experts, H)) if is_moe else None,
                mlp=None if is_moe else self._mlp(f"{p}.mlp", c.intermediate_size),
                shared_expert=self._mlp(f"{p}.mlp.shared_expert", c.shared_expert_intermediate_size)
                if shared else None,
                shared_expert_gate=self._tensor(f"{p}.mlp.shared_expert_gate.weight", (1, H))
                if shared else None,
            ))

    # ------------------------------------------------------------- serving

    def new_sequence(self, capacity: int = 256) -> Sequence:
        """A fresh sequence whose KV cache starts with room for `capacity` tokens."""
        return Sequence(KVCache(self.config, capacity, self.config.max_position_embeddings))

    def forward(self, seq: Sequence, token_ids, *, all_logits: bool = False) -> np.ndarray:
        """Run `token_ids` through the model after what `seq` already holds.

        Args:
            seq: the sequence; its KV cache is extended by len(token_ids).
            token_ids: [T] ints in [0, vocab_size).
            all_logits: return logits for every position (teacher forcing)
                instead of the last one only.
        Returns:
            [T, V] or [1, V] float32 logits (a new array).
        Raises:
            ValueError: empty input, an id out of range, or the context exceeded.
        """
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        self._check_ids(ids)
        seq.kv.reserve(ids.size)
        outs = []
        for start in range(0, ids.size, PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            last = start + chunk.size == ids.size
            h = self._forward_rows([(seq.kv, 0, chunk.size)], chunk)
            if all_logits or last:
                rows = h if all_logits else h[-1:]
                logits = np.empty((rows.shape[0], self.config.vocab_size), F32)
                K_.matmul(self.lm_head, rows, logits, self.n_threads)
                outs.append(logits)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def forward_batch(self, seqs: list[Sequence], token_ids) -> np.ndarray:
        """One decode step for several sequences at once: token_ids[b] follows seqs[b].

        The rows share every weight read — the union of their experts is acquired
        once per MoE layer — and each row's logits are bit-identical to
        `forward(seqs[b], [token_ids[b]])` (row-wise kernels with fixed reduction
        order; attention reads only the row's own KV cache).

        Args:
            seqs: 1..PREFILL_CHUNK distinct sequences; each KV cache grows by one.
            token_ids: [len(seqs)] ints in [0, vocab_size).
        Returns:
            [len(seqs), V] float32 logits (a new array).
        Raises:
            ValueError: no sequences, more than PREFILL_CHUNK, a sequence given twice,
                a length mismatch, an id out of range, or a context exceeded (checked
                for every sequence before any changes).
        """
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if not seqs or len(seqs) > PREFILL_CHUNK:
            raise ValueError(f"forward_batch takes 1 to {PREFILL_CHUNK} sequences, got {len(seqs)}")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("forward_batch got the same sequence twice")
        if ids.size != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but {ids.size} token ids")
        self._check_ids(ids)
        for seq in seqs:
            if seq.kv.length + 1 > seq.kv.max_capacity:
                raise ValueError(f"sequence of {seq.kv.length + 1} tokens exceeds the context of "
                                 f"{seq.kv.max_capacity}")
        for seq in seqs:
            seq.kv.reserve(1)
        h = self._forward_rows([(seq.kv, b, b + 1) for b, seq in enumerate(seqs)], ids)
        logits = np.empty((len(seqs), self.config.vocab_size), F32)
        K_.matmul(self.lm_head, h, logits, self.n_threads)
        return logits

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.config.vocab_size)][0])
            raise ValueError(f"token id {bad} out of range [0, {self.config.vocab_size})")

    def _forward_rows(self, segments: list[tuple[KVCache, int, int]], ids: np.ndarray) -> np.ndarray:
        """Embed → layers → final norm for T <= PREFILL_CHUNK rows; returns [T, H].

        segments: (kv, r0, r1) — rows r0:r1 of `ids` continue that KV cache, in order,
        from its current length. One segment is a prefill chunk; one per row is a
        batched decode step.
        """
        c, ws, nt = self.config, self.ws, self.n_threads
        T = ids.size
        self.experts.begin_step(T)
        x = ws.x[:T]                                             # [T, H] residual stream
        K_.dequantize_rows(self.embed, ids, x)
        positions = np.concatenate([np.arange(kv.length, kv.length + r1 - r0, dtype=F32)
                                    for kv, r0, r1 in segments])
        np.multiply.outer(positions, self.inv_freq, out=ws.cos[:T])   # angles [T, D/2]
        np.sin(ws.cos[:T], out=ws.sin[:T])
        np.cos(ws.cos[:T], out=ws.cos[:T])
        for l, layer in enumerate(self.layers):
            h = ws.h[:T]
            if layer.router is not None and self.experts.wants_hints and self.experts.early_hints:
                self._hint_own_layer(l, layer, x)
            K_.rmsnorm(x, layer.input_norm, c.rms_norm_eps, h, nt)
            x += self._attention(l, layer, segments, h)
            K_.rmsnorm(x, layer.post_norm, c.rms_norm_eps, h, nt)
            if self.experts.wants_hints:
                self._hint_next_layer(l, h)
            if layer.router is not None:
                x += self._moe(l, layer, h)
            else:
                x += self._dense_mlp(layer.mlp, h, ws.shared[:T])
        for kv, r0, r1 in segments:
            kv.length += r1 - r0
        out = np.empty_like(x)
        K_.rmsnorm(x, self.final_norm, c.rms_norm_eps, out, nt)
        return out

    def _hint_next_layer(self, l: int, h: np.ndarray) -> None:
        """Offer the provider the routers of the next `experts.hint_depth` MoE layers
        applied to the current hidden state [T, H], so their experts can be read while
        this layer computes. Output is unaffected whatever the provider does."""
        nxt = l
        logits = self.ws.hint_logits[:h.shape[0]]
        for ahead in range(1, self.experts.hint_depth + 1):
            nxt = self.next_moe_layer[nxt]
            if nxt is None:
                return
            router = self.layers[nxt].router

            def scores(router=router) -> np.ndarray:
                K_.matmul(router, h, logits, self.n_threads)               # [T, E]
                return logits
            self.experts.hint(nxt, scores, ahead)

    def _hint_own_layer(self, l: int, layer: LayerWeights, x: np.ndarray) -> None:
        """The sharper guess, before layer l's attention: its own router applied to its
        input [T, H] through its post-attention norm (what the router will see, less the
        attention's update). The first MoE layer's only guess."""
        T = x.shape[0]

        def scores() -> np.ndarray:
            h, logits = self.ws.hint_h[:T], self.ws.hint_logits[:T]
            K_.rmsnorm(x, layer.post_norm, self.config.rms_norm_eps, h, self.n_threads)
            K_.matmul(layer.router, h, logits, self.n_threads)              # [T, E]
            return logits
        self.experts.hint(l, scores, 0)

    def _attention(self, l: int, layer: LayerWeights, segments: list[tuple[KVCache, int, int]],
                   h: np.ndarray) -> np.ndarray:
        c, ws, nt = self.config, self.ws, self.n_threads
        T, D = h.shape[0], c.head_dim
        nH, nKV = c.num_attention_heads, c.num_key_value_heads
        q, k, v = ws.q[:T], ws.k[:T], ws.v[:T]
        K_.matmul(layer.q, h, q, nt)                             # [T, nH*D]
        K_.matmul(layer.k, h, k, nt)                             # [T, nKV*D]
        K_.matmul(layer.v, h, v, nt)                             # [T, nKV*D]
        if layer.q_bias is not None:
            q += layer.q_bias
            k += layer.k_bias
            v += layer.v_bias
        if c.qk_norm == "head":                                  # Qwen3-MoE: per head over D
            K_.rmsnorm(q.reshape(T * nH, D), layer.q_norm, c.rms_norm_eps, q.reshape(T * nH, D), nt)
            K_.rmsnorm(k.reshape(T * nKV, D), layer.k_norm, c.rms_norm_eps, k.reshape(T * nKV, D), nt)
        elif c.qk_norm == "full":                                # OLMoE: over the projection
            K_.rmsnorm(q, layer.q_norm, c.rms_norm_eps, q, nt)
            K_.rmsnorm(k, layer.k_norm, c.rms_norm_eps, k, nt)
        if c.clip_qkv is not None:
            for t in (q, k, v):
                np.clip(t, -c.clip_qkv, c.clip_qkv, out=t)
        q3, k3 = q.reshape(T, nH, D), k.reshape(T, nKV, D)
        K_.rope(q3, ws.cos[:T], ws.sin[:T])
        K_.rope(k3, ws.cos[:T], ws.sin[:T])
        v3 = v.reshape(T, nKV, D)
        attn3 = ws.attn[:T].reshape(T, nH, D)
        window = c.sliding_windows[l] or 0
        for kv, r0, r1 in segments:                              # each row sees its own cache
            pos0 = kv.length
            kv.k[l][:, pos0:pos0 + r1 - r0] = k3[r0:r1].transpose(1, 0, 2)   # cache [nKV, S, D]
            kv.v[l][:, pos0:pos0 + r1 - r0] = v3[r0:r1].transpose(1, 0, 2)
            K_.attention(q3[r0:r1], kv.k[l], kv.v[l], pos0, window, self.scale, attn3[r0:r1],
                         ws.scores(nt, kv.capacity), nt)
        o = ws.o[:T]
        K_.matmul(layer.o, ws.attn[:T], o, nt)                   # [T, H]
        return o

    def _moe(self, l: int, layer: LayerWeights, h: np.ndarray) -> np.ndarray:
        """Routed experts (+ Qwen2-MoE's gated shared expert) for [T, H] input."""
        c, ws, nt = self.config, self.ws, self.n_threads
        T, K = h.shape[0], c.num_experts_per_tok
        logits = ws.router_logits[:T]
        K_.matmul(layer.router, h, logits, nt)                   # [T, E]
        ids, weights = ws.ids[:T], ws.weights[:T]
        try:
            K_.route(logits, K, c.norm_topk_prob, ids, weights)  # [T, K] in rank order
        except ValueError as e:
            raise ValueError(f"layer {l}: {e} (the weights of this layer's router or of the "
                             "layers before it hold NaN or inf)") from None
        if self.experts.wants_routing:
            self.experts.observe_routing(l, ids)
        experts, group_start, order = _group_by_expert(ids)
        N = T * K
        limit = self.experts.max_acquire(l) or len(experts)
        if T == 1 and limit >= len(experts):
            return self._moe_decode(l, layer, h, experts, order, weights)
        xg = ws.xg[:N]
        np.take(h, order // K, axis=0, out=xg)                   # [N, H] grouped by expert
        y = ws.y[:N]
        for g0 in range(0, len(experts), limit):                 # batches the cache can hold
            g1 = min(g0 + limit, len(experts))
            batch = experts[g0:g1]
            r0, r1 = int(group_start[g0]), int(group_start[g1])
            weights_of = self.experts.acquire(l, batch)          # the expert fetch
            try:
                K_.expert_ffn([w.gate for w in weights_of], [w.up for w in weights_of],
                              [w.down for w in weights_of], xg[r0:r1], group_start[g0:g1 + 1] - r0,
                              ws.hbuf(r1 - r0, c.moe_intermediate_size), y[r0:r1], nt)
            finally:
                self.experts.release(l, batch)
        rows = np.empty(N, np.int64)
        rows[order] = np.arange(N)                               # row of y per (token, rank)
        return self._combine(layer, h, y, rows.reshape(T, K), weights)

    def _moe_decode(self, l: int, layer: LayerWeights, h: np.ndarray, experts: list[int],
                    order: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """One token's K experts, each computed as soon as its weights are usable (cached
        ones first, the others as their reads complete), then summed in rank order:
        every expert's row depends only on its weights and the input, so the order of
        computation changes nothing in the output."""
        c, ws, nt = self.config, self.ws, self.n_threads
        K = len(experts)
        y, part = ws.y[:K], ws.y_order
        xg = ws.xg[:K]
        xg[:] = h                                                # [K, H], one row per expert
        ready = iter(self.experts.acquire_in_order(l, experts))   # a failed read releases
        for positions, weights_of in ready:
            n = len(positions)
            try:
                K_.expert_ffn([w.gate for w in weights_of], [w.up for w in weights_of],
                              [w.down for w in weights_of], xg[:n], np.arange(n + 1, dtype=np.int64),
                              ws.hbuf(n, c.moe_intermediate_size), part[:n], nt)
            except BaseException:
                ready.close()
                self.experts.release(l, experts)
                raise
            y[positions] = part[:n]                              # row g = experts[g]
        self.experts.release(l, experts)
        rows = np.empty(K, np.int64)
        rows[order] = np.arange(K)                               # row of y per rank
        return self._combine(layer, h, y, rows.reshape(1, K), weights)

    def _combine(self, layer: LayerWeights, h: np.ndarray, y: np.ndarray, rows: np.ndarray,
                 weights: np.ndarray) -> np.ndarray:
        """The weighted sum of the routed experts' rows in rank order, plus the shared
        expert (Qwen2-MoE): [T, H]."""
        ws, nt = self.ws, self.n_threads
        T = h.shape[0]
        out = ws.o[:T]
        K_.combine_experts(y, rows, weights, out)                # [T, H], rank order
        if layer.shared_expert is not None:
            shared = self._dense_mlp(layer.shared_expert, h, ws.shared[:T])
            gate = ws.gate[:T]
            K_.matmul(layer.shared_expert_gate, h, gate, nt)     # [T, 1]
            out += (F32(1.0) / (F32(1.0) + np.exp(-gate))) * shared
        return out

    def _dense_mlp(self, mlp: MLPWeights, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        T = h.shape[0]
        inter = mlp.gate.shape[0]
        K_.expert_ffn([mlp.gate], [mlp.up], [mlp.down], h, np.array([0, T], np.int64),
                      self.ws.hbuf(T, inter), out, self.n_threads)
        return out

    def close(self) -> None:
        self.experts.close()
        self.checkpoint.close()
