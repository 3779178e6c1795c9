"""WeightCopies: a model's frozen weights kept in other memory layouts (cpu_backend.py's GEMM forms, the rows
kernels' packed layouts, int4), made on first use and kept current through every write to the weight."""

from __future__ import annotations

from typing import Optional

import torch


class WeightCopies:
    """Copies of frozen weights in another memory layout, by name: `get(name, w, make)` returns
    make(w), made on first use and remade whenever `w` is replaced, moved, or written in place (every
    in-place op on it or on a view of it, as loaders, update_weights and weight sync do, bumps the
    shared version counter; only writes through `.data` would not, and nothing here makes them). The
    entry holds `w` itself, so a replaced weight's storage cannot be reused at the same address while
    its copy is cached. Each copy costs its weight's size in memory. `in_place`: make takes out= (the
    old copy) and writes into it when only `w`'s values changed (an RL update every step), so the copy's
    memory is not allocated and faulted in again. Used for the LM head's column-major copy (logits of a
    few rows), the layers' row-major copies, the float32 rows kernel's (`linear`), the bf16 and int4 ones."""

    def __init__(self):
        self._copies: dict[str, tuple[torch.Tensor, torch.Tensor, tuple]] = {}
        self.live: dict[str, torch.Tensor] = {}  # packed copies a live compiled step reads (`pack_live`)
        self.int4_group: Optional[int] = None  # set by quant.quantize_int4: the linears run in int4

    def get(self, name: str, w: torch.Tensor, make, in_place: bool = False) -> torch.Tensor:
        hit, key = self._copies.get(name), (w.data_ptr(), w._version, w.shape)
        if hit is None or hit[1] is not w or hit[2] != key:
            refill = in_place and hit is not None and hit[1] is w and hit[2][::2] == key[::2]
            with torch.inference_mode(False), torch.no_grad():
                hit = (make(w, out=hit[0]) if refill else make(w), w, key)
            self._copies[name] = hit
        return hit[0]

    def __len__(self) -> int:
        return len(self._copies)


def linear_weights(model) -> list:
    """(weight, bias, its WeightCopies, name) for a Decoder's layers' four linears and its LM head."""
    out = [(getattr(layer, name), bias, layer.row_major, name) for layer in model.layers
           for name, bias in (("wqkv", layer.bqkv), ("wo", None), ("w_gate_up", None), ("w_down", None))]
    return out + [(model.lm_head, None, model.copies, "lm_head")]
