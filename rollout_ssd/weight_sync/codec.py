"""Full and exact-delta encoding of tensors into bucketed byte buffers, and its strict decoding.

Exact delta: tensors are compared as integer views of their bits, so a delta reproduces the new tensor
bit for bit (-0.0 vs 0.0 and NaN payloads included). A delta segment is

    gaps [C] index_dtype   gaps[0] = i_0, gaps[j] = i_j - i_{j-1}  (i_j: sorted flat indices that changed)
    xors [C] element bits  new_bits[i_j] ^ base_bits[i_j]

each stored byte-planar (all first bytes, then all second bytes, ...), optionally zlib-compressed as
one stream. The three choices are for zlib: gaps instead of indices and XORs instead of new values
make the high bytes almost always zero (a small optimizer step moves a bf16 weight by an ulp or two),
and byte planes turn those zeros into long runs. On AdamW-like steps this is smaller than zlib
over plain indices + values (bench/RESULTS.md, bench_sync). The receiver applies XORs to its own bits, so a delta is only valid on
exactly its base: the manifest carries the base's checksum and the receiver checks it first.
Per tensor the encoder keeps whichever of full / delta / compressed delta is smallest; above
`max_delta_share` changed elements it goes straight to full (cheaper to build, and dense deltas never
win by much).

Checksums are crc32 + adler32 of the raw bytes (16 hex digits): they catch corruption and mismatched
bases, they are not a defence against a malicious peer (the peer is a trusted learner).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

from .errors import WeightSyncError
from .manifest import (
    ALIGN,
    DTYPE_NAMES,
    DTYPES,
    INDEX_DTYPES,
    BucketEntry,
    Manifest,
    TensorEntry,
)
from .mix64 import GAMMA, M64, mix64, signed64

INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHECKSUM_CHUNK = 64 << 20
_MIN_COMPRESS_BYTES = 4096


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bits(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of a contiguous tensor's bits: [numel] int8/16/32/64."""
    return t.reshape(-1).view(INT_VIEWS[t.element_size()])


# Checksum kinds. "crc": crc32 + adler32 of the bytes (zlib, on the host: a device tensor is copied
# there chunk by chunk). "sum64": a 64-bit hash computed where the tensor is, with integer tensor ops
# only (each element's bits, mixed with its index, summed mod 2^64: the sum's order cannot change it, so
# a CPU and a GPU compute the same value), for transfers between GPUs that should not touch the host.
# A checksum names its kind: "sum64" ones start with "s"; the receiver checks with the sender's kind.
CHECKSUM_KINDS = ("crc", "sum64")
_SUM64_CHUNK = 8 << 20  # elements per pass (bounds the int64 temporaries)
def _sum64(t: torch.Tensor) -> str:
    words = bits(t.detach().contiguous())  # [numel], each element's bits
    total = 0
    for start in range(0, words.numel(), _SUM64_CHUNK):
        chunk = words[start:start + _SUM64_CHUNK].long()  # sign-extended, one pass at a time
        index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        total = (total + int(mix64(chunk + (index + 1) * GAMMA).sum())) & M64  # one host read per pass
    final = int(mix64(torch.tensor([signed64(total), t.numel() * 64 + t.element_size()])).sum()) & M64
    return f"s{final:016x}"


def checksum_kind(expected: str) -> str:
    """The kind of a checksum string ("crc" or "sum64")."""
    return "sum64" if expected.startswith("s") else "crc"


def matches(t: torch.Tensor, expected: str) -> bool:
    """Whether `t` has the checksum `expected`, computed with that checksum's kind."""
    return checksum(t, checksum_kind(expected)) == expected


def checksum(t: torch.Tensor, kind: str = "crc") -> str:
    """The checksum of the tensor's bytes in C order: "crc" (16 hex digits) or "sum64" ("s" + 16)."""
    if kind == "sum64":
        return _sum64(t)
    if kind != "crc":
        raise ValueError(f"checksum kind must be one of {CHECKSUM_KINDS}, got {kind!r}")
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    crc, adler = 0, 1
    for start in range(0, flat.numel(), _CHECKSUM_CHUNK):
        chunk = flat[start:start + _CHECKSUM_CHUNK].cpu().numpy()
        crc, adler = zlib.crc32(chunk, crc), zlib.adler32(chunk, adler)
    return f"{crc:08x}{adler:08x}"


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's segment before packing: `data` is the full tensor or the delta bytes."""

    entry: TensorEntry  # bucket/offset still 0: `pack` places it
    data: torch.Tensor  # full: the tensor itself; delta: uint8 [nbytes]
    changed: int  # elements whose bits differ from the base (numel when there is no base)


def encode_tensor(name: str, new: torch.Tensor, base: torch.Tensor | None, base_checksum: str, *,
                  max_delta_share: float, compression: str, level: int, kind: str = "crc") -> EncodedTensor:
    """Encode `new` (contiguous, rollout dtype) as full or as a delta against `base`, whichever is smaller."""
    dtype = DTYPE_NAMES[new.dtype]
    full = TensorEntry(name=name, shape=tuple(new.shape), dtype=dtype, encoding="full", bucket=0, offset=0,
                       nbytes=new.numel() * new.element_size(), checksum=checksum(new, kind))
    if base is None or base.shape != new.shape or base.dtype != new.dtype:
        return EncodedTensor(full, new, new.numel())
    old_bits, new_bits = bits(base), bits(new)
    indices = (old_bits != new_bits).nonzero().squeeze(1)  # [C] int64, sorted
    count = indices.numel()
    if count > max_delta_share * new.numel():
        return EncodedTensor(full, new, count)
    index_dtype = "int32" if new.numel() <= 2**31 - 1 else "int64"
    gaps = torch.diff(indices, prepend=indices.new_zeros(1)).to(INDEX_DTYPES[index_dtype])  # [C]
    raw = torch.cat([_to_planes(gaps), _to_planes(old_bits[indices] ^ new_bits[indices])])  # [C*(isz+esz)]
    raw_nbytes = raw.numel()
    data, used = raw, "none"
    if compression == "zlib" and raw_nbytes >= _MIN_COMPRESS_BYTES:
        packed = zlib.compress(raw.cpu().numpy(), level)
        if len(packed) < raw_nbytes:
            data, used = torch.frombuffer(bytearray(packed), dtype=torch.uint8), "zlib"
    if data.numel() >= full.nbytes:
        return EncodedTensor(full, new, count)
    delta = TensorEntry(name=name, shape=full.shape, dtype=dtype, encoding="delta", bucket=0, offset=0,
                        nbytes=data.numel(), checksum=full.checksum, count=count, index_dtype=index_dtype,
                        compression=used, base_checksum=base_checksum)
    return EncodedTensor(delta, data, count)


def pack(encoded: list[EncodedTensor], version: int, base_version: int | None, bucket_bytes: int,
         device: torch.device, kind: str = "crc") -> tuple[Manifest, list[torch.Tensor]]:
    """Place segments into uint8 buckets of at most `bucket_bytes` (a bigger segment gets its own)."""
    placed, sizes = [], []
    for enc in encoded:
        offset = _round_up(sizes[-1], ALIGN) if sizes else 0
        if not sizes or (sizes[-1] > 0 and offset + enc.entry.nbytes > bucket_bytes):
            sizes.append(0)
            offset = 0
        sizes[-1] = offset + enc.entry.nbytes
        placed.append(replace(enc.entry, bucket=len(sizes) - 1, offset=offset))
    buckets = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
    for enc, entry in zip(encoded, placed):
        buckets[entry.bucket][entry.offset:entry.offset + entry.nbytes] = enc.data.reshape(-1).view(torch.uint8)
    manifest = Manifest(version=version, base_version=base_version,
                        buckets=tuple(BucketEntry(b.numel(), checksum(b, kind)) for b in buckets),
                        tensors=tuple(placed))
    return manifest, buckets


@dataclass(frozen=True)
class StagedTensor:
    """A verified, decoded tensor update, ready to be copied into a parameter."""

    entry: TensorEntry
    data: torch.Tensor | None = None  # full: [*shape] of entry's dtype (a view into a bucket)
    indices: torch.Tensor | None = None  # delta: [C] int64 flat indices, strictly increasing
    xors: torch.Tensor | None = None  # delta: [C] new bits ^ base bits (integer view)


def verify_buckets(manifest: Manifest, buckets: list[torch.Tensor]) -> None:
    if len(buckets) != len(manifest.buckets):
        raise WeightSyncError(f"payload: {len(buckets)} buckets, manifest lists {len(manifest.buckets)}")
    for i, (bucket, meta) in enumerate(zip(buckets, manifest.buckets)):
        if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() != meta.nbytes:
            raise WeightSyncError(f"payload: bucket {i} is {bucket.dtype} {tuple(bucket.shape)}, "
                                  f"expected uint8 [{meta.nbytes}]")
        if not matches(bucket, meta.checksum):
            raise WeightSyncError(f"payload: bucket {i} checksum mismatch (corrupted transfer)")


def decode_entry(entry: TensorEntry, bucket: torch.Tensor) -> StagedTensor:
    """Decode and verify one segment (bucket checksums already verified)."""
    dtype = DTYPES[entry.dtype]
    segment = bucket[entry.offset:entry.offset + entry.nbytes]
    if entry.encoding == "full":
        data = segment.view(dtype).view(entry.shape)
        if not matches(data, entry.checksum):
            raise WeightSyncError(f"tensor {entry.name!r}: checksum mismatch")
        check_finite(entry.name, data)
        return StagedTensor(entry, data=data)
    raw = segment if entry.compression == "none" else _inflate(entry.name, segment, entry.raw_nbytes)
    index_dtype = INDEX_DTYPES[entry.index_dtype]
    split = entry.count * index_dtype.itemsize
    indices = _from_planes(raw[:split], index_dtype).to(torch.int64).cumsum(0)  # [C]
    if entry.count and (indices[0] < 0 or indices[-1] >= entry.numel or bool((indices.diff() <= 0).any())):
        raise WeightSyncError(f"tensor {entry.name!r}: delta indices are not strictly increasing "
                              f"within [0, {entry.numel})")
    return StagedTensor(entry, indices=indices, xors=_from_planes(raw[split:], INT_VIEWS[dtype.itemsize]))


def apply_xors(base_bits: torch.Tensor, st: StagedTensor) -> torch.Tensor:
    """New bits at the delta's indices: [C] integer view."""
    return base_bits[st.indices.to(base_bits.device)] ^ st.xors.to(base_bits.device)


def _to_planes(t: torch.Tensor) -> torch.Tensor:
    """[C] of itemsize s -> [s*C] uint8: byte 0 of every element, then byte 1, ..."""
    return t.view(torch.uint8).view(-1, t.element_size()).t().reshape(-1)


def _from_planes(planes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return planes.view(dtype.itemsize, planes.numel() // dtype.itemsize).t().reshape(-1).view(dtype)


def _inflate(name: str, segment: torch.Tensor, raw_nbytes: int) -> torch.Tensor:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(segment.cpu().numpy().tobytes(), raw_nbytes)
    except zlib.error as e:
        raise WeightSyncError(f"tensor {name!r}: corrupt zlib stream ({e})") from None
    if len(out) != raw_nbytes or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise WeightSyncError(f"tensor {name!r}: zlib stream does not inflate to exactly {raw_nbytes} bytes")
    return torch.frombuffer(bytearray(out), dtype=torch.uint8).to(segment.device)


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or Inf: its min and max in one reduction (NaN propagates to both),
    no tensor of its size made (isfinite(t).all() allocates one: 9x slower on a CPU for an LM head)."""
    if not t.is_floating_point() or not t.numel():
        return True
    t = t.detach()
    in_memory_order = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))  # a transposed weight's
    lo, hi = torch.aminmax(in_memory_order if in_memory_order.is_contiguous() else t)  # strided reduction: 15x
    return bool(torch.isfinite(lo) & torch.isfinite(hi))  # one host read on an accelerator


def check_finite(name: str, t: torch.Tensor) -> None:
    if not all_finite(t):
        raise WeightSyncError(f"tensor {name!r}: contains NaN or Inf")
