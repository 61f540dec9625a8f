"""Kernel tests run every call on the threads they ask for: the parallel threshold (below
which a call runs on one thread, a speed choice) is set to 1 so that small test shapes
exercise the multi-thread path too."""
from __future__ import annotations

import pytest

from ext.kernels import _kernels


@pytest.fixture(autouse=True)
def every_call_parallel():
    before = _kernels.parallel_threshold()
    _kernels.set_parallel_threshold(1)
    yield
    _kernels.set_parallel_threshold(before)
