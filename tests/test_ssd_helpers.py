"""Shared helpers for the SSD tests: SSD and AR engines built through the public API (tiny pairs:
tests.support.models)."""

from __future__ import annotations

from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig


def ssd_engine(target, draft, batch: int = 3, max_model_len: int = 128, **spec):
    """RolloutEngine(target, SpecConfig(method="ssd", **spec), ...) with the draft in process and the
    strategy rule off unless `spec` says otherwise (what these tests were written against)."""
    spec = {"worker": False, "strategy_rule": False, **spec}
    return RolloutEngine(target, SpecConfig(method="ssd", **spec),
                         EngineConfig(max_batch_size=batch, max_model_len=max_model_len), draft=draft)


def ar_engine(target, batch: int = 3, max_model_len: int = 128):
    return RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=batch,
                                                                      max_model_len=max_model_len))
