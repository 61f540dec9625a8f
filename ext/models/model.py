"""The forward pass of the MoE decoders moed serves (the families of ext/models/families/).

Shape legend: T tokens of this step, H hidden_size, V vocab_size, nH attention
heads, nKV key/value heads, D head_dim, E num_experts, K top_k (num_experts_per_tok),
I moe_intermediate_size, N token-expert pairs (T*K), S KV-cache capacity.

Conventions: activations, the KV cache and routing are float32; weights stay in
the checkpoint's format (f32/f16/bf16 arrays, or FP8 / MXFP4 / ... pieces behind a
`QuantizedWeight`: ext/models/weights.py) and are dequantised inside the kernels
(`ext.kernels._kernels`). Norms, biases and embeddings stay as stored (f32/f16/bf16).
The forward pass reads in the order the math happens: embed → per layer
(RMSNorm, attention, residual, RMSNorm, router, experts, weighted sum, residual)
→ final RMSNorm → logits. What differs between families — the attention kind
(ext/models/attention.py), the routing rule (ext/models/routing.py) and the names
of the tensors — comes from the model's `Family` (ext/models/family.py); nothing
here tests a model_type. Routed expert weights
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

from ext.formats.checkpoint import (FLOAT_DTYPES, Checkpoint, MissingTensorError,
                                    TensorRangeError, UnsupportedDtypeError)
from ext.formats.quant import ATTENTION, HEAD, MLP, ROUTER, StoredWeight, resolve_weight
from ext.kernels import NUMERICS_SETTINGS, fast_level, resolve_numerics
from ext.kernels import _kernels as K_
from ext.models.attention import Segments
from ext.models.config import ModelConfig, load_config
from ext.models.experts import (ExpertLayout, ExpertProvider, MmapExpertProvider,
                                ResidentExpertProvider)
from ext.models.families import family_of
from ext.models.kvcache import KVCache
from ext.models.routing import RouterWeights
from ext.models.weights import Weight, read_weight

F32 = np.float32
PREFILL_CHUNK = 64  # tokens per forward step by default; any value gives the same logits
# The step size moed serves with when the routed experts stream through a cache smaller
# than all of them (`prefill_chunk = "auto"`, daemon/service/loading.py): a chunk reads
# every expert it routes to once, so the disk bytes per prompt token fall as the chunk
# grows (bench/prefill_streaming.py).
STREAMING_PREFILL_CHUNK = 1024
# ... and when every expert is in memory: each chunk still reads every expert weight it
# touches from DRAM once (experts are far larger than the caches), and llama.cpp's
# default micro-batch (n_ubatch) is 512 tokens too.
RESIDENT_PREFILL_CHUNK = 512
BROKEN_LAYERS_SAID = 4          # broken_weights() names the experts of this many layers


def default_threads() -> int:
    """CPUs this process may run on (sched_getaffinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class MLPWeights:
    """A SwiGLU MLP held resident: gate/up [I, H], down [H, I] (dense layers and
    shared experts), in their stored format."""

    gate: Weight
    up: Weight
    down: Weight


@dataclass
class LayerWeights:
    """Resident weights of one decoder layer (linear weights in their stored format,
    norm vectors in f32)."""

    input_norm: np.ndarray           # [H]
    post_norm: np.ndarray            # [H]
    attention: object                # the attention kind's weights (e.g. GqaWeights)
    router: RouterWeights | None     # MoE layers
    mlp: MLPWeights | None           # dense layers
    shared_expert: MLPWeights | None  # Qwen2-MoE
    shared_expert_gate: Weight | None  # [1, H], or None for an ungated shared expert
    expert_resident: object = None   # what the expert kind keeps resident (GPT-OSS: biases)


class _Workspace:
    """Activation buffers of the MoE and MLP blocks for up to `chunk` tokens,
    allocated once per model (attention keeps its own)."""

    def __init__(self, c: ModelConfig, chunk: int):
        H = c.hidden_size
        K = c.num_experts_per_tok
        mlp_i = max(c.moe_intermediate_size, c.intermediate_size if not all(c.moe_layers) else 0,
                    c.shared_expert_intermediate_size)
        self.x = np.empty((chunk, H), F32)
        self.h = np.empty((chunk, H), F32)
        self.router_logits = np.empty((chunk, c.num_experts), F32)
        self.hint_logits = np.empty((chunk, c.num_experts), F32)
        self.hint_h = np.empty((chunk, H), F32)
        self.y_order = np.empty((K, H), F32)
        self.ids = np.empty((chunk, K), np.int32)
        self.weights = np.empty((chunk, K), F32)
        self.xg = np.empty((chunk * K, H), F32)
        self._hbuf = np.empty(chunk * K * mlp_i, F32)
        self.y = np.empty((chunk * K, H), F32)
        self.out = np.empty((chunk, H), F32)
        self.shared = np.empty((chunk, H), F32)
        self.gate = np.empty((chunk, 1), F32)

    def hbuf(self, rows: int, cols: int) -> np.ndarray:
        """A C-contiguous [rows, cols] view of the MLP activation buffer."""
        return self._hbuf[: rows * cols].reshape(rows, cols)


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
                 experts: ExpertProvider, n_threads: int, numerics: str = "exact",
                 prefill_chunk: int = PREFILL_CHUNK):
        if numerics not in NUMERICS_SETTINGS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS_SETTINGS)}, "
                             f"got {numerics!r}")
        self.config = config
        self.checkpoint = checkpoint
        self.layout = layout
        self.experts = experts
        self.n_threads = n_threads
        # Fast numerics (int8 activations dotted with int8/int4/MXFP4 codes, and under
        # "fast-bf16" bf16 activations with bf16 weights: the specs in
        # ext/kernels/_kernels.pyx) for every linear weight but the routers, which stay
        # exact so that routing never depends on the numerics mode. "auto" is "fast": a
        # model without int8/int4/MXFP4 runs exact bits under it, and `numerics_in_force`
        # reports the resolved mode.
        self.numerics = numerics                           # the setting, as given
        self.fast = fast_level(numerics)                   # the kernels' fast level: 0, 1, 2
        self.dense_weights: dict[str, StoredWeight] = {}   # every resident linear weight
        self._router_modules: set[str] = set()             # those computed exactly always
        self.family = family_of(config.model_type)
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        # Rows of one forward step at most (a prompt goes this many tokens a step); any
        # value gives the same logits. The step's buffers hold step_capacity rows (the
        # chunk the model was built with): set_prefill_chunk moves the chunk below it.
        self.prefill_chunk = prefill_chunk
        self.step_capacity = prefill_chunk
        self.attention = self.family.attention(config, prefill_chunk, n_threads, fast=self.fast)
        self.routing = self.family.routing(config)
        # Called as moe_observer(layer, experts, weights, x [N, H], group_start) before each
        # batch of expert FFNs, with the rows of experts[g] at group_start[g]:group_start[g+1]
        # of x; it must not modify anything (ext/quant/importance.py gathers statistics).
        self.moe_observer: Callable[..., None] | None = None
        # Routed experts, (layer, expert), whose output last held NaN or inf, each until it
        # computes finite rows again (its file restored under a mapping, its cached copy
        # read anew): requests that route to them fail, and /health says so. Replaced
        # whole, never changed in place: the event loop reads it (broken_weights()).
        self.broken_experts: frozenset[tuple[int, int]] = frozenset()
        self.expert_ffn = self.family.experts(config, layout.transposed, fast=self.fast)
        self._load_dense()
        self.ws = _Workspace(config, prefill_chunk)
        moe = [l for l, is_moe in enumerate(config.moe_layers) if is_moe]
        # The first MoE layer after each layer (None after the last one).
        self.next_moe_layer = [next((m for m in moe if m > l), None)
                               for l in range(config.num_hidden_layers)]

    @classmethod
    def load(cls, model_dir: str | Path, *, n_threads: int | None = None,
             experts: str | ExpertProvider | Callable[..., ExpertProvider] = "mmap",
             numerics: str = "exact", prefill_chunk: int = PREFILL_CHUNK) -> Model:
        """Open and validate a model directory, load the dense weights.

        Args:
            model_dir: a Hugging Face model directory (config.json, shards).
            n_threads: compute threads (default: CPUs available to the process).
            experts: "mmap" (page-cache maps, nothing read up front), "resident"
                (all experts read into RAM), an ExpertProvider, or a factory called
                as experts(checkpoint, layout, config) once those are open.
            numerics: "exact" (weights dequantised exactly, f32 activations: the mode
                the transformers oracle checks; the library's default, so that a caller
                comparing outputs gets the oracle's mode unless it asks otherwise),
                "fast" (int8/int4/MXFP4 weights dotted with int8 activations under
                moed's fast-numerics spec, `ext.kernels._kernels`; other formats and the
                routers stay exact), "fast-bf16" (fast, and bf16 weights dotted with
                bf16-rounded activations, "bf16-dp") or "auto" (fast when the model has
                int8/int4/MXFP4 weights, else exact: `ext.kernels.resolve_numerics`; the
                default of the daemon and the commands). `numerics_in_force()` says which
                mode runs.
            prefill_chunk: tokens of a prompt per forward step at most (default
                PREFILL_CHUNK): the step buffers grow with it (about
                daemon.service.loading.workspace_bytes), and with experts that stream a
                larger chunk reads each routed expert once for more tokens. Logits do not
                depend on it.
        Raises:
            ValueError: an unknown `numerics` or `experts`, a prefill_chunk below 1.
            ConfigError / CheckpointError subclasses naming the field, file or tensor
            (QuantizationError ones for quantised weights: ext/formats/quant.py).
        """
        config = load_config(model_dir)
        checkpoint = Checkpoint(model_dir)
        if config.quantization is not None:
            config.quantization.check_checkpoint(checkpoint.tensors, checkpoint.model_dir)
        layout = ExpertLayout(checkpoint, config)
        layout.check_scales(checkpoint)
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
        return cls(config, checkpoint, layout, provider, n_threads or default_threads(), numerics,
                   prefill_chunk)

    def set_prefill_chunk(self, tokens: int) -> None:
        """Take `tokens` prompt tokens per forward step from now on (1 ..
        `step_capacity`, the chunk the step buffers were built for: nothing is
        reallocated). Logits do not change; `moed tune` times prefill this way.
        Raises ValueError for a value that is not an int in that range."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= self.step_capacity:
            raise ValueError(f"prefill_chunk must be an int in 1..{self.step_capacity} "
                             f"(the step buffers' rows), got {tokens!r}")
        self.prefill_chunk = tokens

    # ------------------------------------------------------------- loading

    def _tensor(self, name: str, shape: tuple[int, ...], *, f32: bool = False) -> np.ndarray:
        """A tensor that is not a linear weight (embedding, norm, bias): f32/f16/bf16."""
        if name not in self.checkpoint:
            raise MissingTensorError("required by the config but missing from the checkpoint",
                                     path=self.checkpoint.model_dir, tensor=name)
        info = self.checkpoint.info(name)
        if info.shape != shape:
            raise TensorRangeError(f"shape {list(info.shape)} but the config implies {list(shape)}",
                                   path=info.path, tensor=name)
        if info.dtype not in FLOAT_DTYPES:
            raise UnsupportedDtypeError(f"dtype {info.dtype}: embeddings, norms and biases are "
                                        f"read as stored ({', '.join(FLOAT_DTYPES)})",
                                        path=info.path, tensor=name)
        arr = self.checkpoint.load(name)
        return np.ascontiguousarray(arr, dtype=F32) if f32 else arr

    def _linear(self, module: str, shape: tuple[int, int], role: str) -> Weight:
        """The linear weight of `module` [R, C] in its stored format (its scales checked)."""
        stored = resolve_weight(self.checkpoint.tensors, module, shape, role,
                                self.config.quantization, self.checkpoint.model_dir)
        self.dense_weights[module] = stored
        if role == ROUTER:
            self._router_modules.add(module)
        return read_weight(self.checkpoint, stored)

    def _mlp(self, prefix: str, inter: int) -> MLPWeights:
        H = self.config.hidden_size
        return MLPWeights(gate=self._linear(f"{prefix}.gate_proj", (inter, H), MLP),
                          up=self._linear(f"{prefix}.up_proj", (inter, H), MLP),
                          down=self._linear(f"{prefix}.down_proj", (H, inter), MLP))

    def _load_dense(self) -> None:
        c, names = self.config, self.family.tensors
        H, V = c.hidden_size, c.vocab_size
        self.embed = self._tensor("model.embed_tokens.weight", (V, H))
        if c.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = self._linear("lm_head", (V, H), HEAD)
        self.final_norm = self._tensor("model.norm.weight", (H,), f32=True)
        self.layers: list[LayerWeights] = []
        for l in range(c.num_hidden_layers):
            p, moe = names.layer(l), names.moe(l)
            is_moe = c.moe_layers[l]
            shared = is_moe and names.shared_expert is not None
            gated = shared and names.shared_expert_gate is not None
            self.layers.append(LayerWeights(
                input_norm=self._tensor(f"{p}.input_layernorm.weight", (H,), f32=True),
                post_norm=self._tensor(f"{p}.post_attention_layernorm.weight", (H,), f32=True),
                attention=self.attention.load(l, self._tensor, self._linear),
                router=self.routing.load(f"{moe}.{names.router}", self._tensor, self._linear)
                if is_moe else None,
                mlp=None if is_moe else self._mlp(f"{p}.mlp", c.intermediate_size),
                shared_expert=self._mlp(f"{moe}.{names.shared_expert}", c.shared_expert_intermediate_size)
                if shared else None,
                shared_expert_gate=self._linear(f"{moe}.{names.shared_expert_gate}", (1, H), ROUTER)
                if gated else None,
                expert_resident=self.expert_ffn.load(moe, self._tensor) if is_moe else None,
            ))

    def weight_formats(self) -> dict:
        """Which stored formats the model uses (JSON-able; logs, /v1/models, metrics):
        experts: the routed experts' format (ext.formats.quant.formats(), None without
        experts); dense: the resident linear weights' format, or "mixed" when they differ
        (e.g. FP8 projections beside a bf16 router); dense_formats: each format used and
        how many weights have it; quantization: the quantization_config's fields, or None;
        numerics: the mode in force (`numerics_in_force`).
        """
        counts: dict[str, int] = {}
        for w in self.dense_weights.values():
            counts[w.format] = counts.get(w.format, 0) + 1
        quant = self.config.quantization
        return {"experts": self.layout.format,
                "dense": next(iter(counts)) if len(counts) == 1 else "mixed",
                "dense_formats": dict(sorted(counts.items())),
                "quantization": quant.describe() if quant is not None else None,
                "numerics": self.numerics_in_force()}

    def numerics_in_force(self) -> str:
        """The resolved mode (`ext.kernels.resolve_numerics`): "fast-bf16" under that
        setting when some bf16 weight runs bf16-dp; "fast" when some weight is int8, int4
        or MXFP4 (the routed experts, or a resident weight other than a router) and the
        setting is not exact; "exact" otherwise, where the modes compute the same bits."""
        formats = {w.format for module, w in self.dense_weights.items()
                   if module not in self._router_modules}
        formats.add(self.layout.format or "")
        return resolve_numerics(self.numerics, formats)

    # ------------------------------------------------------------- serving

    def new_sequence(self, capacity: int = 256, max_capacity: int | None = None) -> Sequence:
        """A fresh sequence whose KV cache starts with room for `capacity` tokens and grows
        to at most `max_capacity` (default and ceiling: the model's context)."""
        context = self.config.max_position_embeddings
        return Sequence(self.attention.new_cache(capacity, min(max_capacity or context, context)))

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
        for start in range(0, ids.size, self.prefill_chunk):
            chunk = ids[start:start + self.prefill_chunk]
            last = start + chunk.size == ids.size
            h = self._forward_rows([(seq.kv, 0, chunk.size)], chunk)
            if all_logits or last:
                rows = h if all_logits else h[-1:]
                logits = np.empty((rows.shape[0], self.config.vocab_size), F32)
                K_.matmul(self.lm_head, rows, logits, self.n_threads, fast=self.fast)
                outs.append(logits)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def forward_batch(self, seqs: list[Sequence], token_ids) -> np.ndarray:
        """One decode step for several sequences at once: token_ids[b] follows seqs[b].

        `forward_step` with one token per sequence; each row's logits are bit-identical
        to `forward(seqs[b], [token_ids[b]])`.

        Returns:
            [len(seqs), V] float32 logits (a new array).
        Raises:
            ValueError: as `forward_step`, and a length mismatch.
        """
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but {ids.size} token ids")
        return self.forward_step(seqs, [ids[b:b + 1] for b in range(ids.size)])

    def forward_step(self, seqs: list[Sequence], token_ids: list) -> np.ndarray:
        """One step over several sequences, each continuing with its own tokens.

        token_ids[b] ([T_b] ints) follows what seqs[b] holds: one token is a decode row,
        several are a chunk of a prompt's prefill, and both kinds share the step. The
        rows share every weight read — the union of their experts is acquired once per
        MoE layer — and each row's arithmetic depends only on its own tokens and KV
        cache (row-wise kernels with a fixed reduction order; attention reads only the
        row's own cache), so the logits of seqs[b] are bit-identical to
        `forward(seqs[b], token_ids[b])`, whatever else is in the step.

        Args:
            seqs: distinct sequences; each KV cache grows by len(token_ids[b]).
            token_ids: one non-empty [T_b] array (or list) per sequence, with
                sum(T_b) <= prefill_chunk.
        Returns:
            [len(seqs), V] float32 logits of each sequence's last token (a new array).
        Raises:
            ValueError: no sequences, a sequence given twice, a length mismatch, an
                empty chunk, more than prefill_chunk tokens in all, an id out of range,
                or a context exceeded (checked for every sequence before any changes).
        """
        if not seqs or len(seqs) != len(token_ids):
            raise ValueError(f"forward_step takes one token list per sequence, got {len(seqs)} "
                             f"sequences and {len(token_ids)} token lists")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("forward_step got the same sequence twice")
        chunks = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_ids]
        if any(c.size == 0 for c in chunks):
            raise ValueError("forward_step got an empty token list")
        ids = np.concatenate(chunks)
        if ids.size > self.prefill_chunk:
            raise ValueError(f"forward_step takes at most {self.prefill_chunk} tokens in all, got {ids.size}")
        self._check_ids(ids)
        for seq, chunk in zip(seqs, chunks):
            if seq.kv.length + chunk.size > seq.kv.max_capacity:
                raise ValueError(f"sequence of {seq.kv.length + chunk.size} tokens exceeds the "
                                 f"context of {seq.kv.max_capacity}")
        segments, r0 = [], 0
        for seq, chunk in zip(seqs, chunks):
            seq.kv.reserve(chunk.size)
            segments.append((seq.kv, r0, r0 + chunk.size))
            r0 += chunk.size
        h = self._forward_rows(segments, ids)
        last = np.ascontiguousarray(h[[r1 - 1 for _, _, r1 in segments]])   # [len(seqs), H]
        logits = np.empty((len(seqs), self.config.vocab_size), F32)
        K_.matmul(self.lm_head, last, logits, self.n_threads, fast=self.fast)
        return logits

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.config.vocab_size)][0])
            raise ValueError(f"token id {bad} out of range [0, {self.config.vocab_size})")

    def _forward_rows(self, segments: Segments, ids: np.ndarray) -> np.ndarray:
        """Embed → layers → final norm for T <= prefill_chunk rows; returns [T, H].

        segments: (kv, r0, r1) — rows r0:r1 of `ids` continue that KV cache, in order,
        from its current length. One segment is a prefill chunk; one per row is a
        batched decode step.
        """
        c, ws, nt = self.config, self.ws, self.n_threads
        T = ids.size
        self.experts.begin_step(T)
        x = ws.x[:T]                                             # [T, H] residual stream
        K_.dequantize_rows(self.embed, ids, x)
        self.attention.begin_step(np.concatenate(
            [np.arange(kv.length, kv.length + r1 - r0, dtype=F32) for kv, r0, r1 in segments]))
        for l, layer in enumerate(self.layers):
            h = ws.h[:T]
            if layer.router is not None and self.experts.wants_hints and self.experts.early_hints:
                self._hint_own_layer(l, layer, x)
            K_.rmsnorm(x, layer.input_norm, c.rms_norm_eps, h, nt)
            x += self.attention(l, layer.attention, segments, h)
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
        self.experts.end_step()
        return out

    def _hint_next_layer(self, l: int, h: np.ndarray) -> None:
        """Offer the provider the routers of the next `experts.hint_depth` MoE layers
        applied to the current hidden state [T, H], scored under the family's routing
        rule (computed only when the provider asks), so their experts can be read while
        this layer computes. Output is unaffected whatever the provider does."""
        nxt = l
        logits = self.ws.hint_logits[:h.shape[0]]
        for ahead in range(1, self.experts.hint_depth + 1):
            nxt = self.next_moe_layer[nxt]
            if nxt is None:
                return
            router = self.layers[nxt].router

            def scores(router=router) -> np.ndarray:
                self.routing.logits(router, h, logits, self.n_threads)       # [T, E]
                return self.routing.hint_scores(router, logits)
            self.experts.hint(nxt, scores, ahead)

    def _hint_own_layer(self, l: int, layer: LayerWeights, x: np.ndarray) -> None:
        """The sharper guess, before layer l's attention: its own router applied to its
        input [T, H] through its post-attention norm (what the router will see, less the
        attention's update), scored under the family's rule. The first MoE layer's only
        guess."""
        T = x.shape[0]

        def scores() -> np.ndarray:
            h, logits = self.ws.hint_h[:T], self.ws.hint_logits[:T]
            K_.rmsnorm(x, layer.post_norm, self.config.rms_norm_eps, h, self.n_threads)
            self.routing.logits(layer.router, h, logits, self.n_threads)     # [T, E]
            return self.routing.hint_scores(layer.router, logits)
        self.experts.hint(l, scores, 0)

    def _moe(self, l: int, layer: LayerWeights, h: np.ndarray) -> np.ndarray:
        """Routed experts (+ the shared expert, gated or not) for [T, H] input."""
        c, ws, nt = self.config, self.ws, self.n_threads
        T, K = h.shape[0], c.num_experts_per_tok
        logits = self.routing.logits(layer.router, h, ws.router_logits[:T], nt)   # [T, E]
        ids, weights = ws.ids[:T], ws.weights[:T]
        try:
            self.routing.select(layer.router, logits, ids, weights)   # [T, K] in rank order
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
                if self.moe_observer is not None:
                    self.moe_observer(l, batch, weights_of, xg[r0:r1], group_start[g0:g1 + 1] - r0)
                self.expert_ffn(layer.expert_resident, batch, weights_of, xg[r0:r1],
                                group_start[g0:g1 + 1] - r0,
                                ws.hbuf(r1 - r0, c.moe_intermediate_size), y[r0:r1], nt)
            finally:
                self.experts.release(l, batch)
        self._check_finite(l, y, [experts[g] for g in range(len(experts))
                                  for _ in range(int(group_start[g + 1] - group_start[g]))])
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
            batch = [experts[i] for i in positions]
            starts = np.arange(n + 1, dtype=np.int64)
            try:
                if self.moe_observer is not None:
                    self.moe_observer(l, batch, weights_of, xg[:n], starts)
                self.expert_ffn(layer.expert_resident, batch, weights_of, xg[:n], starts,
                                ws.hbuf(n, c.moe_intermediate_size), part[:n], nt)
            except BaseException:
                ready.close()
                self.experts.release(l, experts)
                raise
            y[positions] = part[:n]                              # row g = experts[g]
        self.experts.release(l, experts)
        self._check_finite(l, y, experts)
        rows = np.empty(K, np.int64)
        rows[order] = np.arange(K)                               # row of y per rank
        return self._combine(layer, h, y, rows.reshape(1, K), weights)

    def _check_finite(self, l: int, y: np.ndarray, experts_of_rows) -> None:
        """Raise ValueError naming layer l's experts whose output rows y [N, H] hold NaN or
        inf (experts_of_rows: the expert of each row): their weights are broken, and without
        this the next layer's router would take the blame. One sum a layer (a NaN or inf
        anywhere makes it non-finite); rows are looked at only when it is. Keeps
        `broken_experts`: the broken ones join it, those with finite rows leave it."""
        if np.isfinite(y.sum()):
            if self.broken_experts:
                self.broken_experts -= {(l, int(e)) for e in experts_of_rows}
            return
        bad = sorted({int(e) for e, row in zip(experts_of_rows, y) if not np.isfinite(row).all()})
        if bad:
            self.broken_experts = ((self.broken_experts - {(l, int(e)) for e in experts_of_rows})
                                   | {(l, e) for e in bad})
            raise ValueError(f"layer {l}: routed expert{'s' if len(bad) > 1 else ''} "
                             f"{', '.join(map(str, bad))} produced NaN or inf (their weights "
                             "hold NaN or inf, or values beyond float32's range)")

    def broken_weights(self) -> str | None:
        """The routed experts whose output last held NaN or inf and has not been finite
        since, "layer 1: experts 0, 3" (at most BROKEN_LAYERS_SAID layers named), else None."""
        broken = self.broken_experts
        if not broken:
            return None
        layers = sorted({l for l, _ in broken})
        said = [f"layer {l}: expert{'s' if sum(1 for m, _ in broken if m == l) > 1 else ''} "
                + ", ".join(str(e) for e in sorted(e for m, e in broken if m == l))
                for l in layers[:BROKEN_LAYERS_SAID]]
        more = len(layers) - BROKEN_LAYERS_SAID
        return "; ".join(said) + (f"; and {more} more layers" if more > 0 else "")

    def _combine(self, layer: LayerWeights, h: np.ndarray, y: np.ndarray, rows: np.ndarray,
                 weights: np.ndarray) -> np.ndarray:
        """The weighted sum of the routed experts' rows in rank order, plus the shared
        expert (gated or not): [T, H]."""
        ws, nt = self.ws, self.n_threads
        T = h.shape[0]
        out = ws.out[:T]
        K_.combine_experts(y, rows, weights, out)                # [T, H], rank order
        if layer.shared_expert is not None:
            shared = self._dense_mlp(layer.shared_expert, h, ws.shared[:T])
            if layer.shared_expert_gate is not None:             # Qwen2-MoE: sigmoid gate
                gate = ws.gate[:T]
                K_.matmul(layer.shared_expert_gate, h, gate, nt)  # [T, 1]
                shared *= F32(1.0) / (F32(1.0) + np.exp(-gate))
            out += shared
        return out

    def _dense_mlp(self, mlp: MLPWeights, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        T = h.shape[0]
        inter = mlp.gate.shape[0]
        K_.expert_ffn([mlp.gate], [mlp.up], [mlp.down], h, np.array([0, T], np.int64),
                      self.ws.hbuf(T, inter), out, self.n_threads, fast=self.fast)
        return out

    def close(self) -> None:
        self.experts.close()
        self.checkpoint.close()
