"""`assert_ran`: the one check that the decoding path a test is named after really ran.

Why: on a 2-core CPU the strategy rule rightly runs AR or SD rounds inside an SSD engine, and a draft worker
that fails falls back in process with only a warning. A test that compares an "SSD" engine with AR, or a
"worker" engine with an in-process one, can then pass while comparing AR with AR. Every test that builds an
SD or SSD engine calls this on the engine (or on the metrics it published) after the run;
tests/test_ran_checks.py fails a test file where one does not, unless the test says why.

What each plan means, read from `engine.metrics()` (docs/DESIGN.md's names):
- "spec": some verification round checked a non-empty proposal (`spec/proposed_per_round` > 0); any SD
  engine, any speculator.
- "sd": as "spec", and in an SSD engine its rule ran plain-SD rounds (`ssd/strategy_rounds["sd"]` > 0).
- "ssd": an SSD engine ran SSD rounds: sequence-rounds asked the speculation cache for a chain
  (`ssd/rounds` > 0; only SSD plans count there).
- a plan label of an SSD engine ("ssd+neural", "ssd+suffix", "ssd+random", "sd", "suffix", "ar"): its rule
  ran rounds of that plan.
Options: `hits` (some chains came from the cache), `misses` (some warm rounds missed it, so a backup or
the draft on demand proposed), `accepted` (the verifier accepted some draft token), `worker` (the draft side
is a worker process that served the whole run: it is out of process and no failure was counted).
"""

from __future__ import annotations

import ast
from typing import Optional

SSD_LABELS = ("ssd+neural", "ssd+suffix", "ssd+random")
PLAIN_LABELS = ("sd", "suffix", "ar")


def _metrics(source) -> dict:
    if isinstance(source, dict):
        return source
    return source.metrics()


def _strategy_rounds(m: dict) -> Optional[dict]:
    rounds = m.get("ssd/strategy_rounds")
    if rounds is None:
        return None
    if isinstance(rounds, str):  # the RL rollout workers send non-scalar metrics as their repr (rl/actors.py)
        rounds = ast.literal_eval(rounds)
    assert isinstance(rounds, dict), f"ssd/strategy_rounds is {type(rounds).__name__}, not a dict: {rounds!r}"
    return rounds


def _check_plan(m: dict, plan: str) -> None:
    rounds = _strategy_rounds(m)
    if plan in ("spec", "sd"):
        assert m.get("spec/proposed_per_round", 0) > 0, f"no round verified a proposal: {_summary(m)}"
        if plan == "sd" and rounds is not None:
            assert rounds.get("sd", 0) > 0, f"the SSD engine ran no plain-SD round: {_summary(m)}"
    elif plan == "ssd":
        assert m.get("ssd/rounds", 0) > 0, f"no SSD round ran: {_summary(m)}"
        if rounds is not None:
            assert sum(rounds.get(label, 0) for label in SSD_LABELS) > 0, f"no SSD plan ran: {_summary(m)}"
    elif plan in SSD_LABELS or plan in PLAIN_LABELS:
        assert rounds is not None, f"plan {plan!r} asked of an engine with no strategy rounds: {_summary(m)}"
        assert rounds.get(plan, 0) > 0, f"plan {plan!r} ran no round: {_summary(m)}"
    else:
        raise ValueError(f"assert_ran: unknown plan {plan!r}")


def _summary(m: dict) -> str:
    keys = ("ssd/strategy_rounds", "ssd/rounds", "ssd/hits", "ssd/cold_rounds", "ssd/worker_failures",
            "spec/proposed_per_round", "spec/accept_rate")
    return ", ".join(f"{k}={m[k]!r}" for k in keys if k in m) or "no speculation metrics at all"


def served(before: dict, after: dict) -> dict:
    """What a server ran between two reads of its `/metrics` (parsed to {sample name: value}), in
    engine.metrics()'s names, for `assert_ran`: vLLM's speculation counters give the proposals and
    acceptance (`spec/accept_rate` here is accepted / proposed: positive exactly when some draft token was
    accepted), `rollout_ssd:ssd_strategy_rounds` the plans. A module's server serves several tests, so a
    test reads the counters before its requests and checks the difference."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts, proposed = delta("vllm:spec_decode_num_drafts_total"), delta("vllm:spec_decode_num_draft_tokens_total")
    out = {"spec/proposed_per_round": proposed / drafts if drafts else 0.0,
           "spec/accept_rate": delta("vllm:spec_decode_num_accepted_tokens_total") / proposed if proposed else 0.0}
    prefix = 'rollout_ssd:ssd_strategy_rounds_total{"strategy": "'
    rounds = {k[len(prefix):-2]: delta(k) for k in after if k.startswith(prefix)}
    if rounds:
        out["ssd/strategy_rounds"] = {plan: n for plan, n in rounds.items() if n}
    return out


def assert_ran(source, plan: str, *, hits: Optional[bool] = None, misses: Optional[bool] = None,
               accepted: Optional[bool] = None, worker: Optional[bool] = None) -> dict:
    """Assert that `plan` ran on `source` (a RolloutEngine, or a dict of its metrics taken before any
    reset). Each option, when given, is asserted either way (`hits=False`: no chain came from the cache).
    Returns the metrics read."""
    m = _metrics(source)
    _check_plan(m, plan)
    if hits is not None:
        assert (m.get("ssd/hits", 0) > 0) == hits, f"hits={hits} asked: {_summary(m)}"
    if misses is not None:
        warm = m.get("ssd/rounds", 0) - m.get("ssd/cold_rounds", 0)
        assert (m.get("ssd/hits", 0) < warm) == misses, f"misses={misses} asked: {_summary(m)}"
    if accepted is not None:
        assert (m.get("spec/accept_rate", 0) > 0) == accepted, f"accepted={accepted} asked: {_summary(m)}"
    if worker is not None:
        assert not isinstance(source, dict), "worker= needs the engine, not its metrics"
        client = source.strategy.client
        out_of_process = client is not None and not client.in_process
        assert out_of_process == worker, f"worker={worker} asked; the draft side's client is {client!r}"
        if worker:
            assert m.get("ssd/worker_failures", 0) == 0, f"the worker failed during the run: {_summary(m)}"
    return m
