"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), with OpenAI's
logit_bias and presence / frequency penalties, an optional mask of allowed tokens
(constrained decoding), and log-probabilities.

Conventions: logits are a 1-D array [V] (V = vocab_size), float32 from the forward
pass; token ids are Python ints in [0, V). Ordering is fully determined: every sort is
descending by (scaled) logit with ties broken by the lower token id (a stable sort of
the negated values), so a given (logits, params, seed) always yields the same tokens —
independent of thread counts or batch composition, as docs/design.md requires.

The draw: one `Generator.random()` float64 u in [0, 1) per sampled token, from
`numpy.random.Generator(numpy.random.PCG64(seed))`, mapped through the inverse CDF of
the kept tokens taken in that sorted order (probabilities normalised by the sum of all
the weights; only as much of the order is sorted as the draw reaches). Greedy decoding
(temperature 0) draws nothing, so it leaves the stream where it was.

Before that, in this order (float64): logit_bias is added; the penalties of the OpenAI
API reference are applied, `z[j] -= c[j] * frequency_penalty + (c[j] > 0) *
presence_penalty` with c[j] the times token j was generated so far by this sampler
(`accept`); tokens outside an allowed mask are set to -inf. Log-probabilities are those
of the model's own distribution (log_softmax of the raw logits, as vLLM returns by
default), not of the processed one.
"""

from __future__ import annotations

import os

import numpy as np

from ext.sampling_params import SamplingParamError, SamplingParams  # noqa: F401 (re-exported)


# Tokens sorted first when sampling over the whole vocabulary (`_draw_sorted_head`).
_SORTED_HEAD = 256


class Sampler:
    """Stateful sampler for one sequence: owns the random stream.

    Attributes:
        params: the SamplingParams it was built with.
        seed: the seed actually used (params.seed, or the one drawn from os.urandom),
            so a run with seed=None can be replayed.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = (int.from_bytes(os.urandom(8), "little") if params.seed is None
                     else params.seed)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._counts: dict[int, int] = {}      # token id -> times generated (penalties)

    def accept(self, token: int) -> None:
        """Record that `token` was generated (the penalties count it from now on)."""
        self._counts[token] = self._counts.get(token, 0) + 1

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """Pick the next token id.

        Args:
            logits: [V] float array (float32 normally; read only, not modified).
                -inf masks a token; NaN is rejected.
            allowed: None, or a [V] bool mask of the tokens that may be picked (a
                grammar's); the others are masked after bias and penalties.

        Returns:
            A token id in [0, V).

        Raises:
            ValueError: logits not 1-D, empty, containing NaN or +inf, or all -inf
                (after the mask: no allowed token is possible); a logit_bias id >= V.
        """
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        p = self.params
        if (p.temperature == 0 and allowed is None and not p.logit_bias
                and not (self._counts and (p.presence_penalty or p.frequency_penalty))):
            return self._greedy(logits)
        z = logits.astype(np.float64)  # [V]
        if np.isnan(z).any() or np.isposinf(z).any():
            raise ValueError("logits contain NaN or +inf")
        if p.logit_bias:
            ids = np.fromiter((t for t, _ in p.logit_bias), np.int64, len(p.logit_bias))
            if ids.max() >= z.size:
                raise ValueError(f"logit_bias token id {int(ids.max())} out of range [0, {z.size})")
            z[ids] += np.fromiter((b for _, b in p.logit_bias), np.float64, len(p.logit_bias))
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float64, len(self._counts))
            z[ids] -= counts * p.frequency_penalty + p.presence_penalty
        if allowed is not None:
            z[~allowed] = -np.inf
        best = int(np.argmax(z))  # first maximum = lowest id among ties
        if z[best] == -np.inf:
            raise ValueError("all logits are -inf" if allowed is None
                             else "no allowed token has a finite logit")
        if p.temperature == 0:
            return best

        # Scale by temperature after shifting so the maximum is 0: same order as
        # logits / temperature, but no overflow for tiny temperatures.
        z = (z - z[best]) / p.temperature  # [V], max 0
        weights = np.exp(z)  # [V] unnormalised probabilities, 0 where masked/underflowed
        if 0 < p.top_k < z.size:
            # Everything tied with the k-th largest value is a candidate; sorting the
            # candidates (in id order) then keeps the lower ids among ties.
            kth = np.partition(z, z.size - p.top_k)[z.size - p.top_k]
            order = _sort_descending(z, np.flatnonzero(z >= kth))[:p.top_k]  # [k]
            probs = weights[order]  # [k] descending, probs[0] == 1
            nonzero = int(np.count_nonzero(probs))  # zero weights form a suffix
            return self._draw(probs[:nonzero] / probs[:nonzero].sum(), order[:nonzero], p.top_p)
        return self._draw_sorted_head(z, weights, p.top_p)

    def _draw(self, probs: np.ndarray, order: np.ndarray, top_p: float) -> int:
        """Token of one draw from `probs` [N] (normalised, in the sorted order of the
        token ids `order` [N]): the top_p prefix, then the inverse CDF of one uniform."""
        if top_p < 1.0:
            cumulative = np.cumsum(probs)
            keep = int(np.searchsorted(cumulative, top_p, side="left")) + 1
            probs = probs[:keep]
            order = order[:keep]
        cdf = np.cumsum(probs)  # [N], renormalised below by its last entry
        u = self._rng.random() * cdf[-1]
        index = min(int(np.searchsorted(cdf, u, side="right")), order.size - 1)
        return int(order[index])

    def _draw_sorted_head(self, z: np.ndarray, weights: np.ndarray, top_p: float) -> int:
        """`_draw` over every token with a positive weight, sorting only as far down the
        order as the draw reaches: the tokens whose z is at least the m-th largest are a
        prefix of the sorted order (ties included), so that prefix is sorted first, and the
        whole order only when top_p's mass or the uniform lies beyond it (then the head
        cost one partition more than a plain full sort: the worst case stays near it). The
        tokens and their probabilities are those of the whole sorted order, normalised
        by the sum of all weights (taken in id order); a full sort of the vocabulary
        (milliseconds for 10^5 tokens) is needed only when the draw reaches its tail."""
        positive = int(np.count_nonzero(weights))
        total = weights.sum()
        u = self._rng.random() if top_p >= 1.0 else None
        m = min(_SORTED_HEAD, positive)
        while True:
            if m >= positive:
                order = _sort_descending(z, np.flatnonzero(weights > 0))  # [positive]
            else:
                kth = np.partition(z, z.size - m)[z.size - m]
                order = _sort_descending(z, np.flatnonzero(z >= kth))  # [>= m]
            complete = order.size >= positive
            cumulative = np.cumsum(weights[order] / total)
            if u is None:                                 # top_p: the nucleus, then a draw
                if complete or cumulative[-1] >= top_p:
                    keep = min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, order.size)
                    probs = weights[order[:keep]] / total
                    return self._draw(probs / probs.sum(), order[:keep], 1.0)
            else:
                index = int(np.searchsorted(cumulative, u, side="right"))
                if index < order.size:
                    return int(order[index])
                if complete:
                    return int(order[-1])
            m = positive          # past the head: the whole order (one sort, as before)

    @staticmethod
    def _greedy(logits: np.ndarray) -> int:
        """Greedy pick with nothing to add or mask: one pass over the logits as given.
        The same token and errors as the general path: argmax returns the first NaN when
        there is one, else the first +inf, else the first maximum (widening to float64
        changes no order), so looking at the value it picked tells all."""
        best = int(np.argmax(logits))
        v = logits[best]
        if np.isnan(v) or v == np.inf:
            raise ValueError("logits contain NaN or +inf")
        if v == -np.inf:
            raise ValueError("all logits are -inf")
        return best


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` and the `top` most likely tokens under the model.

    Args:
        logits: [V] float array (raw model output). token: an id in [0, V).
        top: how many alternatives, >= 0.
    Returns:
        (logprob of token, [(id, logprob)] of the `top` most likely tokens, descending,
        ties by lower id); log_softmax in float64, so the figures depend only on logits.
    """
    z = np.asarray(logits, np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    out = []
    if top > 0:
        k = min(top, z.size)
        kth = np.partition(z, z.size - k)[z.size - k]
        order = _sort_descending(z, np.flatnonzero(z >= kth))[:k]
        out = [(int(i), float(z[i] - lse)) for i in order]
    return float(z[token] - lse), out


def _sort_descending(z: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Sort ids by z[ids] descending, ties by lower id.

    Same result as `ids[np.argsort(-z[ids], kind="stable")]` for ascending ids, but
    uses numpy's faster unstable sort and then re-sorts only the runs of tied values.

    Args:
        z: [V] float64 scores.
        ids: [N] int64 ascending token ids to order.

    Returns:
        [N] int64 token ids.
    """
    order = ids[np.argsort(-z[ids])]  # [N]
    values = z[order]
    tied = values[1:] == values[:-1]  # [N-1]
    if tied.any():
        in_run = np.zeros(order.size, dtype=bool)
        in_run[1:] |= tied
        in_run[:-1] |= tied
        run = order[in_run]
        # Runs are contiguous and already in descending value order, so sorting the
        # tied positions by (value desc, id asc) only reorders ids inside each run.
        order[in_run] = run[np.lexsort((run, -z[run]))]
    return order
