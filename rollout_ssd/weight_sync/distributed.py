"""Transport over a torch.distributed process group (gloo on CPU, NCCL on GPU).

The sender (global rank `src`) broadcasts to every other rank of the group, in order:

    header   [8] int64   MAGIC, PROTOCOL, KIND_WEIGHTS, version, num_buckets, manifest_nbytes, total, 0
    sizes    [num_buckets] int64      (skipped when there are no buckets)
    manifest [manifest_nbytes] uint8  (UTF-8 JSON; see manifest.py)
    bucket_i [sizes[i]] uint8         (empty buckets are skipped)
    trailer  [4] int64   MAGIC_END, version, num_buckets, total

Receivers allocate from the header and sizes (both bounded before allocating), and hand a packet up only
after the trailer matched: a sender that dies mid-stream makes gloo raise (connection reset) or the
bounded wait time out, the partial packet is dropped and the receiver keeps its old weights. Every
stream-level failure marks this transport broken: the group's state is unknown, so the caller must
destroy it and build a new group and transport. Acks go back point to point ([4] int64:
MAGIC_ACK, version, accepted, receiver_version), sent with isend so a receiver never blocks on them.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import TransportError, TransportTimeout
from .manifest import MAX_MANIFEST_BYTES
from .transport import Ack, Packet, Transport

MAGIC, MAGIC_END, MAGIC_ACK = 0x5753594E43, 0x57534E44, 0x5753414B
PROTOCOL = 1
KIND_WEIGHTS = 1
ACK_TAG = 7301
MAX_BUCKETS = 1 << 20


class DistributedTransport(Transport):
    """One sender rank `src` and every other rank of `group` as receivers.

    `timeout` (seconds) bounds each operation inside a stream and each ack wait; `receive(timeout)`
    bounds only the wait for a header (None: the process group's own timeout).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, src: int = 0, *, timeout: float = 60.0,
                 device: torch.device | str | None = None, max_bytes: int = 1 << 40):
        if not dist.is_initialized():
            raise ValueError("DistributedTransport: torch.distributed is not initialized")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if src not in ranks:
            raise ValueError(f"src rank {src} is not in the group's ranks {ranks}")
        self.group, self.src, self.timeout, self.max_bytes = group, src, timeout, max_bytes
        self.rank = dist.get_rank()
        self.receiver_ranks = [r for r in ranks if r != src]
        self.num_receivers = len(self.receiver_ranks)
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self._broken: str | None = None
        self._ack_sends: list[tuple[object, torch.Tensor]] = []

    @property
    def is_sender(self) -> bool:
        return self.rank == self.src

    # -- sender side -------------------------------------------------------------------------------
    def send(self, packet: Packet) -> int:
        self._check_usable(sender=True)
        buckets = [b.to(self.device) for b in packet.buckets]
        sizes = [b.numel() for b in buckets]
        total = sum(sizes)
        header = self._ints(MAGIC, PROTOCOL, KIND_WEIGHTS, packet.version, len(buckets),
                            packet.manifest.numel(), total, 0)
        sent = self._bcast(header, self.timeout)
        if buckets:
            sent += self._bcast(self._ints(*sizes), self.timeout)
        sent += self._bcast(packet.manifest.to(self.device), self.timeout)
        for bucket in buckets:
            sent += self._bcast(bucket, self.timeout) if bucket.numel() else 0
        sent += self._bcast(self._ints(MAGIC_END, packet.version, len(buckets), total), self.timeout)
        return sent

    def receive_acks(self, version: int, timeout: float | None = None) -> list[Ack]:
        self._check_usable(sender=True)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        acks = []
        for rank in self.receiver_ranks:
            while True:
                buf = self._ints(0, 0, 0, 0)
                self._wait(lambda: dist.irecv(buf, src=rank, group=self.group, tag=ACK_TAG),  # noqa: B023
                           max(deadline - time.monotonic(), 1e-3), f"ack from rank {rank}")
                magic, ack_version, accepted, receiver_version = buf.tolist()
                if magic != MAGIC_ACK or ack_version > version:
                    self._broken = f"malformed ack {buf.tolist()} from rank {rank}"
                    raise TransportError(f"DistributedTransport: {self._broken}")
                if ack_version == version:
                    acks.append(Ack(version, bool(accepted), receiver_version))
                    break
        return acks

    # -- receiver side -----------------------------------------------------------------------------
    def receive(self, timeout: float | None = None) -> Packet:
        self._check_usable(sender=False)
        header = self._ints(*[0] * 8)
        self._bcast(header, timeout)
        magic, protocol, kind, version, num_buckets, manifest_nbytes, total, _ = header.tolist()
        if (magic, protocol, kind) != (MAGIC, PROTOCOL, KIND_WEIGHTS) or not (
                0 <= num_buckets <= MAX_BUCKETS and 0 <= manifest_nbytes <= MAX_MANIFEST_BYTES
                and 0 <= total <= self.max_bytes):
            self._broken = f"malformed header {header.tolist()}"
            raise TransportError(f"DistributedTransport: {self._broken}")
        sizes: list[int] = []
        if num_buckets:
            sizes_t = self._ints(*[0] * num_buckets)
            self._bcast(sizes_t, self.timeout)
            sizes = sizes_t.tolist()
            if min(sizes) < 0 or sum(sizes) != total:
                self._broken = f"bucket sizes do not add up to {total}"
                raise TransportError(f"DistributedTransport: {self._broken}")
        manifest = torch.empty(manifest_nbytes, dtype=torch.uint8, device=self.device)
        self._bcast(manifest, self.timeout)
        buckets = []
        for size in sizes:
            bucket = torch.empty(size, dtype=torch.uint8, device=self.device)
            if size:
                self._bcast(bucket, self.timeout)
            buckets.append(bucket)
        trailer = self._ints(0, 0, 0, 0)
        self._bcast(trailer, self.timeout)
        if trailer.tolist() != [MAGIC_END, version, num_buckets, total]:
            self._broken = f"trailer {trailer.tolist()} does not close version {version}"
            raise TransportError(f"DistributedTransport: {self._broken}")
        return Packet(version=version, manifest=manifest.cpu(), buckets=tuple(buckets))

    def send_ack(self, ack: Ack) -> None:
        self._check_usable(sender=False)
        self._ack_sends = [(w, t) for w, t in self._ack_sends if not w.is_completed()]
        buf = self._ints(MAGIC_ACK, ack.version, int(ack.accepted), ack.receiver_version)
        try:
            self._ack_sends.append((dist.isend(buf, dst=self.src, group=self.group, tag=ACK_TAG), buf))
        except RuntimeError as e:
            self._broken = str(e)
            raise TransportError(f"DistributedTransport: ack failed: {e}") from e

    def close(self) -> None:
        self._ack_sends.clear()

    # -- helpers -----------------------------------------------------------------------------------
    def _ints(self, *values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _check_usable(self, sender: bool) -> None:
        if self._broken is not None:
            raise TransportError(f"DistributedTransport is broken ({self._broken}); "
                                 "destroy the process group and build a new transport")
        if sender != self.is_sender:
            role = "the sender (rank src)" if sender else "a receiver"
            raise TypeError(f"rank {self.rank} is not {role}")

    def _bcast(self, t: torch.Tensor, timeout: float | None) -> int:
        self._wait(lambda: dist.broadcast(t, src=self.src, group=self.group, async_op=True), timeout, "broadcast")
        return t.numel() * t.element_size()

    def _wait(self, start, timeout: float | None, what: str) -> None:
        try:
            work = start()
            if timeout is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            self._broken = f"{what} failed: {e}".splitlines()[0]
            error = TransportTimeout if "timed out" in str(e).lower() else TransportError
            raise error(f"DistributedTransport: {self._broken}") from e
