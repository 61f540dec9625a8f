"""Batched decode: rows that share a step get the logits they would get alone, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from ext.models.model import PREFILL_CHUNK, Model
from repacked_models import make_in_format

PROMPTS = [[5, 17, 3], [99, 42, 7, 250, 31, 8, 1, 2, 3, 4], [11]]


# (arch, stored format, numerics): fast numerics quantises (int formats) or rounds (bf16)
# the activations of a step's rows together, so a batched row must still equal the row
# alone.
@pytest.fixture(scope="module", params=[("qwen3_moe", "bf16", "exact"), ("qwen2_moe", "bf16", "exact"),
                                        ("mixtral", "bf16", "exact"), ("qwen3_moe", "bf16", "fast-bf16"),
                                        ("qwen3_moe", "int4", "fast"),
                                        ("mixtral", "int8", "fast")], ids=lambda p: "-".join(p))
def model(request, tmp_path_factory):
    arch, dtype, numerics = request.param
    d = make_in_format(tmp_path_factory.mktemp("batch") / "m", dtype, arch=arch, layers=3,
                       experts=8, top_k=2, hidden=64, intermediate=32, seed=3,
                       initializer_range=0.2)
    m = Model.load(d, n_threads=2, numerics=numerics)
    assert m.numerics_in_force() == numerics
    yield m
    m.close()


def _alone(model: Model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    seq = model.new_sequence()
    logits = model.forward(seq, prompt)
    tokens, rows = [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward(seq, [tokens[-1]])
        rows.append(logits[-1])
    return tokens, rows


def test_batched_rows_equal_each_sequence_alone(model):
    steps = 6
    alone = [_alone(model, p, steps) for p in PROMPTS]
    seqs = [model.new_sequence() for _ in PROMPTS]
    last = [int(np.argmax(model.forward(s, p)[-1])) for s, p in zip(seqs, PROMPTS)]
    for step in range(steps):
        # Sequences join and leave: the middle one skips step 2, so lengths differ by more.
        active = [b for b in range(len(seqs)) if not (b == 1 and step == 2)]
        logits = model.forward_batch([seqs[b] for b in active], [last[b] for b in active])
        for row, b in enumerate(active):
            k = step - (1 if b == 1 and step > 2 else 0)
            assert np.array_equal(logits[row], alone[b][1][k]), (b, step)
            last[b] = int(np.argmax(logits[row]))
    assert [s.length for s in seqs] == [len(p) + steps - (b == 1) for b, p in enumerate(PROMPTS)]


def test_bad_batches_change_nothing(model):
    a, b = model.new_sequence(), model.new_sequence()
    model.forward(a, [1, 2])
    model.forward(b, [3])
    for seqs, ids, message in [([], [], "one token list per sequence"),
                               ([a, a], [1, 2], "same sequence"),
                               ([a, b], [1], "2 sequences but 1"),
                               ([a, b], [1, model.config.vocab_size], "out of range"),
                               ([model.new_sequence() for _ in range(PREFILL_CHUNK + 1)],
                                [1] * (PREFILL_CHUNK + 1), "at most")]:
        with pytest.raises(ValueError, match=message):
            model.forward_batch(seqs, ids)
    assert (a.length, b.length) == (2, 1)
