"""The rollout side: receive, verify everything, stage, and apply between rounds.

`receive()` returns a `StagedUpdate` only after the whole transfer checked out: manifest well formed,
version newer than the one held (and, for deltas, based on exactly the held version), names, shapes and
dtypes known, bucket and tensor checksums right, no NaN/Inf in full tensors. `apply_to(params)` then
checks the parameters themselves (names, shapes, dtypes; for deltas that the current bits are the
delta's base, and that the new values it produces are finite) before it touches any of them, copies in
place, advances the version and acknowledges. Any rejection
raises `WeightSyncError`, acknowledges the refusal, and leaves the receiver and the parameters as they
were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .codec import (
    StagedTensor,
    apply_xors,
    bits,
    check_finite,
    decode_entry,
    matches,
    verify_buckets,
)
from .errors import TransportError, WeightSyncError
from .manifest import Manifest, TensorEntry
from .transport import Ack, Packet, Transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverConfig:
    """verify_base: before applying a delta, check the parameter's checksum equals the delta's base
    (costs one pass over those parameters; catches weights changed behind the sender's back)."""

    verify_base: bool = True


@dataclass(frozen=True)
class ReceiveStats:
    version: int
    bytes_received: int
    receive_seconds: float  # waiting for and reading the stream
    verify_seconds: float  # parsing, checksums, decoding
    num_full: int
    num_delta: int
    changed_elements: int  # elements a delta rewrites plus all elements of full tensors


class WeightReceiver:
    """`version`: what the receiver holds at start (the sender's first version must be newer).
    `reference`: optional name -> tensor of the receiving model, to reject unknown names, shapes and
    dtypes already at `receive()` (only shapes and dtypes are kept)."""

    def __init__(self, transport: Transport, *, version: int = 0,
                 reference: Mapping[str, torch.Tensor] | None = None, config: ReceiverConfig | None = None):
        self.transport = transport
        self.config = config or ReceiverConfig()
        self._version = version
        self._spec = None if reference is None else {n: (tuple(t.shape), t.dtype) for n, t in reference.items()}

    @property
    def version(self) -> int:
        return self._version

    def replace_transport(self, transport: Transport) -> None:
        """Continue on a new transport (e.g. a fresh process group after the sender died)."""
        self.transport = transport

    def receive(self, timeout: float | None = None) -> StagedUpdate:
        """Block for the next transfer and verify it; raises WeightSyncError (rejected, refusal acked)
        or TransportError (stream failed, nothing staged)."""
        start = time.perf_counter()
        packet = self.transport.receive(timeout)
        received_at = time.perf_counter()
        try:
            manifest, staged = self._verify(packet)
        except WeightSyncError:
            self.ack(packet.version, accepted=False)
            raise
        stats = ReceiveStats(
            version=manifest.version, bytes_received=packet.nbytes, receive_seconds=received_at - start,
            verify_seconds=time.perf_counter() - received_at,
            num_full=sum(s.entry.encoding == "full" for s in staged),
            num_delta=sum(s.entry.encoding == "delta" for s in staged),
            changed_elements=sum(s.entry.count if s.entry.encoding == "delta" else s.entry.numel for s in staged))
        return StagedUpdate(self, manifest, staged, stats)

    def ack(self, version: int, accepted: bool) -> None:
        try:
            self.transport.send_ack(Ack(version=version, accepted=accepted, receiver_version=self._version))
        except TransportError as e:
            logger.warning("weight_sync: could not ack version %s: %s", version, e)

    def check_version(self, manifest: Manifest) -> None:
        if manifest.version <= self._version:
            raise WeightSyncError(f"version {manifest.version} is not newer than the held version {self._version}")
        if any(t.encoding == "delta" for t in manifest.tensors) and manifest.base_version != self._version:
            raise WeightSyncError(f"base_version {manifest.base_version} of the delta is not the held "
                                  f"version {self._version}")

    def _verify(self, packet: Packet) -> tuple[Manifest, list[StagedTensor]]:
        manifest = Manifest.from_tensor(packet.manifest)
        if manifest.version != packet.version:
            raise WeightSyncError(f"version: header says {packet.version}, manifest says {manifest.version}")
        self.check_version(manifest)
        if self._spec is not None:
            for entry in manifest.tensors:
                _check_spec(entry, self._spec.get(entry.name))
        verify_buckets(manifest, list(packet.buckets))
        return manifest, [decode_entry(e, packet.buckets[e.bucket]) for e in manifest.tensors]


class StagedUpdate:
    """A verified transfer waiting to be applied between rounds (applied or discarded exactly once)."""

    def __init__(self, receiver: WeightReceiver, manifest: Manifest, tensors: list[StagedTensor],
                 stats: ReceiveStats):
        self._receiver, self._manifest, self._tensors = receiver, manifest, tensors
        self.stats = stats
        self._done = False

    @property
    def version(self) -> int:
        return self._manifest.version

    @property
    def base_version(self) -> int | None:
        return self._manifest.base_version

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.entry.name for t in self._tensors)

    def apply_to(self, named_params: Mapping[str, torch.Tensor]) -> None:
        """Copy the update into `named_params` in place. Everything is validated before the first
        tensor is touched; on WeightSyncError nothing changed."""
        if self._done:
            raise WeightSyncError(f"update {self.version} was already applied or discarded")
        self._done = True
        try:
            self._receiver.check_version(self._manifest)
            targets = [self._target(st, named_params) for st in self._tensors]
        except WeightSyncError:
            self._receiver.ack(self.version, accepted=False)
            raise
        with torch.no_grad():
            for st, (param, new_bits) in zip(self._tensors, targets):
                _apply_one(st, param, new_bits)
        self._receiver._version = self.version
        self._receiver.ack(self.version, accepted=True)

    def discard(self) -> None:
        """Drop the update without applying it (the sender is told it was refused)."""
        if not self._done:
            self._done = True
            self._receiver.ack(self.version, accepted=False)

    def _target(self, st: StagedTensor, named_params: Mapping[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The parameter to write, and for a delta the new bits at its indices ([C]), all checked."""
        name = st.entry.name
        param = named_params.get(name)
        if not isinstance(param, torch.Tensor):
            raise WeightSyncError(f"tensor {name!r}: unknown name (not among the parameters)")
        _check_spec(st.entry, (tuple(param.shape), param.dtype))
        if st.entry.encoding == "full":
            return param, None
        if self._receiver.config.verify_base and not matches(param, st.entry.base_checksum):
            raise WeightSyncError(f"tensor {name!r}: current weights are not the delta's base "
                                  f"(version {self.base_version}); a full transfer is needed")
        new_bits = apply_xors(bits(param.contiguous()), st)
        check_finite(name, new_bits.view(param.dtype))
        return param, new_bits


def _check_spec(entry: TensorEntry, spec: tuple[tuple[int, ...], torch.dtype] | None) -> None:
    if spec is None:
        raise WeightSyncError(f"tensor {entry.name!r}: unknown name")
    shape, dtype = spec
    if entry.shape != shape:
        raise WeightSyncError(f"tensor {entry.name!r}: shape {list(entry.shape)} does not match {list(shape)}")
    if entry.torch_dtype != dtype:
        raise WeightSyncError(f"tensor {entry.name!r}: dtype {entry.dtype} does not match {dtype}")


def _apply_one(st: StagedTensor, param: torch.Tensor, new_bits: torch.Tensor | None) -> None:
    if new_bits is None:
        param.copy_(st.data)  # same dtype: a bitwise copy
        return
    if not st.entry.count:
        return
    work = param if param.is_contiguous() else param.contiguous()
    bits(work).index_copy_(0, st.indices.to(work.device), new_bits)
    if work is not param:
        param.copy_(work)
