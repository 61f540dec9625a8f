"""Cython kernels (`_kernels.pyx`; the weight types in `_weights.pxi`; C helpers in
`_kernels_impl.h` for dense and `_quant_impl.h` for block-quantised weights): nogil,
OpenMP prange, explicit n_threads, caller-allocated outputs, f32 accumulation; every
output's reduction order is fixed by the shapes alone. Imports nothing of ext/."""
