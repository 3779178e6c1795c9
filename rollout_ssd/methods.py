"""Decoding methods and speculators by name: `SpecConfig.method` and `SpecConfig.speculator` map to a
builder each, so the engine builds its decode strategy with one lookup instead of a ladder of ifs.

The names themselves are `rollout_ssd.config.METHODS` / `SPECULATORS` (the one source of names,
checked by `SpecConfig`); a name listed there with no builder here is "not available in this build".
A builder receives a `BuildContext` (what the engine has made so far) and returns the strategy or
speculator; strategy modules are imported inside the builders, so an AR engine never imports SD's or
SSD's code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from rollout_ssd.config import SpecConfig
from rollout_ssd.metrics import EngineMetrics
from rollout_ssd.models.loader import LoadedModel
from rollout_ssd.runner import ModelRunner


@dataclass(frozen=True)
class BuildContext:
    """What a builder may use: the target's runner, the engine's counters, the speculation config,
    the draft (if any), the target's vocabulary size and the context length."""

    runner: ModelRunner
    stats: EngineMetrics
    spec: SpecConfig
    draft: Optional[LoadedModel]
    vocab_size: int
    max_model_len: int

    def checked_draft(self, needed_by: str) -> LoadedModel:
        """The draft, checked to share the target's vocabulary; needed_by names the setting in the error."""
        if self.draft is None:
            raise ValueError(f"{needed_by} needs a draft model (draft=...)")
        if self.draft.model.cfg.vocab_size != self.vocab_size:
            raise ValueError(f"draft vocab_size {self.draft.model.cfg.vocab_size} differs from the target's "
                             f"{self.vocab_size}: they must share a tokenizer")
        return self.draft


# ---------------------------------------------------------------------------------------------- methods
def _ar(ctx: BuildContext):
    from rollout_ssd.decode import ARDecode

    return ARDecode(ctx.runner, ctx.stats)


def _sd(ctx: BuildContext):
    from rollout_ssd.spec.sd import SDDecode

    return SDDecode(ctx.runner, make_speculator(ctx), ctx.spec.k, ctx.stats)


def _ssd(ctx: BuildContext):
    from rollout_ssd.ssd.round import SSDDecode

    draft = ctx.checked_draft("SpecConfig.method='ssd'")
    ssd = ctx.spec.ssd_config()
    backup = None
    if ssd.backup != "neural":
        backup_spec = dataclasses.replace(ctx.spec, method="sd", speculator=ssd.backup)
        backup = make_speculator(dataclasses.replace(ctx, spec=backup_spec))
    return SSDDecode(ctx.runner, draft.model, ssd, ctx.stats, backup=backup, max_model_len=ctx.max_model_len)


METHOD_BUILDERS: dict[str, Callable[[BuildContext], object]] = {"ar": _ar, "sd": _sd, "ssd": _ssd}


# ---------------------------------------------------------------------------------------------- speculators
def _draft_model(ctx: BuildContext):
    from rollout_ssd.spec.draft_model import DraftModelSpeculator

    draft = ctx.checked_draft("SpecConfig.speculator='draft'")
    static = ctx.runner.static  # the target's steps compiled (EngineConfig.compile): the draft's too
    compiled = static.compiled if static is not None and static.pad_t is not None else None
    return DraftModelSpeculator(draft.model, ctx.runner.cache.num_slots, ctx.max_model_len,
                                stop_prob=float(ctx.spec.stop_prob), compiled_k=ctx.spec.k if compiled else None,
                                compile_mode=compiled or "frozen")


def _suffix(ctx: BuildContext):
    from rollout_ssd.spec.suffix import SuffixSpeculator

    return SuffixSpeculator()


def _random(ctx: BuildContext):
    from rollout_ssd.spec.random_spec import RandomConfig, RandomSpeculator

    return RandomSpeculator(RandomConfig(vocab_size=ctx.vocab_size))


SPECULATOR_BUILDERS: dict[str, Callable[[BuildContext], object]] = {
    "draft": _draft_model, "suffix": _suffix, "random": _random}


def make_strategy(ctx: BuildContext):
    """The decode strategy `ctx.spec.method` names."""
    builder = METHOD_BUILDERS.get(ctx.spec.method)
    if builder is None:
        raise ValueError(f"SpecConfig.method {ctx.spec.method!r} is not available in this build")
    return builder(ctx)


def make_speculator(ctx: BuildContext):
    """The SD speculator `ctx.spec.speculator` names."""
    builder = SPECULATOR_BUILDERS.get(ctx.spec.speculator)
    if builder is None:
        raise ValueError(f"SpecConfig.speculator {ctx.spec.speculator!r} is not available in this build")
    return builder(ctx)
