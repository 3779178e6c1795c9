"""The transport interface: moves opaque packets (manifest bytes + uint8 buckets) and small acks.

A transport knows nothing of tensors' meaning: the codec builds and checks packets, the sender and the
receiver own versions and commit. Sender side: `send`, then `receive_acks`. Receiver side: `receive`,
then `send_ack` once the update was applied (or rejected). A transport that raised `TransportError`
may be unusable (distributed: the process group is broken) and must be replaced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packet:
    """One transfer on the wire."""

    version: int
    manifest: torch.Tensor  # [M] uint8: UTF-8 JSON (see manifest.py)
    buckets: tuple[torch.Tensor, ...]  # [N_i] uint8 each

    @property
    def nbytes(self) -> int:
        return self.manifest.numel() + sum(b.numel() for b in self.buckets)


@dataclass(frozen=True)
class Ack:
    """A receiver's answer to the transfer of `version`."""

    version: int  # the transfer answered
    accepted: bool  # True: applied; False: rejected or discarded
    receiver_version: int  # the version the receiver holds now


class Transport(ABC):
    """Moves packets from one sender to `num_receivers` receivers, and acks back."""

    num_receivers: int

    @abstractmethod
    def send(self, packet: Packet) -> int:
        """Deliver `packet` to every receiver; returns the bytes put on the wire."""

    @abstractmethod
    def receive(self, timeout: float | None = None) -> Packet:
        """Next complete packet; raises TransportTimeout / TransportError when none arrives whole."""

    @abstractmethod
    def send_ack(self, ack: Ack) -> None:
        """Receiver side: answer the sender (never blocks on the sender)."""

    @abstractmethod
    def receive_acks(self, version: int, timeout: float | None = None) -> list[Ack]:
        """Sender side: one ack per receiver for `version` (older acks are skipped); raises
        TransportTimeout if they do not all arrive within `timeout` seconds."""

    def close(self) -> None:
        """Release resources (the process group itself belongs to the caller)."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
