"""A preallocated KV cache with sequence slots.

Layout per layer: keys and values [num_slots + 1, num_kv_heads, max_len, head_dim]. The extra last
slot is scratch: padded query rows write there, so ragged batches never need a per-row copy loop.
`lengths[slot]` is how many positions of that slot hold valid entries; rollback is just lowering it
(entries past the length are dead and get overwritten by the next append).

Dead entries are still read (masked) where a batch's rows differ in length, so they must be finite: the
cache starts as zeros. On a CPU those are pages of an anonymous private mapping, which read as zeros and
are backed by memory only where written: a cache sized for every slot at the full context costs neither
the time to clear it nor its memory until slots are used (torch.zeros would write all of it at once).
Pages the forwards' writes faulted in one at a time would cost far more than the same pages backed in
bulk (in a VM, bench/RESULTS.md "A new engine's start"), so the runner backs each slot ahead of its writes
(`KVCache.back`, Linux's MADV_POPULATE_WRITE: contents unchanged) a chunk of positions at a time (whole
huge pages where transparent huge pages are always on). One consequence: a CPU cache larger than the
memory left is no longer refused at start-up by torch.zeros; it fails when sequences fill it, so bound it
with `kv_cache_bytes` or `max_batch_size` on a small machine.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
from typing import Sequence

import torch

MADV_POPULATE_WRITE = 23  # Linux >= 5.14: back a range with memory as a write would, contents unchanged
BACK_CHUNK = 256  # positions a slot is backed ahead by, at once
_madvise = None  # libc's madvise once looked up; False where there is none


def populate(address: int, nbytes: int) -> int:
    """Back [address, address + nbytes) with memory now (whole pages): 0, or the errno of the failure
    (EINVAL, ENOSYS or EPERM: the OS cannot, as `KVCache.back` takes them; ENOMEM, EAGAIN, EINTR: not now)."""
    global _madvise
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):
            fn = False
        _madvise = fn  # published typed: another thread's first call must not use it untyped
    if _madvise is False:
        return errno.ENOSYS
    page = mmap.PAGESIZE
    start = address - address % page
    if _madvise(start, nbytes + address - start, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


def lazily_backed(device: torch.device | str) -> bool:
    """Whether `zeroed` maps pages on first write on this device (a CPU with anonymous mappings)."""
    return torch.device(device).type == "cpu" and hasattr(mmap, "MAP_ANONYMOUS") and os.name == "posix"


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor of zeros; on a CPU, untouched until written (pages of an anonymous private mapping)."""
    if not lazily_backed(device):
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # holds `pages` while it lives


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KVCache needs num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        shape = (num_slots + 1, num_kv_heads, max_len, head_dim)
        self.keys = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.values = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self.scratch_slot = num_slots
        self.lengths = [0] * num_slots
        self.backs_ahead = lazily_backed(device)  # `back` has work to do (until the OS says it cannot)
        self._backed = [0] * (num_slots + 1)  # per slot (scratch included): positions [0, n) backed
        self._row_bytes = head_dim * dtype.itemsize
        self._num_kv_heads = num_kv_heads
        self._free = list(range(num_slots - 1, -1, -1))
        # called as fn(src, dst, length, moved) after `copy` (moved False) and `move_down` (True): for
        # whoever tracks slots by the forwards it sees (draft/on_policy.py's TeacherTap), which these skip
        self.observers: list = []

    def back(self, slots: Sequence[int], ends: Sequence[int]) -> None:
        """Back positions [0, end) of each slot with memory before they are written (up to the next
        BACK_CHUNK boundary, one madvise per layer tensor and head), where the cache is lazily mapped.
        Contents stay as they are, so it is safe in any order with writes; where the OS cannot, pages are
        faulted in by the writes themselves as before."""
        if not self.backs_ahead:
            return
        for slot, end in zip(slots, ends):
            if end > self._backed[slot]:
                self._back(slot, end)

    def _back(self, slot: int, end: int) -> None:
        lo = self._backed[slot]
        hi = min(self.max_len, -(-max(end, lo + 1) // BACK_CHUNK) * BACK_CHUNK)
        head_bytes = self.max_len * self._row_bytes
        for cache in (*self.keys, *self.values):
            base = cache.data_ptr() + slot * self._num_kv_heads * head_bytes + lo * self._row_bytes
            for h in range(self._num_kv_heads):
                err = populate(base + h * head_bytes, (hi - lo) * self._row_bytes)
                if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                    self.backs_ahead = False  # not Linux >= 5.14: the writes fault their pages in from now on
                if err:
                    return  # (ENOMEM, EAGAIN, EINTR: tried again at this slot's next forward)
        self._backed[slot] = hi

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """The lowest free slot (so live slots stay one run from 0 where they can: `move_down`)."""
        if not self._free:
            raise RuntimeError("KVCache: no free slot")
        slot = min(self._free)
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def move_down(self, slot: int) -> int:
        """Move an allocated slot's entries into the lowest free slot where that one is lower (freeing
        `slot`); returns the slot that holds them now."""
        if not self._free or min(self._free) > slot:
            return slot
        dst, length = self.allocate(), self.lengths[slot]
        self._copy(slot, dst, length)
        self.free(slot)
        for fn in self.observers:
            fn(slot, dst, length, True)
        return dst

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"KVCache.free: slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Give the empty slot `dst` the first `length` entries of `src` (a shared prompt's KV)."""
        if self.lengths[dst] != 0 or not 0 < length <= self.lengths[src]:
            raise ValueError(f"KVCache.copy: {length} entries of slot {src} (length {self.lengths[src]}) "
                             f"into slot {dst} (length {self.lengths[dst]}, must be empty)")
        self._copy(src, dst, length)
        for fn in self.observers:
            fn(src, dst, length, False)

    def _copy(self, src: int, dst: int, length: int) -> None:
        self.back([dst], [length])
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length] = cache[src, :, :length]
        self.lengths[dst] = length

    def rollback(self, slot: int, length: int) -> None:
        """Forget every entry of `slot` at position >= length."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"KVCache.rollback: length {length} outside [0, {self.lengths[slot]}] for slot {slot}")
        self.lengths[slot] = length
