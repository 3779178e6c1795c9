"""The learner's side: cast, encode (full or exact delta), pack, send, and commit on acknowledgement.

Commit protocol. The sender keeps the last COMMITTED copy of every tensor in the rollout dtype: what
every receiver is known to hold. `send` encodes deltas against it and remembers the new tensors as
PENDING. Only `wait_ack` (all receivers applied) or an explicit `commit()` promotes pending to
committed. If every receiver rejected the transfer and still holds the committed version, `abort()`
keeps deltas valid; if the receivers' state is unknown or diverged (timeout, some applied and some did
not), the committed copy is dropped so the next transfer is full. Versions only ever increase.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from .codec import CHECKSUM_KINDS, check_finite, checksum, checksum_kind, encode_tensor, pack
from .errors import TransportError, WeightSyncError
from .manifest import DTYPE_NAMES, DTYPES
from .transport import Packet, Transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderConfig:
    """dtype: rollout dtype floating tensors are cast to. bucket_bytes: target bucket size (a larger
    tensor gets a bucket of its own). delta: allow exact deltas. compression: "zlib" | "none" for delta
    segments (kept only when it shrinks them). max_delta_share: above this share of changed elements a
    tensor is sent full. check_finite: refuse to send NaN/Inf. checksum: "crc" (zlib's, on the host),
    "sum64" (computed where the tensors are: no copy to the host; codec.py) or "auto" (sum64 when the
    weights are on a GPU, else crc). Receivers check with the kind each checksum names."""

    dtype: torch.dtype | str = torch.bfloat16
    bucket_bytes: int = 256 << 20
    delta: bool = True
    compression: str = "zlib"
    compression_level: int = 1
    max_delta_share: float = 0.5
    check_finite: bool = True
    checksum: str = "auto"

    def __post_init__(self):
        dtype = DTYPES.get(self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"SenderConfig.dtype must be a floating dtype, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.bucket_bytes < 1:
            raise ValueError(f"SenderConfig.bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.checksum not in ("auto", *CHECKSUM_KINDS):
            raise ValueError(f"SenderConfig.checksum must be 'auto' or one of {CHECKSUM_KINDS}, got {self.checksum!r}")
        if self.compression not in ("zlib", "none"):
            raise ValueError(f"SenderConfig.compression must be 'zlib' or 'none', got {self.compression!r}")
        if not 0 <= self.compression_level <= 9:
            raise ValueError(f"SenderConfig.compression_level must be in [0, 9], got {self.compression_level}")
        if not 0.0 <= self.max_delta_share <= 1.0:
            raise ValueError(f"SenderConfig.max_delta_share must be in [0, 1], got {self.max_delta_share}")


@dataclass(frozen=True)
class TransferStats:
    version: int
    base_version: int | None  # the committed version deltas were computed against (None: all full)
    kind: str  # "full" | "delta" | "mixed"
    num_tensors: int
    num_full: int
    num_delta: int
    num_elements: int
    changed_elements: int  # bits differ from the committed copy (all elements of a tensor without one)
    bytes_sent: int  # on the wire, headers included
    full_bytes: int  # tensor bytes of a full transfer of the same tensors
    encode_seconds: float
    send_seconds: float
    acknowledged: bool | None = None  # set by `sync`

    @property
    def seconds(self) -> float:
        return self.encode_seconds + self.send_seconds

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / max(self.num_elements, 1)

    def as_metrics(self) -> dict[str, float]:
        return {"sync/version": self.version, "sync/bytes": self.bytes_sent, "sync/seconds": self.seconds,
                "sync/full_bytes": self.full_bytes, "sync/changed_fraction": self.changed_fraction,
                "sync/delta_tensors": self.num_delta, "sync/full_tensors": self.num_full}


class WeightSender:
    def __init__(self, transport: Transport, config: SenderConfig | None = None):
        self.transport = transport
        self.config = config or SenderConfig()
        self._committed: dict[str, tuple[torch.Tensor, str]] = {}  # name -> (tensor, checksum)
        self._committed_version: int | None = None
        self._pending: dict[str, tuple[torch.Tensor, str]] | None = None
        self._pending_version: int | None = None
        self._last_version: int | None = None

    @property
    def committed_version(self) -> int | None:
        return self._committed_version

    @property
    def pending_version(self) -> int | None:
        return self._pending_version if self._pending is not None else None

    def _kind(self, device: torch.device) -> str:
        if self.config.checksum != "auto":
            return self.config.checksum
        return "crc" if device.type == "cpu" else "sum64"

    def seed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Declare that every receiver already holds these tensors at `version` (e.g. all loaded the
        same checkpoint), so the first transfer can be a delta. Nothing is sent."""
        self._check_new_version(version)
        self._committed = {name: (t, checksum(t, self._kind(t.device))) for name, t in self._cast_all(named_tensors)}
        self._committed_version = self._last_version = version

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
             force_full: bool = False) -> TransferStats:
        """Encode and send one transfer; the new tensors stay pending until `wait_ack` or `commit`."""
        self._check_new_version(version)
        start = time.perf_counter()
        cfg, encoded, pending = self.config, [], {}
        device = getattr(self.transport, "device", None)  # where buckets are built: the wire's device,
        for name, new in self._cast_all(named_tensors):
            device = device or new.device  # else the weights' own
            base = None if force_full or not cfg.delta else self._committed.get(name)
            if base is not None and base[0].device != new.device:
                base = (base[0].to(new.device), base[1])
            kind = self._kind(new.device)
            if base is not None and checksum_kind(base[1]) != kind:
                base = (base[0], checksum(base[0], kind))  # the base's checksum in this transfer's kind
            enc = encode_tensor(name, new, base[0] if base else None, base[1] if base else "",
                                max_delta_share=cfg.max_delta_share, compression=cfg.compression,
                                level=cfg.compression_level, kind=kind)
            encoded.append(enc)
            pending[name] = (new, enc.entry.checksum)
        num_delta = sum(e.entry.encoding == "delta" for e in encoded)
        base_version = self._committed_version if num_delta else None
        device = torch.device(device or "cpu")
        manifest, buckets = pack(encoded, version, base_version, cfg.bucket_bytes, device,
                                 kind=self._kind(device))
        packet = Packet(version=version, manifest=manifest.to_tensor(), buckets=tuple(buckets))
        encoded_at = time.perf_counter()
        self._last_version = version
        sent = self.transport.send(packet)  # raises TransportError: nothing becomes pending
        self._pending, self._pending_version = pending, version
        num_full = len(encoded) - num_delta
        stats = TransferStats(
            version=version, base_version=base_version,
            kind="full" if not num_delta else "delta" if not num_full else "mixed",
            num_tensors=len(encoded), num_full=num_full, num_delta=num_delta,
            num_elements=sum(e.entry.numel for e in encoded), changed_elements=sum(e.changed for e in encoded),
            bytes_sent=sent, full_bytes=sum(e.entry.numel * e.entry.torch_dtype.itemsize for e in encoded),
            encode_seconds=encoded_at - start, send_seconds=time.perf_counter() - encoded_at)
        logger.debug("weight_sync: sent %s", stats)
        return stats

    def wait_ack(self, timeout: float | None = None) -> bool:
        """Wait for every receiver's answer to the pending transfer; commit if all applied it."""
        if self._pending is None:
            raise WeightSyncError("wait_ack: no transfer is pending")
        try:
            acks = self.transport.receive_acks(self._pending_version, timeout)
        except TransportError as e:
            logger.warning("weight_sync: no acks for version %s (%s); next transfer is full",
                           self._pending_version, e)
            self.reset()
            return False
        if all(a.accepted for a in acks):
            self.commit()
            return True
        if all(not a.accepted and a.receiver_version == self._committed_version for a in acks):
            self.abort()
        else:
            logger.warning("weight_sync: receivers diverged (%s); next transfer is full", acks)
            self.reset()
        return False

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
             timeout: float | None = None, force_full: bool = False) -> TransferStats:
        """`send` then `wait_ack`; the stats say whether the transfer was acknowledged."""
        stats = self.send(named_tensors, version, force_full=force_full)
        return replace(stats, acknowledged=self.wait_ack(timeout))

    def commit(self) -> None:
        """The receivers hold the pending version: it becomes the base of the next delta."""
        if self._pending is None:
            raise WeightSyncError("commit: no transfer is pending")
        self._committed.update(self._pending)
        self._committed_version = self._pending_version
        self._pending = None

    def abort(self) -> None:
        """The receivers still hold the committed version: forget the pending transfer."""
        self._pending = None

    def reset(self) -> None:
        """The receivers' state is unknown: forget everything; the next transfer is full."""
        self._committed, self._committed_version, self._pending = {}, None, None

    def _check_new_version(self, version: int) -> None:
        if type(version) is not int or version < 0:
            raise WeightSyncError(f"version must be a non-negative int, got {version!r}")
        if self._pending is not None:
            raise WeightSyncError(f"version {self._pending_version} is still pending: call wait_ack(), "
                                  "commit() or abort() first")
        if self._last_version is not None and version <= self._last_version:
            raise WeightSyncError(f"version {version} is not newer than the last one sent ({self._last_version})")

    def _cast_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        seen = set()
        for name, tensor in named_tensors:
            if not isinstance(name, str) or not name:
                raise WeightSyncError(f"tensor names must be non-empty strings, got {name!r}")
            if name in seen:
                raise WeightSyncError(f"tensor {name!r} given twice")
            seen.add(name)
            yield name, self._cast(name, tensor)

    def _cast(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An owned, contiguous copy in the rollout dtype (floating tensors) or the tensor's own dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        t = tensor.detach()
        if t.is_floating_point():
            t = t.to(self.config.dtype)
        elif t.dtype not in DTYPE_NAMES:
            raise WeightSyncError(f"tensor {name!r}: unsupported dtype {t.dtype}")
        t = t.contiguous()
        if t.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            t = t.clone()  # never keep an alias of the learner's live weights
        if self.config.check_finite:
            check_finite(name, t)
        return t
