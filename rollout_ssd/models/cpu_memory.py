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
    """The memory this process can take without swapping or meeting its cgroup's limit: Linux's MemAvailable
    (which counts the page cache it can drop; else the free physical pages), less where the cgroup (v2) it
    runs in allows less (a container's memory.max less its memory.current); None where neither can be read."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                free = min(free, max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return free
