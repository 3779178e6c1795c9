"""How the target side talks to the draft side: one interface, in process or across a process boundary.

`send` delivers a message that gets no answer (admit, release, build); `request` delivers one that does
(verdicts -> chain reply) and returns the answer. A transport failure of any kind (a dead worker, a
timeout, a malformed reply) surfaces as `WorkerFailure`, which SSDDecode turns into a fallback.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from rollout_ssd.ssd.draft_server import DraftServer
from rollout_ssd.ssd.messages import Message


class WorkerFailure(RuntimeError):
    """The draft side died, timed out or answered nonsense."""


class DraftClient(ABC):
    in_process: bool = True

    @abstractmethod
    def send(self, msg: Message) -> None:
        ...

    @abstractmethod
    def request(self, msg: Message) -> Message:
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
