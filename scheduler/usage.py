"""Per (layer, expert) exponentially decayed activation counts.

Conventions (the whole module):
  L = len(moe_layers) MoE layers, E = num_experts routed experts per layer.
  `layer` arguments are model layer ids (entries of `moe_layers`); rows of every
  [L, E] array are layer *indices* (positions in `moe_layers`).
  Time is counted in tokens and passed in (`advance`); nothing here reads a clock.

Decay: a count observed `n` tokens ago weighs 2 ** (-n / half_life_tokens), so after
half_life_tokens tokens a count is halved. The decay is applied lazily: values are stored
divided by a global scale (the decay accumulated since the last renormalisation), so
`advance` is O(1); the stored values are folded back before the scale underflows.

Merging across processes (docs/design.md "Usage statistics and pin set"; issue 3): each
process flushes only what it gathered since its own previous flush,

    merged = decay(file_counts, tokens) + delta,     decay(c, n) = c * 2 ** (-n / H)

where (delta, tokens) = `UsageStats.take_delta()`: delta holds the activations observed
since the previous take, each decayed to now, and tokens is the number of tokens this
process advanced since then. With one process the file holds its counts at the previous
flush, so `merged` equals its current `counts()` exactly; with two, nothing is counted
twice because each delta is taken (and reset) exactly once.

The state file itself (path, fingerprint, atomic write, lock) is the daemon's; this module
defines the payload (`to_dict` / `from_dict`) and validates it.
"""
from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

FORMAT_NAME = "moed-usage"
FORMAT_VERSION = 1
# Fold the lazy scale back into the stored values before 1/scale gets anywhere near
# float64 overflow (values would otherwise grow like 2 ** (tokens / H)).
_RENORMALISE_BELOW = 2.0 ** -200


class UsageFormatError(ValueError):
    """A usage payload that must not be trusted; the message names the bad field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"usage payload field {field!r}: {problem}")
        self.field = field


def decay(counts: np.ndarray, tokens: float, half_life_tokens: float) -> np.ndarray:
    """Return `counts` decayed by `tokens` tokens: counts * 2 ** (-tokens / half_life_tokens).

    counts: float array of any shape (not modified). tokens >= 0. Raises ValueError on a
    negative `tokens` or a non-positive half-life.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if not half_life_tokens > 0:
        raise ValueError(f"half_life_tokens must be > 0, got {half_life_tokens}")
    return np.asarray(counts, dtype=np.float64) * 2.0 ** (-float(tokens) / half_life_tokens)


def merge_counts(file_counts: np.ndarray, tokens_since_file_written: float,
                 delta: np.ndarray, half_life_tokens: float) -> np.ndarray:
    """The counts to write back on a flush: decay(file_counts, tokens) + delta.

    file_counts: [L, E] float64 as read from the state file. tokens_since_file_written:
    this process's tokens since its previous flush (second value of `take_delta`).
    delta: [L, E] from `take_delta`. Returns a new [L, E] float64 array.
    Raises ValueError when the shapes differ.
    """
    file_counts = np.asarray(file_counts, dtype=np.float64)
    delta = np.asarray(delta, dtype=np.float64)
    if file_counts.shape != delta.shape:
        raise ValueError(f"file counts {file_counts.shape} and delta {delta.shape} differ in shape")
    return decay(file_counts, tokens_since_file_written, half_life_tokens) + delta


class UsageStats:
    """Decayed activation counts per (layer, expert), with a flushable delta.

    moe_layers: the model's MoE layer ids, in order (rows of every array).
    num_experts: routed experts per layer. half_life_tokens: > 0, in tokens.
    Raises ValueError on an empty or duplicated layer list, num_experts < 1 or a
    non-positive half-life.
    """

    def __init__(self, moe_layers: Sequence[int], num_experts: int, half_life_tokens: float):
        moe_layers = [int(x) for x in moe_layers]
        if not moe_layers or len(set(moe_layers)) != len(moe_layers):
            raise ValueError(f"moe_layers must be non-empty and distinct, got {moe_layers}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not (half_life_tokens > 0 and math.isfinite(half_life_tokens)):
            raise ValueError(f"half_life_tokens must be a positive number, got {half_life_tokens}")
        self.moe_layers = tuple(moe_layers)
        self.num_experts = int(num_experts)
        self.half_life_tokens = float(half_life_tokens)
        self._row = {layer: i for i, layer in enumerate(self.moe_layers)}
        shape = (len(self.moe_layers), self.num_experts)
        self._stored = np.zeros(shape)        # value / scale            [L, E]
        self._delta_stored = np.zeros(shape)  # since last take / scale  [L, E]
        self._scale = 1.0                     # 2 ** (-tokens / H) since renormalisation
        self._tokens_since_take = 0
        self.tokens_observed = 0              # tokens advanced over this object's life
        # What the pin learner and the referee settled on (scheduler.pinlearn,
        # scheduler.referee), saved with the counts: {"pin_share", "pin_source", "mechanisms",
        # "mechanism_backoff"}.
        self.learned: dict[str, Any] = {}

    # -- recording ---------------------------------------------------------------------
    def observe(self, layer: int, experts: Sequence[int] | np.ndarray,
                tokens: int | Sequence[int] | np.ndarray = 1) -> None:
        """Count activations of `experts` at `layer` in the current step.

        experts: expert ids (normally distinct; a repeated id is counted each time).
        tokens: how many tokens chose each expert in this step — one int for all, or an
        array of the same length as `experts` (batch-union prefill). Call once per layer
        per step, then `advance` by the step's tokens.
        Raises KeyError for an unknown layer, ValueError for an out-of-range expert, a
        length mismatch or a negative / non-finite count.
        """
        row = self._layer_row(layer)
        if type(tokens) is int and type(experts) is list and all(type(e) is int for e in experts):
            # A decode step's few ids as Python ints (what the provider passes): the same
            # checks and sums without building arrays (a layer step's cost, every token).
            if experts and (min(experts) < 0 or max(experts) >= self.num_experts):
                raise ValueError(f"expert ids must be in [0, {self.num_experts}), got {experts}")
            if tokens < 0:
                raise ValueError(f"token counts must be finite and >= 0, got {[tokens] * len(experts)}")
            add = tokens / self._scale
            stored, delta = self._stored[row], self._delta_stored[row]
            for e in experts:
                stored[e] += add
                delta[e] += add
            return
        ids = np.asarray(experts, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ValueError(f"expert ids must be in [0, {self.num_experts}), got {ids.tolist()}")
        n = np.broadcast_to(np.asarray(tokens, dtype=np.float64), ids.shape) \
            if np.ndim(tokens) == 0 else np.asarray(tokens, dtype=np.float64).reshape(-1)
        if n.shape != ids.shape:
            raise ValueError(f"tokens has {n.size} entries for {ids.size} experts")
        if not np.all(np.isfinite(n)) or np.any(n < 0):
            raise ValueError(f"token counts must be finite and >= 0, got {n.tolist()}")
        add = n / self._scale
        np.add.at(self._stored[row], ids, add)
        np.add.at(self._delta_stored[row], ids, add)

    def advance(self, tokens: int) -> None:
        """Move time forward by `tokens` tokens (>= 0): every count decays."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self._scale *= 2.0 ** (-tokens / self.half_life_tokens)
        self._tokens_since_take += int(tokens)
        self.tokens_observed += int(tokens)
        if self._scale < _RENORMALISE_BELOW:
            self._stored *= self._scale
            self._delta_stored *= self._scale
            self._scale = 1.0

    # -- reading -----------------------------------------------------------------------
    def counts(self) -> np.ndarray:
        """Current decayed counts, a new [L, E] float64 array (rows = layer indices)."""
        return self._stored * self._scale

    def layer_counts(self, layer: int) -> np.ndarray:
        """Current decayed counts of one MoE layer (its id), a new [E] float64 array.
        Raises KeyError for an unknown layer."""
        return self._stored[self._layer_row(layer)] * self._scale

    def take_delta(self) -> tuple[np.ndarray, int]:
        """(delta [L, E] float64, tokens) gathered since the previous take; resets both.

        delta: activations observed since the previous take, decayed to now. tokens: the
        tokens advanced since then. Feed both to `merge_counts` when flushing.
        """
        delta = self._delta_stored * self._scale
        tokens = self._tokens_since_take
        self._delta_stored = np.zeros_like(self._delta_stored)
        self._tokens_since_take = 0
        return delta, tokens

    def set_counts(self, counts: np.ndarray) -> None:
        """Replace the current counts (e.g. by the merged file after a flush).

        The pending delta is untouched. Raises ValueError on a wrong shape or on
        negative / non-finite values.
        """
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self._stored.shape:
            raise ValueError(f"counts shape {counts.shape}, expected {self._stored.shape}")
        if not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise ValueError("counts must be finite and >= 0")
        self._stored = counts / self._scale

    def _layer_row(self, layer: int) -> int:
        try:
            return self._row[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not a MoE layer {list(self.moe_layers)}") from None

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self, fingerprint: str | None = None) -> dict[str, Any]:
        """A JSON-ready payload of the current counts (version FORMAT_VERSION).

        Keys: format, version, fingerprint (the model fingerprint, or None),
        moe_layers, num_experts, half_life_tokens, tokens_observed, counts ([L][E] floats),
        and learned (`learned`, when not empty).
        """
        out = {} if not self.learned else {"learned": dict(self.learned)}
        return {**out,
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "half_life_tokens": self.half_life_tokens,
            "tokens_observed": self.tokens_observed,
            "counts": self.counts().tolist(),
        }

    @classmethod
    def from_dict(cls, payload: Any, moe_layers: Sequence[int] | None = None,
                  num_experts: int | None = None, fingerprint: str | None = None,
                  half_life_tokens: float | None = None) -> UsageStats:
        """Validate a payload of `to_dict` and rebuild the statistics from it.

        moe_layers / num_experts / fingerprint: what the running model expects; when
        given, the payload must match. half_life_tokens: the configured half-life to use
        from now on (default: the payload's). The delta starts empty.
        Raises UsageFormatError (naming the field) for: not a dict, wrong format or
        version, another model's fingerprint, unknown or missing layers, wrong
        num_experts, counts of the wrong shape, of other than JSON numbers (an integer
        too large for a float included) or with NaN / inf / negative values, a
        `learned` that is not an object or holds a bad pin_share (a number in [0, 1]),
        pin_source ("long" or "recent"), mechanisms (names to booleans),
        mechanism_backoff (names to integers in [1, MAX_BACKOFF_WINDOWS]) or transitions
        (see `encode_transitions`); other keys of `learned` are dropped.
        """
        if not isinstance(payload, dict):
            raise UsageFormatError("<root>", f"expected an object, got {type(payload).__name__}")
        if payload.get("format") != FORMAT_NAME:
            raise UsageFormatError("format", f"expected {FORMAT_NAME!r}, got {payload.get('format')!r}")
        version = payload.get("version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise UsageFormatError("version", f"expected {FORMAT_VERSION}, got {version!r}")
        if fingerprint is not None and payload.get("fingerprint") != fingerprint:
            raise UsageFormatError("fingerprint", f"belongs to model {payload.get('fingerprint')!r}, "
                                   f"not {fingerprint!r}")
        layers = payload.get("moe_layers")
        if not (isinstance(layers, list) and layers and all(_is_int(x) for x in layers)
                and len(set(layers)) == len(layers)):
            raise UsageFormatError("moe_layers", f"expected distinct integer layer ids, got {layers!r}")
        if moe_layers is not None:
            unknown = sorted(set(layers) - set(moe_layers))
            missing = sorted(set(moe_layers) - set(layers))
            if unknown or missing or list(layers) != list(moe_layers):
                raise UsageFormatError("moe_layers", f"unknown layers {unknown}, missing layers "
                                       f"{missing} (expected {list(moe_layers)})")
        n_exp = payload.get("num_experts")
        if not (_is_int(n_exp) and n_exp >= 1):
            raise UsageFormatError("num_experts", f"expected a positive integer, got {n_exp!r}")
        if num_experts is not None and n_exp != num_experts:
            raise UsageFormatError("num_experts", f"payload has {n_exp}, model has {num_experts}")
        hl = payload.get("half_life_tokens")
        if not (_is_finite_number(hl) and hl > 0):
            raise UsageFormatError("half_life_tokens", f"expected a positive number, got {hl!r}")
        seen = payload.get("tokens_observed", 0)
        if not (_is_int(seen) and seen >= 0):
            raise UsageFormatError("tokens_observed", f"expected an integer >= 0, got {seen!r}")
        counts = _float_array(payload.get("counts"), "counts", (len(layers), n_exp))
        if not np.all(np.isfinite(counts)):
            raise UsageFormatError("counts", "contains NaN or infinite values")
        if np.any(counts < 0):
            raise UsageFormatError("counts", "contains negative values")
        stats = cls(layers, n_exp, hl if half_life_tokens is None else half_life_tokens)
        stats.set_counts(counts)
        stats.tokens_observed = int(seen)
        stats.learned = _learned(payload.get("learned", {}))
        if "transitions" in stats.learned:
            decode_transitions(stats.learned["transitions"], len(layers), n_exp)   # raises if bad
        return stats


MAX_BACKOFF_WINDOWS = 1024      # learned.mechanism_backoff: windows before a probe, at most


def _learned(value: Any) -> dict[str, Any]:
    """The checked `learned` field of a payload (see `UsageStats.from_dict`)."""
    if not isinstance(value, dict):
        raise UsageFormatError("learned", f"expected an object, got {type(value).__name__}")
    out: dict[str, Any] = {}
    if "pin_share" in value:
        share = value["pin_share"]
        if not (_is_finite_number(share) and 0.0 <= share <= 1.0):
            raise UsageFormatError("learned.pin_share", f"expected a number in [0, 1], got {share!r}")
        out["pin_share"] = float(share)
    if "pin_source" in value:
        if value["pin_source"] not in ("long", "recent"):
            raise UsageFormatError("learned.pin_source", f"expected 'long' or 'recent', got "
                                   f"{str(value['pin_source'])[:40]!r}")
        out["pin_source"] = value["pin_source"]
    if "transitions" in value:
        out["transitions"] = value["transitions"]          # checked by from_dict (needs L, E)
    if "mechanisms" in value:
        mech = value["mechanisms"]
        if not (isinstance(mech, dict) and all(isinstance(k, str) and len(k) < 64 and isinstance(v, bool)
                                               for k, v in mech.items())):
            raise UsageFormatError("learned.mechanisms", "expected an object of names to booleans")
        out["mechanisms"] = dict(mech)
    if "mechanism_backoff" in value:
        backoff = value["mechanism_backoff"]
        if not (isinstance(backoff, dict) and all(
                isinstance(k, str) and len(k) < 64 and _is_int(v) and 1 <= v <= MAX_BACKOFF_WINDOWS
                for k, v in backoff.items())):
            raise UsageFormatError("learned.mechanism_backoff",
                                   f"expected an object of names to integers in [1, {MAX_BACKOFF_WINDOWS}]")
        out["mechanism_backoff"] = dict(backoff)
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite_number(x: Any) -> bool:
    """A JSON number (not a bool) that is a finite float: an integer too large for a
    float (JSON allows 1 followed by 400 zeros) is not."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _float_array(value: Any, field: str, shape: tuple[int, ...]) -> np.ndarray:
    """`value`, nested lists of JSON numbers of `shape`, as float64 (NaN and infinities
    kept for the caller to judge). Raises UsageFormatError(field) for another shape or an
    element that is not a number (a string, a bool, null, an integer too large for a float)."""
    def numbers(v: Any, depth: int) -> bool:
        if depth == len(shape):
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        return isinstance(v, list) and len(v) == shape[depth] and all(numbers(x, depth + 1) for x in v)

    if not numbers(value, 0):
        raise UsageFormatError(field, f"expected a {'x'.join(map(str, shape))} array of numbers")
    try:
        return np.asarray(value, dtype=np.float64)
    except OverflowError:
        raise UsageFormatError(field, "holds an integer too large for a float") from None


TRANSITIONS_ENCODING = "u8-rows-base64"


# Bytes of the JSON of one expert's number in a layer's list (a float's repr is at most 24
# characters, plus ", "), and of the payload's fixed part (the envelope, `learned`'s scalars).
_NUMBER_BYTES = 32
_FIXED_BYTES = 1 << 20
_HEADROOM = 4


def max_state_file_bytes(n_layers: int, num_experts: int) -> int:
    """An upper bound on the JSON size of a state file of L = n_layers MoE layers of E =
    num_experts experts, with 4x headroom: per layer E counts and E transition totals
    (`_NUMBER_BYTES` each) and the E * E bytes of `encode_transitions` in base64 (4/3 of
    them), plus 1 MiB. A real file stays far below it; a larger one is not a state file
    (the daemon sets it aside unread instead of reading gigabytes)."""
    per_layer = 2 * num_experts * _NUMBER_BYTES + 4 * (num_experts * num_experts + 2) // 3
    return _HEADROOM * (n_layers * per_layer + _FIXED_BYTES)


def encode_transitions(per_layer: Sequence[tuple[np.ndarray, np.ndarray] | None]) -> dict[str, Any]:
    """The JSON form of the eviction policy's next-step statistics (one (T [E, E], N [E])
    per MoE layer, scheduler.eviction.PredictivePolicy.transitions; None: nothing learned).

    Per layer: "totals" N as floats, and "next": T[a, e] / N[a] (the probability that e
    follows a, in [0, 1]) rounded to 1/255 and stored as E * E bytes, row-major, base64
    — a quarter of the size of float32, and finer than the prediction needs (it ranks
    experts). A layer with nothing learned is null. Raises ValueError on inconsistent shapes.
    """
    layers = []
    for prior in per_layer:
        if prior is None or not np.any(prior[1] > 0):
            layers.append(None)
            continue
        t, n = (np.asarray(a, dtype=np.float64) for a in prior)
        if t.ndim != 2 or t.shape != (n.size, n.size):
            raise ValueError(f"transitions of shape {t.shape} with totals of {n.size} experts")
        p = np.clip(t / np.where(n > 0, n, 1.0)[:, None], 0.0, 1.0)
        layers.append({"totals": [round(float(x), 4) for x in n],
                       "next": base64.b64encode(np.rint(p * 255).astype(np.uint8).tobytes()).decode("ascii")})
    return {"encoding": TRANSITIONS_ENCODING, "layers": layers}


def decode_transitions(value: Any, n_layers: int, num_experts: int) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """The per-layer (T [E, E], N [E]) float64 of `encode_transitions`' output (None for a
    null layer). Raises UsageFormatError("learned.transitions") naming what is wrong:
    not an object, another encoding, a layer count or shape that does not fit the model,
    totals that are not finite JSON numbers >= 0 (strings, booleans and integers too large
    for a float are refused), or "next" that is not a base64 string of E * E bytes (no
    whitespace; its length is checked before it is decoded)."""
    field = "learned.transitions"
    if not isinstance(value, dict) or value.get("encoding") != TRANSITIONS_ENCODING:
        raise UsageFormatError(field, f"expected an object with encoding {TRANSITIONS_ENCODING!r}")
    layers = value.get("layers")
    if not isinstance(layers, list) or len(layers) != n_layers:
        raise UsageFormatError(field, f"expected {n_layers} layers, got "
                               f"{len(layers) if isinstance(layers, list) else type(layers).__name__}")
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    for i, layer in enumerate(layers):
        if layer is None:
            out.append(None)
            continue
        if not isinstance(layer, dict):
            raise UsageFormatError(f"{field}.layers[{i}]", "expected an object or null")
        n = _float_array(layer.get("totals"), f"{field}.layers[{i}].totals", (num_experts,))
        if not np.all(np.isfinite(n)) or np.any(n < 0):
            raise UsageFormatError(f"{field}.layers[{i}].totals",
                                   f"expected {num_experts} finite numbers >= 0")
        text = layer.get("next")
        size = num_experts * num_experts
        if not isinstance(text, str):
            raise UsageFormatError(f"{field}.layers[{i}].next",
                                   f"expected a base64 string, got {type(text).__name__}")
        if len(text) != 4 * -(-size // 3):       # checked before decoding: no 100 MB decode
            raise UsageFormatError(f"{field}.layers[{i}].next", f"{len(text)} base64 characters, "
                                   f"expected {4 * -(-size // 3)} ({size} bytes)")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise UsageFormatError(f"{field}.layers[{i}].next",
                                   "not base64 (no whitespace or line breaks allowed)") from None
        if len(raw) != size:
            raise UsageFormatError(f"{field}.layers[{i}].next", f"{len(raw)} bytes, expected {size}")
        p = np.frombuffer(raw, dtype=np.uint8).reshape(num_experts, num_experts) / 255.0
        out.append((p * n[:, None], n))
    return out
