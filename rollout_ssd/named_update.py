"""A weight update handed over in process as (HF name, tensor) pairs: checked in full on arrival,
applied between rounds by an `updates.UpdateQueue`. One class serves target updates (`update_weights`) and
draft updates (`update_draft_weights`); `what` names the caller in every error message."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout_ssd.weight_sync.codec import all_finite


class NamedUpdate:
    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, what: str):
        self.what = what
        self.state: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            if name in self.state:
                raise ValueError(f"{what}: tensor {name!r} given twice")
            self.state[name] = tensor
        self.version = version

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.state)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def validate(self, params: dict[str, torch.Tensor], newest_version: int, shared: set[str] = frozenset(),
                 shared_reason: str = "") -> None:
        """Everything is checked before anything is queued; a ValueError names the offending field."""
        what = self.what
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version <= newest_version:
            raise ValueError(f"{what}: version must be an integer > {newest_version} (the newest version), "
                             f"got {self.version!r}")
        for name, tensor in self.state.items():
            if name in shared:
                raise ValueError(f"{what}: tensor {name!r} {shared_reason}")
            if name not in params:
                raise ValueError(f"{what}: unknown tensor {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{what}: {name!r} is not a tensor")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{what}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            if tensor.is_floating_point() != params[name].is_floating_point():
                raise ValueError(f"{what}: tensor {name!r} has dtype {tensor.dtype}, expected {params[name].dtype}")
            if not all_finite(tensor):
                raise ValueError(f"{what}: tensor {name!r} has NaN or Inf values")

    def apply_to(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in self.state.items():
                params[name].copy_(tensor)
