"""Build the Cython kernels in ext/kernels/.

The kernels' threads are moed's own pool (``ext/kernels/_pool.h``, pthreads); OpenMP is
still passed when the compiler accepts ``-fopenmp`` (``build_info()["openmp"]``) but
no kernel needs it, and ``MOED_OPENMP=0`` leaves it out. ``MOED_EXTRA_CFLAGS=
-DMOED_POOL_SERIAL`` builds kernels that run every call on the calling thread. By default the code is compiled for
the machine it is installed on (``-march=native``); set ``MOED_PORTABLE=1`` for a
build that runs on any CPU of the architecture. ``MOED_EXTRA_CFLAGS`` is appended to
the compiler flags (e.g. ``-mno-avx512f`` builds the AVX2 path on an AVX-512 machine,
as the tests do). ``MOED_DEBUG=1`` turns on Cython's bounds and wraparound checks.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup


def _compiler_accepts(flags: list[str]) -> bool:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc.split()[0]) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() < 0;}\n"
                    if "-fopenmp" in flags else "int main(void){return 0;}\n")
        cmd = cc.split() + flags + [src, "-o", os.path.join(tmp, "probe")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


compile_args = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno"]
link_args: list[str] = []
if os.environ.get("MOED_PORTABLE", "") not in ("", "0") or sys.platform == "darwin":
    pass
elif _compiler_accepts(["-march=native"]):
    compile_args.append("-march=native")
compile_args += os.environ.get("MOED_EXTRA_CFLAGS", "").split()
if os.environ.get("MOED_OPENMP", "1") == "0":
    print("moed: MOED_OPENMP=0; building without OpenMP", file=sys.stderr)
elif _compiler_accepts(["-fopenmp"]):
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")
else:
    print("moed: compiler lacks OpenMP; building without it", file=sys.stderr)

debug = os.environ.get("MOED_DEBUG", "") not in ("", "0")
directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "cdivision": True,
    "initializedcheck": debug,
}

extensions = [
    Extension(
        "ext.kernels._kernels",
        ["ext/kernels/_kernels.pyx"],
        include_dirs=[numpy.get_include(), "ext/kernels"],
        depends=["ext/kernels/_simd.h", "ext/kernels/_kernels_impl.h", "ext/kernels/_quant_impl.h",
                 "ext/kernels/_idot_impl.h", "ext/kernels/_attn_impl.h", "ext/kernels/_bdot_impl.h", "ext/kernels/_pool.h",
                 "ext/kernels/_weights.pxi"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    # Read-only file maps whose SIGBUS (a shard truncated under them) is a counted fault
    # that reads zeros, not the end of the process (memory-mapped experts).
    Extension(
        "ext.formats._guarded_map",
        ["ext/formats/_guarded_map.pyx"],
        extra_compile_args=["-O2", "-std=gnu11"],
    ),
    # The scheduler's bookkeeping (the shadows' LRU, lrfu's and predictive's state):
    # plain C, no OpenMP, no SIMD; -ffp-contract=off keeps lrfu's doubles equal to Python's.
    Extension(
        "scheduler._shadow",
        ["scheduler/_shadow.pyx"],
        include_dirs=[numpy.get_include()],
        extra_compile_args=["-O2", "-std=gnu11"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    Extension(
        "scheduler._lrfu",
        ["scheduler/_lrfu.pyx"],
        include_dirs=[numpy.get_include()],
        extra_compile_args=["-O2", "-std=gnu11", "-ffp-contract=off"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives))
