# cython: language_level=3
"""Read-only file mappings that survive their file being truncated.

Design:
- Touching a page of a shared file mapping past the file's current end raises SIGBUS,
  whose default action kills the process; a check of the file's size before the touch
  leaves a gap (the file may shrink between the check and the touch, in any thread,
  inside the kernels' OpenMP loops).
- `GuardedMap` maps a file read-only (MAP_SHARED) and registers its address range in a
  process-wide table. A SIGBUS handler, installed with the first map, looks the faulting
  address up in that table: when it lies in a registered map it replaces the map from
  the faulting page to its end by anonymous zero pages (mmap MAP_FIXED) and counts the
  fault in the map's `faults`; the faulting load is then restarted and reads zeros. Any
  other SIGBUS goes to the handler that was installed before (Python's faulthandler
  under pytest) or, when there was none, kills the process as before.
- So nothing is copied and the reads cost what they did; the owner of a map checks
  `faults` after the reads it cares about, treats a nonzero count as a failed read (the
  bytes it computed with may be zeros), and drops the map for a new one (a map that
  faulted stays part zeros even when the file is restored).
- The handler is installed once, with the first map. A SIGBUS handler installed after it
  (faulthandler.enable() in a running process) would see the fault first; moed installs
  none, and faulthandler enabled at start (PYTHONFAULTHANDLER, pytest) comes before.
- The handler uses only atomic loads and stores, mmap(2) and errno; the table is
  written under the GIL. A range leaves the table before it is unmapped, in
  `__dealloc__`, which runs when the last buffer exported from the map is released.
"""
from cpython.buffer cimport PyBUF_WRITABLE
from libc.errno cimport errno

cdef extern from *:
    """
    #include <errno.h>
    #include <signal.h>
    #include <stdint.h>
    #include <string.h>
    #include <sys/mman.h>
    #include <unistd.h>

    #define GM_SLOTS 4096

    typedef struct { uintptr_t start, end; long faults; } gm_region;
    static gm_region gm_regions[GM_SLOTS];
    static int gm_installed = 0;
    static struct sigaction gm_previous;
    static long gm_total = 0;                 /* faults of every map, ever */
    static uintptr_t gm_page = 4096;

    static void gm_on_sigbus(int sig, siginfo_t *info, void *context) {
        int saved_errno = errno;
        uintptr_t addr = (uintptr_t)info->si_addr;
        if (info->si_code == BUS_ADRERR) {
            for (int i = 0; i < GM_SLOTS; i++) {
                uintptr_t end = __atomic_load_n(&gm_regions[i].end, __ATOMIC_ACQUIRE);
                uintptr_t start = __atomic_load_n(&gm_regions[i].start, __ATOMIC_ACQUIRE);
                if (end == 0 || addr < start || addr >= end)
                    continue;
                uintptr_t page = addr & ~(gm_page - 1);
                void *zeros = mmap((void *)page, end - page, PROT_READ,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
                if (zeros == MAP_FAILED)
                    break;
                __atomic_add_fetch(&gm_regions[i].faults, 1, __ATOMIC_ACQ_REL);
                __atomic_add_fetch(&gm_total, 1, __ATOMIC_ACQ_REL);
                errno = saved_errno;
                return;                       /* the load restarts and reads zeros */
            }
        }
        errno = saved_errno;
        if (gm_previous.sa_flags & SA_SIGINFO) {
            gm_previous.sa_sigaction(sig, info, context);
        } else if (gm_previous.sa_handler != SIG_DFL && gm_previous.sa_handler != SIG_IGN) {
            gm_previous.sa_handler(sig);
        } else {
            signal(sig, SIG_DFL);             /* the fault repeats and kills, as without us */
        }
    }

    static int gm_install(void) {
        if (gm_installed)
            return 0;
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = gm_on_sigbus;
        sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        gm_page = (uintptr_t)sysconf(_SC_PAGESIZE);
        if (sigaction(SIGBUS, &sa, &gm_previous) != 0)
            return -1;
        gm_installed = 1;
        return 0;
    }

    /* The slot of a new range [start, end), or -1 when the table is full. */
    static int gm_register(uintptr_t start, uintptr_t end) {
        for (int i = 0; i < GM_SLOTS; i++) {
            if (__atomic_load_n(&gm_regions[i].end, __ATOMIC_ACQUIRE) != 0)
                continue;
            __atomic_store_n(&gm_regions[i].faults, 0, __ATOMIC_RELEASE);
            __atomic_store_n(&gm_regions[i].start, start, __ATOMIC_RELEASE);
            __atomic_store_n(&gm_regions[i].end, end, __ATOMIC_RELEASE);
            return i;
        }
        return -1;
    }

    static void gm_unregister(int slot) {
        __atomic_store_n(&gm_regions[slot].end, 0, __ATOMIC_RELEASE);
    }

    static long gm_faults(int slot) {
        return __atomic_load_n(&gm_regions[slot].faults, __ATOMIC_ACQUIRE);
    }

    static long gm_faults_total(void) {
        return __atomic_load_n(&gm_total, __ATOMIC_ACQUIRE);
    }
    """
    int gm_install()
    int gm_register(size_t start, size_t end)
    void gm_unregister(int slot)
    long gm_faults(int slot)
    long gm_faults_total()
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    void *MAP_FAILED
    int PROT_READ, MAP_SHARED


def faults_total() -> int:
    """Faults counted by every GuardedMap of the process since it started (a cheap check
    that nothing faulted since an earlier reading; which map did is in its `faults`)."""
    return gm_faults_total()


cdef class GuardedMap:
    """A read-only shared mapping of the first `size` bytes of an open file.

    Args:
        fd: a file descriptor open for reading; the map does not own it (closing it
            later does not unmap).
        size: bytes to map (> 0), at most the file's size now.

    Exports a read-only, one-dimensional buffer of `size` bytes (np.frombuffer works);
    the mapping lives until the map and every buffer exported from it are gone.
    `faults` counts the touches past the file's end since the map was made: nonzero
    means that some bytes read from it may have been zeros instead of the file's.

    Raises:
        ValueError: size <= 0.
        OSError: mmap(2) or sigaction(2) failed, or 4096 maps are alive already.
    """

    cdef char *data
    cdef Py_ssize_t size
    cdef int slot
    cdef Py_ssize_t shape[1]

    def __cinit__(self, int fd, Py_ssize_t size):
        self.data = NULL
        self.slot = -1
        if size <= 0:
            raise ValueError(f"a map needs a positive size, got {size}")
        if gm_install() != 0:
            raise OSError(errno, "cannot install the SIGBUS handler of file maps")
        cdef void *p = mmap(NULL, <size_t>size, PROT_READ, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, "mmap failed")
        self.slot = gm_register(<size_t>p, <size_t>p + <size_t>size)
        if self.slot < 0:
            munmap(p, <size_t>size)
            raise OSError("too many file maps alive (4096)")
        self.data = <char *>p
        self.size = size
        self.shape[0] = size

    @property
    def faults(self) -> int:
        """Touches past the file's end since the map was made (each zeroed the rest)."""
        return gm_faults(self.slot)

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("a GuardedMap is read-only")
        buffer.buf = self.data
        buffer.obj = self
        buffer.len = self.size
        buffer.readonly = 1
        buffer.itemsize = 1
        buffer.format = b"B"
        buffer.ndim = 1
        buffer.shape = self.shape
        buffer.strides = NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    def __dealloc__(self):
        if self.data != NULL:
            gm_unregister(self.slot)           # out of the table before the range is free
            munmap(self.data, <size_t>self.size)
            self.data = NULL
