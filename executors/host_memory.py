"""Host memory that stays with the process between steps.

glibc's malloc hands a large block back to the kernel when it is freed (munmap, or trimming the heap's
top), so the next step's tensors of the same sizes fault every page in again and the kernel zeroes each
one first. A training step frees its activations and gradients at the end of every backward and allocates
them again in the next: on a CPU rank this costs more than the backward's own matmuls once the step's
activations outgrow what the heap keeps (SmolLM2-135M, 16 x 120 tokens: 10.5 s a training step at 30
layers, 6.4 s with freed memory kept; 2.5 and 2.4 s at 10 layers).

`keep_freed_host_memory` tells malloc to serve every allocation from its heap and never to trim it: freed
blocks are reused by the next step's tensors of the same sizes (after the first few steps, while freed
neighbours merge into holes that fit an aligned block), and the process's resident memory stays at its
peak, the peak the plan charges, plus the heap's slack (the SmolLM2 step above: 5.97 GB at its peak,
5.92 GB without). CPU ranks and the calibration probes that time them call it
first; CUDA ranks keep their tensors in the CUDA caching allocator and do not. `GRAPHRL_HOST_MEMORY=release`
leaves malloc as it is (for a rank that shares its machine's memory with other work).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

RELEASE_ENV = "GRAPHRL_HOST_MEMORY"


@functools.cache
def keep_freed_host_memory() -> bool:
    """Keep freed host memory in this process for reuse (see the module docstring); True when malloc
    took the settings, False where it is not glibc's or `GRAPHRL_HOST_MEMORY=release` says not to."""
    if os.environ.get(RELEASE_ENV, "keep") == "release":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # -1 disables trimming (mallopt(3)); 0 mmaps nothing: large blocks come from the heap and return to it.
    return bool(mallopt(M_TRIM_THRESHOLD, -1)) and bool(mallopt(M_MMAP_MAX, 0))
