"""Host memory a training step frees, kept for the next step instead of given back to the kernel.

glibc's malloc serves a large request (from 128 KB, a threshold it raises as it sees larger
blocks freed, up to 32 MB) with a fresh mmap, and gives the free top of a heap back to the
kernel once it exceeds a trim threshold (twice the other). A training step allocates its
activations and gradients and frees most of them at its end; the next step takes them again,
and every page taken again is a page fault and a zeroed page: on the CPU, ResNet-20 at 32
images a rank spent about a tenth of its step so (docs/performance.md). With the thresholds
fixed high, a step's blocks come from the heap and go back to it, and the next step reuses
them. The cost: a process keeps up to TRIM_THRESHOLD of freed memory it had used at its peak,
as PyTorch's CUDA caching allocator keeps GPU memory.

A user's own setting wins: glibc reads MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ (or
GLIBC_TUNABLES) at start-up, and where either is set nothing is changed here. Elsewhere than
glibc (no ``mallopt``) nothing is changed either.
"""
import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # the most glibc takes (half its 64 MB heaps): blocks up to it come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at a heap's top kept up to this
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory(environ=os.environ):
    """Fix malloc's mmap and trim thresholds high (see above). Returns whether they were set.
    HOROVOD_KEEP_FREED_MEMORY=0 (the build's own switch for the same setting, patch 0025): not."""
    if environ.get("HOROVOD_KEEP_FREED_MEMORY", "1") == "0" or any(name in environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
