"""Which devices the engine may use, and where SSD's draft side goes by default."""

from __future__ import annotations

import threading

import torch

# Held while a CUDA graph is captured (gpu/graphs.py `StaticStep.capture`), by SSD's draft thread
# around each message it handles (ssd/thread_client.py) and while an update is checked (updates.py).
# A capture in CUDA's default ("global") mode is invalidated by another thread's CUDA calls, and a
# random draw from another thread meanwhile leaves the default CUDA generator marked as capturing, so
# every later draw in the process fails ("Offset increment outside graph capture"): both seen on an
# H200 when the target captured its first verify step while the draft thread built a tree. A capture
# is rare (once per step shape), so waiting for the draft thread's current message costs nothing after
# the first rounds. Re-entrant: uncontended it costs next to nothing.
CUDA_CAPTURE_LOCK = threading.RLock()


def check_device(device: str, what: str = "device") -> torch.device:
    """The torch.device `device` names, if this machine has it (ValueError naming `what` otherwise)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} {device!r} is not a device name (cpu, cuda, cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"{what} {device!r} is not available on this machine")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{what} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def resolved(device: torch.device | str) -> torch.device:
    """`device` with its index filled in ("cuda" -> "cuda:N", the current device), so two names of one
    device compare equal."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def default_draft_device(target: torch.device) -> torch.device:
    """SSD's draft side: the next GPU after the target's when there is one (the paper's layout: the draft
    on hardware of its own), else the target's own device (a second stream on the same GPU)."""
    if target.type != "cuda":
        return target
    index = target.index if target.index is not None else torch.cuda.current_device()
    if index + 1 < torch.cuda.device_count():
        return torch.device("cuda", index + 1)
    return torch.device("cuda", index)
