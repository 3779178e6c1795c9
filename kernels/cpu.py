"""What the CPU found offers the kernels: its feature flags, its model name and its kind.

The kernels' builds read the flags (which vector extensions to compile for); the CPU backend
(rollout_ssd/models/cpu_backend.py) reads the kind to choose a GEMM form, a dtype and a kernel per row
count. Each is read once per process.
"""

from __future__ import annotations

import functools

import torch


def _cpuinfo(field: str) -> str:
    """The first /proc/cpuinfo line's value for `field` ("" where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpuinfo("flags").split())


@functools.cache
def cpu_model() -> str:
    return _cpuinfo("model name")  # "" where /proc/cpuinfo has none


@functools.cache
def cpu_kind() -> str:
    """"amx" | "avx512_bf16" | "avx512" | "avx2" | "default": the best matmul ISA this CPU has, from
    /proc/cpuinfo's flags (bf16 units) and torch's own vector-capability probe (the rest)."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    capability = torch.backends.cpu.get_cpu_capability().lower()
    if capability.startswith("avx512"):
        return "avx512"
    return "avx2" if capability == "avx2" else "default"


BF16_UNITS = ("amx", "avx512_bf16")  # CPU kinds with bf16 dot-product instructions
