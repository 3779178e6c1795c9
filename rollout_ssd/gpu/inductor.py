"""inductor's and dynamo's settings for the compiled CPU steps of gpu/graphs.py (`StaticStep.compile`):
the options each step compiles under, and the guards it evaluates on each call."""

from __future__ import annotations

import os

import torch


def autotune() -> bool:
    """Whether frozen one-token steps autotune their GEMMs: unless $ROLLOUT_SSD_AUTOTUNE is "0" (shorter
    compiles, ATen's GEMMs; the test suite's setting, tests/conftest.py)."""
    return os.environ.get("ROLLOUT_SSD_AUTOTUNE", "1") != "0"


def compile_options(t: int, mode: str = "frozen") -> dict:
    """inductor's options for a compiled CPU step of t tokens per row. Frozen: the weights constant-
    folded and packed once; for one token (decode) the GEMMs are also autotuned between ATen's (oneDNN)
    and inductor's C++ templates, which win there (`autotune`); a verify's few rows run faster on
    oneDNN's packed kernels than on the templates, autotuning or not (a probe of one compiled step, in
    git history: bench/probe_compiled_step.py).
    Live: no freezing (the weights stay inputs) and no autotuning (the templates need frozen weights);
    a producer of more than 4 ops (an RMS norm, an embedding lookup) is computed once into a buffer where
    inductor would otherwise inline it into the one-row linears' reduction loops, once per output row."""
    if mode == "live":
        return {"freezing": False, "max_autotune": False, "realize_opcount_threshold": 4}
    if t == 1 and autotune():
        return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    return {"freezing": True, "max_autotune": False}


def guard_filter(mode: str):
    """dynamo's `guard_filter_fn` for a compiled step of this mode (None: every guard). A frozen step
    evaluates, on each call, dynamo's guards on its inputs, their shapes and the global state (flags such
    as cpu_backend's live flag), not the hundreds on the step module's attributes (the weights', buffers'
    and kernel copies' identity, the layers' hooks and types), which it holds as constants: a parameter
    or buffer written or replaced, or a submodule replaced, is GraphedSteps' own check before each step
    (`weights_key`, which retires the frozen steps), and every step compiles its own code, so no step can
    take another's graph. A live step keeps every guard (its weights and copies are inputs: a replaced one
    must be read, and would be). None too where this torch has no such filter (it came after 2.5, the
    oldest torch the package allows)."""
    if mode != "frozen":
        return None
    return getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
