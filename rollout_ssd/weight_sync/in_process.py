"""In-process transport: the learner and the engine share a process (e.g. colocated, or tests).

Zero-copy: the sender's freshly packed buckets are handed over as they are. This is safe because
nobody writes to a bucket after packing: the sender only keeps read-only views of it (its pending
copy), and the receiver only reads from it when applying. Thread-safe (queues), so the learner and
the engine may live on different threads.
"""

from __future__ import annotations

import queue
import time

from .errors import TransportTimeout
from .transport import Ack, Packet, Transport


class InProcessTransport(Transport):
    def __init__(self, num_receivers: int = 1):
        if num_receivers < 1:
            raise ValueError(f"num_receivers must be >= 1, got {num_receivers}")
        self.num_receivers = num_receivers
        self._packets: list[queue.Queue[Packet]] = [queue.Queue() for _ in range(num_receivers)]
        self._acks: queue.Queue[Ack] = queue.Queue()

    def receiver(self, index: int) -> _ReceiverEnd:
        """The end the `index`-th receiver reads from (a transport with one receiver is its own end)."""
        return _ReceiverEnd(self, index)

    def send(self, packet: Packet) -> int:
        for q in self._packets:
            q.put(packet)
        return packet.nbytes

    def receive(self, timeout: float | None = None) -> Packet:
        return self._receive(0, timeout)

    def _receive(self, index: int, timeout: float | None) -> Packet:
        try:
            return self._packets[index].get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no weights arrived within {timeout} s") from None

    def send_ack(self, ack: Ack) -> None:
        self._acks.put(ack)

    def receive_acks(self, version: int, timeout: float | None = None) -> list[Ack]:
        deadline = None if timeout is None else time.monotonic() + timeout
        acks: list[Ack] = []
        while len(acks) < self.num_receivers:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                ack = self._acks.get(timeout=left)
            except queue.Empty:
                raise TransportTimeout(f"{len(acks)}/{self.num_receivers} acks for version {version} "
                                       f"within {timeout} s") from None
            if ack.version == version:
                acks.append(ack)
        return acks


class _ReceiverEnd(Transport):
    """Receiver-side view of an InProcessTransport with several receivers."""

    def __init__(self, parent: InProcessTransport, index: int):
        self._parent, self._index = parent, index
        self.num_receivers = parent.num_receivers

    def send(self, packet: Packet) -> int:
        raise TypeError("a receiver end cannot send weights")

    def receive(self, timeout: float | None = None) -> Packet:
        return self._parent._receive(self._index, timeout)

    def send_ack(self, ack: Ack) -> None:
        self._parent.send_ack(ack)

    def receive_acks(self, version: int, timeout: float | None = None) -> list[Ack]:
        raise TypeError("a receiver end receives no acks")
