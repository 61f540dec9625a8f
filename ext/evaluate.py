"""What a lossy format costs: a model compared with a reference over teacher-forced text.

Both models read the same token ids — the text through the reference's tokenizer, which
the model's must agree with — in consecutive windows of `context` tokens, each window a
fresh sequence (as the held-out evaluation of training/default_model.py does; llama.cpp's
perplexity tool also cuts its text into independent windows). A window is preceded by the
tokenizer's own prefix (its BOS, when encoding adds one), which is fed but not scored.
At every scored position t each model gives a next-token distribution p(. | ids[<=t]), and:

    KL(reference || model) at t = sum_v p_ref(v) * (log p_ref(v) - log p_model(v))   nats
    top-1 agreement at t        = argmax p_ref == argmax p_model (ties: the lowest id)
    nats of a model at t        = -log p(ids[t+1])
    bits per byte of a model    = sum_t nats / ln 2 / bytes of the scored tokens' text

Log-probabilities are float64, computed from the models' float32 logits; the scored
tokens' text is what they decode to (special tokens included), counted in UTF-8 bytes.
The forward pass is bit-deterministic, so the same inputs give the same figures.

Shape legend: W tokens of a window, V vocab_size, N scored positions.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ext.models.model import Model
from ext.tokenizer import Tokenizer

DEFAULT_CONTEXT = 512   # tokens per window (llama.cpp's perplexity default)


class EvaluationInputError(ValueError):
    """Two models or a text that cannot be compared; the message says which and why."""


@dataclass(frozen=True)
class TokenStream:
    """The token ids a comparison reads, cut into windows.

    ids: [N + 1] the text's first N + 1 token ids (position t is scored against
    ids[t + 1]); prefix: ids fed before every window and not scored (e.g. [bos]);
    context: scored tokens per window (the last window may be shorter); n_bytes: UTF-8
    bytes of the text ids[1:] decode to (the denominator of bits per byte).
    """

    ids: np.ndarray
    prefix: tuple[int, ...]
    context: int
    n_bytes: int
    sha256: str = field(default="")

    @property
    def tokens(self) -> int:
        return int(self.ids.size) - 1

    def windows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input ids [len(prefix) + W], target ids [W]) of each window, in order."""
        out = []
        prefix = np.asarray(self.prefix, np.int64)
        for s in range(0, self.tokens, self.context):
            e = min(s + self.context, self.tokens)
            out.append((np.concatenate([prefix, self.ids[s:e]]), self.ids[s + 1:e + 1]))
        return out


def token_stream(tokenizer: Tokenizer, text: str, *, tokens: int | None = None,
                 context: int = DEFAULT_CONTEXT) -> TokenStream:
    """The first `tokens` scored positions of `text` (all of it when None).

    Raises EvaluationInputError when the text holds fewer than 2 tokens, or `context` /
    `tokens` is below 1.
    """
    if context < 1 or (tokens is not None and tokens < 1):
        raise EvaluationInputError(f"context and tokens must be >= 1, got {context} and {tokens}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise EvaluationInputError(f"the text holds {len(ids)} token(s); at least 2 are needed")
    if tokens is not None:
        ids = ids[:tokens + 1]
    prefix = tuple(tokenizer.encode("", add_special_tokens=True))
    n_bytes = (len(tokenizer.decode(ids, skip_special_tokens=False).encode("utf-8"))
               - len(tokenizer.decode(ids[:1], skip_special_tokens=False).encode("utf-8")))
    arr = np.asarray(ids, np.int64)
    return TokenStream(ids=arr, prefix=prefix, context=context, n_bytes=max(n_bytes, 1),
                       sha256=hashlib.sha256(arr.tobytes()).hexdigest())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[W, V] float64 log-probabilities of [W, V] logits (any float dtype)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class WindowScores:
    """Per-position figures of one window, [W] each: KL(reference || model) in nats,
    top-1 agreement (bool), and each model's nats on the target token."""

    kl: np.ndarray
    agree: np.ndarray
    nats_model: np.ndarray
    nats_reference: np.ndarray


def score_window(logp_model: np.ndarray, logp_reference: np.ndarray,
                 targets: np.ndarray) -> WindowScores:
    """Compare [W, V] float64 log-probabilities (see `log_softmax`) at W positions whose
    next tokens are `targets` [W]."""
    rows = np.arange(targets.size)
    kl = np.einsum("tv,tv->t", np.exp(logp_reference), logp_reference - logp_model)
    return WindowScores(kl=np.maximum(kl, 0.0),   # >= 0 in exact arithmetic; -1e-17 is rounding
                        agree=logp_model.argmax(-1) == logp_reference.argmax(-1),
                        nats_model=-logp_model[rows, targets],
                        nats_reference=-logp_reference[rows, targets])


def window_logprobs(model: Model, inputs: np.ndarray, scored: int) -> np.ndarray:
    """[scored, V] float64 log-probabilities of the last `scored` positions of `inputs`
    run through `model` as a fresh sequence (teacher forcing)."""
    seq = model.new_sequence(capacity=inputs.size)
    return log_softmax(model.forward(seq, inputs, all_logits=True)[-scored:])


@dataclass(frozen=True)
class Comparison:
    """The figures of `compare` (see the module doc): over `tokens` scored positions in
    `windows` windows of at most `context` tokens."""

    tokens: int
    windows: int
    context: int
    n_bytes: int
    kl_mean_nats: float
    kl_p99_nats: float
    kl_max_nats: float
    top1_agreement: float
    nats_per_token_model: float
    nats_per_token_reference: float
    bits_per_byte_model: float
    bits_per_byte_reference: float

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "windows": self.windows, "context": self.context,
                "bytes": self.n_bytes,
                "kl_mean_nats": self.kl_mean_nats, "kl_p99_nats": self.kl_p99_nats,
                "kl_max_nats": self.kl_max_nats, "top1_agreement": self.top1_agreement,
                "nats_per_token": {"model": self.nats_per_token_model,
                                   "reference": self.nats_per_token_reference},
                "bits_per_byte": {"model": self.bits_per_byte_model,
                                  "reference": self.bits_per_byte_reference}}


def summarize(scores: Sequence[WindowScores], stream: TokenStream) -> Comparison:
    """Pool the windows' per-position figures into one Comparison. p99 is numpy's
    default (linear) percentile over positions."""
    kl = np.concatenate([s.kl for s in scores])
    agree = np.concatenate([s.agree for s in scores])
    nm = float(np.concatenate([s.nats_model for s in scores]).sum())
    nr = float(np.concatenate([s.nats_reference for s in scores]).sum())
    n = kl.size
    return Comparison(tokens=n, windows=len(scores), context=stream.context,
                      n_bytes=stream.n_bytes, kl_mean_nats=float(kl.mean()),
                      kl_p99_nats=float(np.percentile(kl, 99)), kl_max_nats=float(kl.max()),
                      top1_agreement=float(agree.mean()),
                      nats_per_token_model=nm / n, nats_per_token_reference=nr / n,
                      bits_per_byte_model=nm / math.log(2) / stream.n_bytes,
                      bits_per_byte_reference=nr / math.log(2) / stream.n_bytes)


def check_comparable(model: Model, reference: Model, stream: TokenStream) -> None:
    """Raise EvaluationInputError unless both models give logits over one vocabulary and
    can hold a window (prefix + context tokens) in their context."""
    vm, vr = model.config.vocab_size, reference.config.vocab_size
    if vm != vr:
        raise EvaluationInputError(f"the model has vocab_size {vm} and the reference {vr}: "
                                   "compare models that share a tokenizer")
    need = len(stream.prefix) + min(stream.context, stream.tokens)
    for name, m in (("model", model), ("reference", reference)):
        if need > m.config.max_position_embeddings:
            raise EvaluationInputError(
                f"a window of {need} tokens exceeds the {name}'s max_position_embeddings "
                f"{m.config.max_position_embeddings}; give a smaller context")


def compare(model: Model, reference: Model, stream: TokenStream,
            progress: Callable[[int, int], None] | None = None) -> Comparison:
    """Teacher-force `stream` through both models and compare them (module doc).

    progress(done, total) is called after each model's window (total = 2 x windows).
    Raises EvaluationInputError (see `check_comparable`).
    """
    check_comparable(model, reference, stream)
    windows = stream.windows()
    scores = []
    for i, (inputs, targets) in enumerate(windows):
        ref = window_logprobs(reference, inputs, targets.size)
        if progress is not None:
            progress(2 * i + 1, 2 * len(windows))
        got = window_logprobs(model, inputs, targets.size)
        if progress is not None:
            progress(2 * i + 2, 2 * len(windows))
        scores.append(score_window(got, ref, targets))
    return summarize(scores, stream)
