"""How the target side talks to the draft side: one interface, in process or across a process boundary.

`send` delivers a message that gets no answer (admit, release, build); `request` delivers one that does
(verdicts -> chain reply) and returns the answer. A transport failure of any kind (a dead worker, a
timeout, a malformed reply) surfaces as `WorkerFailure`, which the draft side (ssd/draft_side.py) turns into a
fallback.
`update_weights` brings the draft side's weights in line with the target side's copy of the draft
(between rounds); `digest` reports a digest of the weights the draft side holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from rollout_ssd.ssd.draft_server import DraftServer
from rollout_ssd.ssd.messages import DraftDigest, DraftWeightsReply, Message


class WorkerFailure(RuntimeError):
    """The draft side died, timed out or answered nonsense."""


class DraftClient(ABC):
    in_process: bool = True
    cores = None  # a TargetCores where the draft side holds CPU cores of its own (the worker process)

    @abstractmethod
    def send(self, msg: Message) -> None:
        ...

    @abstractmethod
    def request(self, msg: Message) -> Message:
        ...

    @abstractmethod
    def update_weights(self, new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], draft_version: int) -> None:
        """The target side's copy of the draft now holds `new` (name -> tensor) where it held `old`
        (name -> previous tensor, for an exact delta; may be empty): make the draft side hold it too."""

    @abstractmethod
    def digest(self) -> DraftWeightsReply:
        ...

    def close(self) -> None:
        pass


class LocalDraftClient(DraftClient):
    """The draft side in this process: messages are method calls, construction runs synchronously."""

    def __init__(self, server: DraftServer):
        self.server = server

    def send(self, msg: Message) -> None:
        self.server.handle(msg)

    def request(self, msg: Message) -> Message:
        reply = self.server.handle(msg)
        if reply is None:
            raise WorkerFailure(f"{type(msg).__name__} got no reply")
        return reply

    def update_weights(self, new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], draft_version: int) -> None:
        """In process the server's model IS the target side's copy, already written: drop what it built."""
        params = self.server.model.hf_parameters()
        if any(params.get(n) is None or params[n].data_ptr() != t.data_ptr() for n, t in new.items()):
            raise RuntimeError("LocalDraftClient.update_weights: the tensors are not this server's weights")
        self.server.on_weights_changed(draft_version)

    def digest(self) -> DraftWeightsReply:
        return self.request(DraftDigest())
