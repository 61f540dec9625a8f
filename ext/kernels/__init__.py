"""Cython kernels (`_kernels.pyx`; the weight types in `_weights.pxi`; C helpers in
`_kernels_impl.h` for dense and `_quant_impl.h` for block-quantised weights; the thread
pool in `_pool.h`): nogil, explicit n_threads, caller-allocated outputs, f32
accumulation; every output's reduction order is fixed by the shapes alone. Imports
nothing of ext/."""

# The numerics modes of the quantised kernels (`_kernels` module docstring): "exact"
# dequantises weights exactly and keeps activations f32; "fast" dots int8/int4/MXFP4
# codes with int8 activations under moed's written spec. Here, not in `_kernels`, so
# that configuration code can name the modes without loading the kernels.
NUMERICS = ("exact", "fast")
# What a model's `numerics` setting may say: a mode, or "auto", which each model resolves
# to one (`resolve_numerics`). auto is the daemon's and the commands' default.
NUMERICS_SETTINGS = ("auto", *NUMERICS)
# The weight formats whose products fast numerics changes; every other format (f32, f16,
# bf16, FP8) and every router computes the same bits in both modes.
FAST_FORMATS = frozenset({"int8", "int4", "mxfp4"})


def resolve_numerics(numerics: str, formats) -> str:
    """The mode a model runs under the setting `numerics` (one of NUMERICS_SETTINGS), given
    the formats of the weights fast numerics may change (routed experts and resident
    linear weights, routers excluded: an iterable of format labels, e.g. "int4", "bf16").

    "fast" when the setting is "fast" or "auto" and some format is in FAST_FORMATS;
    "exact" otherwise, where both modes compute the same bits. auto chooses fast because
    fast met the project's quality bar on every format it changes and runs at or above
    exact speed there (docs/numerics.md). Raises ValueError for an unknown setting.
    """
    if numerics not in NUMERICS_SETTINGS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS_SETTINGS)}, "
                         f"got {numerics!r}")
    if numerics == "exact":
        return "exact"
    return "fast" if FAST_FORMATS.intersection(formats) else "exact"
