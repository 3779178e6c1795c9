"""The C allocator's settings for inference on a CPU: freed blocks stay in the process for reuse.

glibc's malloc serves each allocation above its mmap threshold (128 KiB at first, rising with use) with
fresh pages from the kernel and hands them back on free, and it trims the free top of its heap; a decode
or verify step at a large batch allocates and frees tensors of several MB (the logits, their softmax and
log-softmax), so each step pays the page faults for them again, which in a VM costs more than the
arithmetic (bench/RESULTS.md, "A fifth CPU kind"). `keep_freed_memory` sets the mmap threshold to its
maximum (32 MiB: larger blocks, such as weights, still come from mmap) and turns trimming off, as an
allocator such as jemalloc or tcmalloc would keep them; the process's resident memory then stays at its
peak instead of shrinking between steps. The engine applies it when it runs on a CPU, and so does the
SSD draft worker, each once per process.

Where the user set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (glibc's own variables), theirs
stand; ROLLOUT_SSD_KEEP_FREED_MEMORY=0 leaves the allocator as it is; outside glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 2 ** 31 - 1  # mallopt's value is a C int: the largest, i.e. never trim in practice
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_applied: bool | None = None  # None: not tried in this process


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; whether they are in effect (False where not applied:
    turned off, the user's own settings, not glibc, or mallopt refused)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("ROLLOUT_SSD_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if any(name in os.environ for name in USER_VARIABLES):
        log.info("malloc settings: the user's %s stand", [n for n in USER_VARIABLES if n in os.environ])
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.info("malloc settings: freed blocks kept for reuse (%s)", "applied" if _applied else "mallopt refused")
    return _applied


def available_bytes() -> int | None:
    """The memory this machine can give without swapping: Linux's MemAvailable (which counts the page cache
    it can drop), else the free physical pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
