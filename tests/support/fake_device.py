"""A stand-in accelerator for CPU tests: tensors that compute on the CPU but say they live on `meta`.

The engine is moved to `meta` inside `fake_device()`, where every op runs on the CPU data behind the
tags, so results are real (greedy tokens can be compared with a CPU engine's), while any op that mixes
a tagged tensor with a host tensor (0-dim CPU scalars excepted, as CUDA allows) raises, as it would on
a GPU (or would be a hidden host-to-device copy that a CUDA graph cannot capture). Explicit moves
(`.to(device)`, `copy_`) are allowed; reads back to the host (`.tolist()`, `.item()`, `bool()`, a copy to
the CPU) are counted as host syncs.

Plain `meta` tensors cannot do this: they hold no data, so nothing that reads a value (sampling,
verification) can run on them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
_CPU = torch.device("cpu")
_MOVES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.Tensor.numpy}


class Tagged(torch.Tensor):
    """A CPU tensor (`inner`) that reports `device=meta`."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   device=DEVICE, requires_grad=False)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a tagged tensor outside fake_device()")

    def __repr__(self):
        return f"Tagged({self.inner!r})"


def _is_dev(x) -> bool:
    return isinstance(x, torch.device) and x.type == DEVICE.type


class _Ops(TorchDispatchMode):
    def __init__(self, state: "FakeDevice"):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tagged = any(isinstance(t, Tagged) for t in flat)
        to_dev = any(_is_dev(x) for x in flat)
        to_host = tagged and any(isinstance(x, torch.device) and x.type == "cpu" for x in flat)
        moves = func in _MOVES or func.overloadpacket is torch.ops.aten.to
        if tagged and not moves:
            plain = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, Tagged)
                     and not (t.dim() == 0 and t.device.type == "cpu")]
            if plain:
                raise RuntimeError(f"{func} mixes device tensors with host tensors of shapes "
                                   f"{[tuple(t.shape) for t in plain]}")
        self.state.ops += 1
        unwrap = lambda x: x.inner if isinstance(x, Tagged) else (_CPU if _is_dev(x) else x)  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if moves and to_host:
            self.state.sync()
            return out
        if not (tagged or to_dev):
            return out
        schema = func._schema.arguments
        if schema and schema[0].alias_info is not None and schema[0].alias_info.is_write:
            return args[0]  # in place: the same wrapper
        with torch.inference_mode(False):  # a view's wrapper takes its base's version counter
            return tree_map(lambda t: Tagged(t) if isinstance(t, torch.Tensor) and not isinstance(t, Tagged) else t,
                            out)


class _Factories(TorchFunctionMode):
    """torch.tensor / as_tensor build their data without a dispatch; host reads are counted here."""

    def __init__(self, state: "FakeDevice"):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _HOST_READS and args and isinstance(args[0], Tagged):
            self.state.sync()
            return func(args[0].inner, *args[1:], **kwargs)
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]) == DEVICE:
            kwargs["device"] = "cpu"
            data = func(*args, **kwargs)
            with torch.inference_mode(False):
                return Tagged(data)
        return func(*args, **kwargs)


class FakeDevice:
    """Counts: `ops` dispatched, `syncs` (host reads of device tensors)."""

    def __init__(self):
        self.ops = 0
        self.syncs = 0
        self.where: list = []  # with `record_syncs`: the rollout_ssd line of each sync

    record_syncs = False

    def sync(self) -> None:
        self.syncs += 1
        if self.record_syncs:
            import traceback

            frames = [f for f in traceback.extract_stack() if "rollout_ssd/" in f.filename]
            self.where.append(f"{frames[-1].filename.split('rollout_ssd/')[-1]}:{frames[-1].lineno}" if frames else "?")


@contextlib.contextmanager
def fake_device():
    """Inside: `x.to("meta")` (a model, a tensor) gives tagged tensors that compute on the CPU."""
    state = FakeDevice()
    with _Factories(state), _Ops(state):
        yield state
