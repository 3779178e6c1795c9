"""rollout_ssd: a rollout engine for RL that runs speculative speculative decoding, losslessly."""

from rollout_ssd.config import EngineConfig, SpecConfig
from rollout_ssd.engine import RolloutEngine
from rollout_ssd.params import Rollout, SamplingParams

__all__ = ["RolloutEngine", "SamplingParams", "SpecConfig", "EngineConfig", "Rollout"]
__version__ = "0.1.0"
