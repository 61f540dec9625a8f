"""Cython kernels (`_kernels.pyx`, C helpers in `_kernels_impl.h`): nogil, OpenMP prange,
explicit n_threads, caller-allocated outputs, f32 accumulation; every output's reduction
order is fixed by the shapes alone. Imports nothing of ext/."""
