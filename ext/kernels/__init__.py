"""Cython kernels (`_kernels.pyx`; the weight types in `_weights.pxi`; C helpers in
`_kernels_impl.h` for dense and `_quant_impl.h` for block-quantised weights; the thread
pool in `_pool.h`): nogil, explicit n_threads, caller-allocated outputs, f32
accumulation; every output's reduction order is fixed by the shapes alone. Imports
nothing of ext/."""

# The numerics modes of the kernels (`_kernels` module docstring): "exact" dequantises
# weights exactly and keeps activations f32; "fast" dots int8/int4/MXFP4 codes with int8
# activations under moed's written spec (q8x2-32); "fast-bf16" does that and also dots
# bf16 weights with bf16-rounded activations (bf16-dp). Here, not in `_kernels`, so that
# configuration code can name the modes without loading the kernels.
NUMERICS = ("exact", "fast", "fast-bf16")
# What a model's `numerics` setting may say: a mode, or "auto", which each model resolves
# to one (`resolve_numerics`). auto is the daemon's and the commands' default.
NUMERICS_SETTINGS = ("auto", *NUMERICS)
# The weight formats whose products "fast" (and "auto") changes; "fast-bf16" changes
# bf16 weights too; f32, f16, FP8 and every router compute the same bits in every mode.
FAST_FORMATS = frozenset({"int8", "int4", "mxfp4"})
BF16_FORMATS = frozenset({"bf16"})


def fast_level(numerics: str) -> int:
    """The kernels' `fast` argument for a setting: 0 for "exact", 1 for "auto" and "fast"
    (int8, int4 and MXFP4 weights fast), 2 for "fast-bf16" (bf16 weights too). Raises
    ValueError for an unknown setting."""
    if numerics not in NUMERICS_SETTINGS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS_SETTINGS)}, "
                         f"got {numerics!r}")
    return {"exact": 0, "auto": 1, "fast": 1, "fast-bf16": 2}[numerics]


def resolve_numerics(numerics: str, formats) -> str:
    """The mode a model runs under the setting `numerics` (one of NUMERICS_SETTINGS), given
    the formats of the weights fast numerics may change (routed experts and resident
    linear weights, routers excluded: an iterable of format labels, e.g. "int4", "bf16").

    "fast-bf16" when the setting is "fast-bf16" and some format is bf16; else "fast" when
    the setting is not "exact" and some format is in FAST_FORMATS; else "exact", where
    the modes compute the same bits. auto chooses fast because fast met the project's
    quality bar on every format it changes and runs at or above exact speed there; it
    leaves bf16 exact because bf16-dp pays only on CPUs with AVX-512 BF16
    (docs/numerics.md). Raises ValueError for an unknown setting.
    """
    level = fast_level(numerics)
    formats = set(formats)
    if level >= 2 and BF16_FORMATS & formats:
        return "fast-bf16"
    return "fast" if level >= 1 and FAST_FORMATS & formats else "exact"
