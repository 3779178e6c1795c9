"""Draft randomness for SSD: one uniform per (sequence, absolute token index), counter-based.

The draft side samples thousands of branch tokens per round, and which branches exist depends on the
fan-out plan (a batch-wide estimate). A stream consumed in order would make a branch's draws depend on
how many other branches were drawn before it, i.e. on the batch. Instead the uniform for the draft token
at absolute index i of a sequence is a pure function of (sequence key, i): SplitMix64's finaliser applied
twice to key + (i + 1)·γ, vectorised over int64 tensors (wrapping arithmetic, logical shifts emulated).

Why reusing index i across branches and rounds is exact: the committed history after any round depends
only on draft uniforms at indices below the committed length (a judged draft token sits at an index
the round commits: accepted, or replaced by the bonus token) and on the verifier's own generator. The
next chain is drawn at indices >= the committed length, whose uniforms are therefore independent of
everything committed. Only one branch per round is ever used, so branches sharing an index do not
interact. A side effect we like: a cache hit and an on-demand draft-model chain for the same verdict draw the
same uniforms, so (up to float rounding in the logits) they propose the same chain.
The key is derived from (seed, prompt index, sample index) and a stream name that verification's
generator (stream 0) and other speculators never use.
"""

from __future__ import annotations

import hashlib

import torch

from rollout_ssd.weight_sync.mix64 import GAMMA, M64, mix64, signed64, srl


def draft_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """A signed 64-bit key that depends only on (seed, prompt index, sample index)."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}:ssd-draft".encode(), digest_size=8).digest()
    return signed64(int.from_bytes(digest, "little"))


def draft_uniforms(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """U[0, 1) per row for the draft token at absolute index `index` of the sequence with key `keys`.

    keys, index: [N] int64. Returns float64 [N] (53 random bits)."""
    z = mix64(mix64(keys.long() + (index.long() + 1) * GAMMA))
    return srl(z, 11).double() * 2.0**-53


def draft_uniform_reference(key: int, index: int) -> float:
    """Pure-Python reference of `draft_uniforms` (for tests)."""

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    z = mix(mix((key + (index + 1) * 0x9E3779B97F4A7C15) & M64))
    return (z >> 11) * 2.0**-53
