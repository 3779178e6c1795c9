"""The manifest of one transfer: which tensor lives where in which bucket, encoded how.

It travels as UTF-8 JSON bytes in a uint8 tensor, never pickled. Parsing is strict: every object must
have exactly its known keys with the right JSON types, integers must be in range, names unique, segments
inside their bucket and aligned. Anything else is a `WeightSyncError` naming the field.

Layout (one transfer):
    {"format": "rollout_ssd.weight_sync", "format_version": 1, "version": 7, "base_version": 6 | null,
     "buckets": [{"nbytes": int, "checksum": hex16}, ...],
     "tensors": [{"name", "shape", "dtype", "encoding": "full" | "delta", "bucket", "offset", "nbytes",
                  "checksum",                        # of the resulting tensor
                  # delta only:
                  "count", "index_dtype", "compression": "none" | "zlib", "base_checksum"}, ...]}
A full segment holds the tensor's bytes; a delta segment holds `count` index gaps (index_dtype) then
`count` XORs of new and base element bits, both byte-planar, optionally zlib-compressed as one stream
(see codec.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import torch

from .errors import WeightSyncError

FORMAT = "rollout_ssd.weight_sync"
FORMAT_VERSION = 1
ALIGN = 64  # every segment starts at a multiple of this many bytes in its bucket
MAX_MANIFEST_BYTES = 256 << 20
MAX_NDIM = 8

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
ENCODINGS = ("full", "delta")
COMPRESSIONS = ("none", "zlib")

_TOP_KEYS = {"format", "format_version", "version", "base_version", "buckets", "tensors"}
_BUCKET_KEYS = {"nbytes", "checksum"}
_FULL_KEYS = {"name", "shape", "dtype", "encoding", "bucket", "offset", "nbytes", "checksum"}
_DELTA_KEYS = _FULL_KEYS | {"count", "index_dtype", "compression", "base_checksum"}


@dataclass(frozen=True)
class BucketEntry:
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: str  # "full" | "delta"
    bucket: int
    offset: int
    nbytes: int  # bytes of the segment as sent (compressed if compression == "zlib")
    checksum: str  # of the resulting tensor's bytes
    count: int = 0  # delta: number of changed elements
    index_dtype: str = "int32"
    compression: str = "none"
    base_checksum: str = ""  # delta: checksum the receiver's current tensor must have

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the (decompressed) segment."""
        if self.encoding == "full":
            return self.numel * self.torch_dtype.itemsize
        return self.count * (INDEX_DTYPES[self.index_dtype].itemsize + self.torch_dtype.itemsize)

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
               "encoding": self.encoding, "bucket": self.bucket, "offset": self.offset,
               "nbytes": self.nbytes, "checksum": self.checksum}
        if self.encoding == "delta":
            out.update(count=self.count, index_dtype=self.index_dtype, compression=self.compression,
                       base_checksum=self.base_checksum)
        return out


@dataclass(frozen=True)
class Manifest:
    version: int
    base_version: int | None
    buckets: tuple[BucketEntry, ...]
    tensors: tuple[TensorEntry, ...]

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "version": self.version,
               "base_version": self.base_version,
               "buckets": [{"nbytes": b.nbytes, "checksum": b.checksum} for b in self.buckets],
               "tensors": [t.to_json() for t in self.tensors]}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")

    def to_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.to_bytes()), dtype=torch.uint8)  # [M]

    @classmethod
    def from_tensor(cls, data: torch.Tensor) -> Manifest:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise WeightSyncError(f"manifest: expected a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
        return cls.from_bytes(data.cpu().numpy().tobytes())

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise WeightSyncError(f"manifest: {len(raw)} bytes exceeds the limit {MAX_MANIFEST_BYTES}")
        try:
            doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise WeightSyncError(f"manifest: not valid JSON ({e})") from None
        return _parse(doc)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise WeightSyncError(f"manifest: duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> None:
    raise WeightSyncError(f"manifest: non-finite JSON constant {name}")


def _obj(value: object, keys: set[str], where: str) -> dict:
    if not isinstance(value, dict):
        raise WeightSyncError(f"manifest: {where} must be an object")
    if set(value) != keys:
        missing, unknown = sorted(keys - set(value)), sorted(set(value) - keys)
        raise WeightSyncError(f"manifest: {where} has missing keys {missing} / unknown keys {unknown}")
    return value


def _int(value: object, where: str, lo: int = 0, hi: int = 2**62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise WeightSyncError(f"manifest: {where} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _choice(value: object, choices, where: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise WeightSyncError(f"manifest: {where} must be one of {sorted(choices)}, got {value!r}")
    return value


def _checksum(value: object, where: str) -> str:
    digits = value[1:] if isinstance(value, str) and value.startswith("s") else value  # "sum64": "s" + 16
    if not isinstance(digits, str) or len(digits) != 16 or any(c not in "0123456789abcdef" for c in digits):
        raise WeightSyncError(f"manifest: {where} must be 16 lowercase hex digits (\"s\" first for sum64), "
                              f"got {value!r}")
    return value


def _parse(doc: object) -> Manifest:
    doc = _obj(doc, _TOP_KEYS, "top level")
    if doc["format"] != FORMAT or doc["format_version"] != FORMAT_VERSION:
        raise WeightSyncError(f"manifest: unsupported format {doc['format']!r} v{doc['format_version']!r}")
    version = _int(doc["version"], "version")
    base = doc["base_version"]
    base_version = None if base is None else _int(base, "base_version")
    if not isinstance(doc["buckets"], list) or not isinstance(doc["tensors"], list):
        raise WeightSyncError("manifest: buckets and tensors must be lists")
    buckets = []
    for i, raw in enumerate(doc["buckets"]):
        raw = _obj(raw, _BUCKET_KEYS, f"buckets[{i}]")
        buckets.append(BucketEntry(_int(raw["nbytes"], f"buckets[{i}].nbytes"),
                                   _checksum(raw["checksum"], f"buckets[{i}].checksum")))
    buckets = tuple(buckets)
    tensors, names = [], set()
    for i, raw in enumerate(doc["tensors"]):
        entry = _parse_tensor(raw, i, buckets)
        if entry.name in names:
            raise WeightSyncError(f"manifest: tensor {entry.name!r} appears twice")
        names.add(entry.name)
        if entry.encoding == "delta" and base_version is None:
            raise WeightSyncError(f"manifest: delta for {entry.name!r} but base_version is null")
        tensors.append(entry)
    if base_version is not None and base_version >= version:
        raise WeightSyncError(f"manifest: base_version {base_version} must be below version {version}")
    return Manifest(version, base_version, buckets, tuple(tensors))


def _parse_tensor(raw: object, i: int, buckets: tuple[BucketEntry, ...]) -> TensorEntry:
    where = f"tensors[{i}]"
    encoding = _choice(raw.get("encoding") if isinstance(raw, dict) else None, ENCODINGS, f"{where}.encoding")
    raw = _obj(raw, _FULL_KEYS if encoding == "full" else _DELTA_KEYS, where)
    name = raw["name"]
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise WeightSyncError(f"manifest: {where}.name must be a non-empty string")
    where = f"tensor {name!r}"
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise WeightSyncError(f"manifest: {where}.shape must be a list of at most {MAX_NDIM} sizes")
    shape = tuple(_int(d, f"{where}.shape") for d in shape)
    entry = TensorEntry(
        name=name, shape=shape, dtype=_choice(raw["dtype"], DTYPES, f"{where}.dtype"), encoding=encoding,
        bucket=_int(raw["bucket"], f"{where}.bucket", 0, max(len(buckets) - 1, 0)),
        offset=_int(raw["offset"], f"{where}.offset"), nbytes=_int(raw["nbytes"], f"{where}.nbytes"),
        checksum=_checksum(raw["checksum"], f"{where}.checksum"))
    if encoding == "delta":
        entry = replace(
            entry, count=_int(raw["count"], f"{where}.count", 0, entry.numel),
            index_dtype=_choice(raw["index_dtype"], INDEX_DTYPES, f"{where}.index_dtype"),
            compression=_choice(raw["compression"], COMPRESSIONS, f"{where}.compression"),
            base_checksum=_checksum(raw["base_checksum"], f"{where}.base_checksum"))
        if entry.index_dtype == "int32" and entry.numel > 2**31 - 1:
            raise WeightSyncError(f"manifest: {where}.index_dtype int32 cannot index {entry.numel} elements")
    if not buckets:
        raise WeightSyncError(f"manifest: {where} refers to bucket {entry.bucket} but there are no buckets")
    if entry.offset % ALIGN or entry.offset + entry.nbytes > buckets[entry.bucket].nbytes:
        raise WeightSyncError(f"manifest: {where} segment [{entry.offset}, +{entry.nbytes}) is misaligned "
                              f"or outside bucket {entry.bucket} ({buckets[entry.bucket].nbytes} bytes)")
    if entry.compression == "none" and entry.nbytes != entry.raw_nbytes:
        raise WeightSyncError(f"manifest: {where}.nbytes is {entry.nbytes}, expected {entry.raw_nbytes}")
    return entry
