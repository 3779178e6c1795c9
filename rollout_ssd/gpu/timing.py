"""Wall time of device work, for the strategy rule's estimates.

`time.perf_counter` around a CUDA forward measures how long the launches took, not the work: the
kernels are still queued when the call returns, and their time lands in whatever is timed next. A
`DeviceTimer` on a CUDA device records CUDA events on the current stream and synchronises on the end
event when read; on a CPU it is `perf_counter`, with no synchronisation to pay for.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class DeviceTimer:
    """start(); ...work...; stop() -> seconds. Reusable; `seconds` is the last measured interval."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._t0: Optional[float] = None
        self._events = None
        self.seconds = 0.0

    def start(self) -> "DeviceTimer":
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(torch.cuda.current_stream(self.device))
            self._events = (begin, end)
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        if self.cuda:
            if self._events is None:
                raise RuntimeError("DeviceTimer.stop() before start()")
            begin, end = self._events
            end.record(torch.cuda.current_stream(self.device))
            end.synchronize()
            self.seconds = begin.elapsed_time(end) / 1000.0
            self._events = None
        else:
            if self._t0 is None:
                raise RuntimeError("DeviceTimer.stop() before start()")
            self.seconds = time.perf_counter() - self._t0
            self._t0 = None
        return self.seconds

    def __enter__(self) -> "DeviceTimer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
