"""Adapters that plug a `RolloutEngine` into other RL frameworks.

`rollout_ssd.integrations.trl.make_rollout_func` turns an engine into the `rollout_func` of TRL's
`GRPOTrainer`. Each adapter imports its framework only when it is used, so this package stays
importable without any of them.
"""

__all__ = ["make_rollout_func"]


def __getattr__(name):
    if name == "make_rollout_func":
        from rollout_ssd.integrations.trl import make_rollout_func

        return make_rollout_func
    raise AttributeError(f"module 'rollout_ssd.integrations' has no attribute {name!r}")
