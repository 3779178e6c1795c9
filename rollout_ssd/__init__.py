"""rollout_ssd: a rollout engine for RL that runs speculative speculative decoding, losslessly.

Top-level names are imported lazily, so `import rollout_ssd.weight_sync` on a learner pulls in
torch and nothing of the engine.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["RolloutEngine", "SamplingParams", "SpecConfig", "EngineConfig", "Rollout"]
_WHERE = {
    "RolloutEngine": "rollout_ssd.engine",
    "SamplingParams": "rollout_ssd.params",
    "Rollout": "rollout_ssd.params",
    "SpecConfig": "rollout_ssd.config",
    "EngineConfig": "rollout_ssd.config",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'rollout_ssd' has no attribute {name!r}")
