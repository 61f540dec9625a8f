"""The numerics mode of a loaded model: "fast" changes the products of int8, int4 and MXFP4
weights only, "fast-bf16" those of bf16 weights too (the kernels' bit-level specs are
tested in tests/ext/kernels/); both stay close to "exact" and keep a token's logits
independent of how its prompt is chunked."""
from __future__ import annotations

import numpy as np
import pytest

from ext.makemodel import make_model
from ext.models.model import PREFILL_CHUNK, Model
from repacked_models import make_in_format

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31, 8, 1, 2, 3]
SHAPE = dict(arch="qwen3_moe", layers=3, experts=8, top_k=2, hidden=64, intermediate=32, seed=5,
             initializer_range=0.2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("numerics")
    out = {dtype: make_in_format(root / dtype, dtype, **SHAPE) for dtype in ("int4", "int8")}
    out["bf16"] = root / "int4-bf16"                  # the source make_in_format repacked
    out["mxfp4"] = make_model(root / "mxfp4", dtype="mxfp4", **SHAPE)
    out["fp8"] = make_model(root / "fp8", dtype="fp8", **SHAPE)
    return out


def _logits(model_dir, numerics, prompt=PROMPT, n_threads=2) -> np.ndarray:
    model = Model.load(model_dir, n_threads=n_threads, numerics=numerics)
    try:
        return model.forward(model.new_sequence(), prompt, all_logits=True)
    finally:
        model.close()


def test_an_unknown_mode_is_refused(dirs):
    with pytest.raises(ValueError, match="numerics must be one of auto, exact, fast, fast-bf16, got 'quick'"):
        Model.load(dirs["int4"], numerics="quick")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_fast_is_exact_where_it_changes_nothing(dirs, dtype):
    model = Model.load(dirs[dtype], numerics="fast")
    assert model.numerics_in_force() == "exact"
    assert model.weight_formats()["numerics"] == "exact"
    model.close()
    assert np.array_equal(_logits(dirs[dtype], "fast"), _logits(dirs[dtype], "exact"))


@pytest.mark.parametrize("dtype", ["int4", "int8", "mxfp4"])
def test_fast_differs_from_exact_by_little(dirs, dtype):
    model = Model.load(dirs[dtype], numerics="fast")
    assert model.weight_formats()["numerics"] == "fast"
    model.close()
    fast, exact = _logits(dirs[dtype], "fast"), _logits(dirs[dtype], "exact")
    assert not np.array_equal(fast, exact)              # the fast kernels ran
    scale = np.abs(exact).max()
    assert np.abs(fast - exact).max() < 0.05 * scale, np.abs(fast - exact).max() / scale
    assert (fast.argmax(-1) == exact.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("dtype, mode", [("int4", "fast"), ("mxfp4", "fast"), ("bf16", "fast-bf16"),
                                         ("int4", "fast-bf16")])
def test_fast_logits_do_not_depend_on_chunking_or_threads(dirs, dtype, mode):
    whole = _logits(dirs[dtype], mode, n_threads=2)
    assert np.array_equal(_logits(dirs[dtype], mode, n_threads=1), whole)
    model = Model.load(dirs[dtype], n_threads=2, numerics=mode)
    seq = model.new_sequence()
    rows = [model.forward(seq, PROMPT[:5], all_logits=True)]
    rows += [model.forward(seq, [t]) for t in PROMPT[5:]]   # one token a step, as decode
    model.close()
    assert np.array_equal(np.concatenate(rows), whole)


@pytest.mark.parametrize("dtype, mode", [("int4", "fast"), ("bf16", "fast-bf16")])
def test_a_long_prompt_crosses_prefill_chunks_with_the_same_bits(dirs, dtype, mode):
    prompt = [(7 * i + 3) % 256 for i in range(PREFILL_CHUNK + 9)]
    whole = _logits(dirs[dtype], mode, prompt)
    model = Model.load(dirs[dtype], n_threads=2, numerics=mode)
    seq = model.new_sequence()
    parts = [model.forward(seq, prompt[i:i + 7], all_logits=True) for i in range(0, len(prompt), 7)]
    model.close()
    assert np.array_equal(np.concatenate(parts), whole)


def test_fast_bf16_rounds_bf16_activations_and_reports_it(dirs):
    """fast-bf16 on a bf16 model runs bf16-dp: not exact, close to it, reported as such;
    on an int4 repack it changes the bf16 attention too (not fast's bits)."""
    model = Model.load(dirs["bf16"], numerics="fast-bf16")
    assert model.numerics_in_force() == "fast-bf16" == model.weight_formats()["numerics"]
    model.close()
    fast, exact = _logits(dirs["bf16"], "fast-bf16"), _logits(dirs["bf16"], "exact")
    assert not np.array_equal(fast, exact)
    # bf16 activations keep 8 significant bits (two int8 planes about 15): this random
    # model (initializer_range 0.2) amplifies the rounding more than a trained one, whose
    # cost is measured by bench/fast_numerics.py --formats bf16
    assert np.abs(fast - exact).max() < 0.3 * np.abs(exact).max()
    assert (fast.argmax(-1) == exact.argmax(-1)).mean() >= 0.75
    assert not np.array_equal(_logits(dirs["int4"], "fast-bf16"), _logits(dirs["int4"], "fast"))


def test_the_configuration_names_the_kernels_modes():
    from daemon.service import config
    from ext import kernels
    assert kernels.NUMERICS == ("exact", "fast", "fast-bf16")
    assert config.NUMERICS == kernels.NUMERICS_SETTINGS == ("auto", "exact", "fast", "fast-bf16")
    assert config.ServeConfig().numerics == "auto"


def test_the_library_default_is_exact(dirs):
    """Model.load without `numerics` runs the oracle's mode, whatever the daemon's default."""
    model = Model.load(dirs["int4"])
    assert model.numerics_in_force() == "exact"
    model.close()


@pytest.mark.parametrize("dtype, resolved", [("int4", "fast"), ("int8", "fast"), ("mxfp4", "fast"),
                                             ("bf16", "exact"), ("fp8", "exact")])
def test_auto_resolves_per_model_and_runs_the_resolved_mode(dirs, dtype, resolved):
    model = Model.load(dirs[dtype], numerics="auto")
    assert model.numerics_in_force() == resolved
    assert model.weight_formats()["numerics"] == resolved      # what /v1/models reports
    model.close()
    assert np.array_equal(_logits(dirs[dtype], "auto"), _logits(dirs[dtype], resolved))


@pytest.mark.parametrize("setting, formats, resolved", [
    ("auto", ["int4"], "fast"), ("auto", ["bf16", "mxfp4"], "fast"), ("auto", ["int8"], "fast"),
    ("auto", ["bf16"], "exact"), ("auto", ["fp8_e4m3", "bf16"], "exact"), ("auto", [], "exact"),
    ("fast", ["bf16"], "exact"), ("fast", ["int4"], "fast"), ("exact", ["int4"], "exact"),
    ("fast-bf16", ["bf16"], "fast-bf16"), ("fast-bf16", ["bf16", "int4"], "fast-bf16"),
    ("fast-bf16", ["int4"], "fast"), ("fast-bf16", ["fp8_e4m3", "f16"], "exact"),
    ("exact", ["bf16"], "exact")])
def test_resolve_numerics(setting, formats, resolved):
    from ext.kernels import resolve_numerics
    assert resolve_numerics(setting, formats) == resolved


def test_resolve_numerics_refuses_an_unknown_setting():
    from ext.kernels import resolve_numerics
    with pytest.raises(ValueError, match="got 'Auto'"):
        resolve_numerics("Auto", ["int4"])
