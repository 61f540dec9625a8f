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
