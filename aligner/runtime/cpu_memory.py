"""Keep freed tensor memory in the process on CPU hosts, so that a training step does not page-fault.

torch's CPU allocator is glibc's malloc. A step frees and re-allocates the same activation-sized
blocks (hundreds of kB to MBs) every time, and glibc returns such blocks to the kernel (an mmap
per block above its threshold; a trim of the heap top otherwise), so each new block is faulted in
again, page by page: ~1,200 minor faults and ~7 ms of system time per step of the tiny DPO/RM
benchmark (bench/preference_vs_trl.py), 140 faults and 3 ms with this set. The process keeps its
peak heap instead (what jemalloc or tcmalloc, which torch's CPU tuning guide recommends, also do).
Blocks above 32 MiB, glibc's largest mmap threshold, are still mapped and returned.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's HEAP_MAX / 2 on 64-bit: larger values are refused
_kept = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where the C library
    is not glibc (the call is then a no-op)."""
    global _kept
    if _kept:
        return True
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no glibc mallopt (%s): freed CPU memory is returned to the system as usual", path)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
    return _kept
