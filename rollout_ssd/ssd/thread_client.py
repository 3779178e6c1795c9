"""The draft side on a thread of its own: SSD's concurrent draft where a process cannot serve.

On a GPU machine the worker process is the wrong tool: its weights, chains and dense q travel through
`/dev/shm` (64 MB in a default container) and through host memory. Here the draft side is a
`DraftServer` in this process, driven by one thread that takes messages in order from a queue, on its own
CUDA stream when its model is on a GPU. `send` (admit, release, build) returns at once, so a cache build
runs while the caller verifies on its own stream; `request` (verdicts) waits for the answer. The
chains and their q stay on the draft's device; the verification moves them to the target's (a
device-to-device copy, or none when both share a GPU).

Weights: the server's model is either the target side's copy of the draft (same device: nothing to
copy) or its own copy on the draft device; `update_weights` first lets the thread finish what it was
given, then copies the new tensors device to device. Any exception on the thread, or an answer that
takes longer than `timeout`, surfaces as `WorkerFailure`, as a dead worker does.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Optional

import torch

from rollout_ssd.gpu.devices import CUDA_CAPTURE_LOCK
from rollout_ssd.ssd.client import DraftClient, WorkerFailure
from rollout_ssd.ssd.draft_server import DraftServer
from rollout_ssd.ssd.messages import Barrier, DraftDigest, DraftWeightsReply, Message

_STOP = object()


class ThreadDraftClient(DraftClient):
    in_process = True  # the caller's tensors are reachable: updates are copies, not transfers

    def __init__(self, server: DraftServer, timeout: float = 30.0):
        self.server = server
        self.timeout = timeout
        device = server.model.embed.device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._inbox: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="rollout-ssd-draft-side", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        streamed = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with streamed, torch.inference_mode():
            while True:
                msg, wants_reply = self._inbox.get()
                if msg is _STOP:
                    return
                reply = None
                if self._error is None:
                    try:
                        with CUDA_CAPTURE_LOCK:  # never while the target captures a CUDA graph
                            reply = self.server.handle(msg)
                            if wants_reply and self.stream is not None:  # what the reply holds is ready on
                                self.stream.synchronize()  # any stream (messages run in order on this one)
                    except BaseException as err:  # reported to the caller at its next call
                        self._error = err
                if wants_reply:
                    self._replies.put(reply)

    def _check(self) -> None:
        if self._error is not None:
            raise WorkerFailure(f"the draft thread failed: {type(self._error).__name__}: {self._error}")
        if not self._thread.is_alive():
            raise WorkerFailure("the draft thread is not running")

    def send(self, msg: Message) -> None:
        self._check()
        self._inbox.put((msg, False))

    def request(self, msg: Message) -> Message:
        self._check()
        self._inbox.put((msg, True))
        try:
            reply = self._replies.get(timeout=self.timeout)
        except queue.Empty:
            raise WorkerFailure(f"the draft thread gave no answer to {type(msg).__name__} in {self.timeout} s") from None
        self._check()
        if reply is None:
            raise WorkerFailure(f"{type(msg).__name__} got no reply")
        return reply

    def update_weights(self, new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], draft_version: int) -> None:
        self.request(Barrier())  # the thread has finished everything before this update
        params = self.server.model.hf_parameters()
        with torch.no_grad():
            for name, tensor in new.items():
                if name not in params:
                    raise RuntimeError(f"ThreadDraftClient.update_weights: the draft has no tensor {name!r}")
                if params[name].data_ptr() != tensor.data_ptr():  # the server's own copy
                    params[name].copy_(tensor)
        self.server.on_weights_changed(draft_version)

    def digest(self) -> DraftWeightsReply:
        return self.request(DraftDigest())

    def close(self) -> None:
        if self._thread.is_alive():
            self._inbox.put((_STOP, False))
            self._thread.join(timeout=self.timeout)
