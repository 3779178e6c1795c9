"""Shared helpers for the SSD tests: an engine running SSDDecode (tiny pairs: tests.support.models)."""

from __future__ import annotations

from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.decode import SSDDecode


def ssd_engine(target, draft, config: SSDConfig, batch: int = 3, max_model_len: int = 128, backup=None):
    """An engine whose decode strategy is SSDDecode (built the way engine._make_strategy should)."""
    engine = RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=batch,
                                                                        max_model_len=max_model_len))
    engine.strategy = SSDDecode(engine.runner, draft.model, config, engine.stats, backup=backup)
    return engine


def ar_engine(target, batch: int = 3, max_model_len: int = 128):
    return RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=batch,
                                                                      max_model_len=max_model_len))
