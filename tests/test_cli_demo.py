"""The demo's table (`make run`): what ran where, and each method's numbers and strategy, side by side."""

from __future__ import annotations

import torch

from rollout_ssd import metric_names as names
from rollout_ssd.cli import _table
from rollout_ssd.models.cpu_backend import cpu_kind


def _metrics(tokens, seconds, per_round, accept=None, hit=None, rounds=None):
    m = {names.ROLLOUT_TOKENS: tokens, names.ROLLOUT_SECONDS: seconds, names.ROLLOUT_TOKENS_PER_S: tokens / seconds,
         names.ROLLOUT_TOKENS_PER_ROUND: per_round}
    if accept is not None:
        m[names.SPEC_ACCEPT_RATE] = accept
    if hit is not None:
        m[names.SSD_HIT_RATE], m[names.SSD_STRATEGY_ROUNDS] = hit, rounds
    return m


def test_table_says_where_it_ran_and_what_each_method_chose(capsys):
    rows = [("ar", _metrics(100, 2.0, 1.0)), ("sd", _metrics(110, 1.0, 1.8, accept=0.5)),
            ("ssd", _metrics(105, 1.5, 1.2, accept=0.45, hit=0.25, rounds={"ssd+neural": 3, "ar": 20}))]
    _table(rows, torch.bfloat16, torch.device("cpu"))  # a CPU run says the CPU's kind, GPU or not
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"CPU {cpu_kind()}, bfloat16, {torch.get_num_threads()} threads"
    assert lines[1].split()[:4] == ["method", "tokens", "seconds", "tokens/s"] and lines[1].endswith("rounds by strategy")
    ar, sd, ssd = (line.split() for line in lines[2:])
    assert ar[:4] == ["ar", "100", "2.0", "50.0"] and ar[4] == "-" and ar[-2:] == ["(every", "round)"]
    assert sd[:6] == ["sd", "110", "1.0", "110.0", "0.50", "1.80"]
    assert ssd[4:] == ["0.45", "1.20", "0.25", "ssd+neural", "3,", "ar", "20"]


def test_the_demo_says_what_the_ssd_engines_rule_started_from():
    """The line under the table: restored times and the cache file, or that the rule measured anew (and
    where it keeps what it measured); nothing for an engine without a rule cache (AR, SD, cache off)."""
    from types import SimpleNamespace

    from rollout_ssd.cli import _rule_cache_note

    cache = SimpleNamespace(path="/c/rule-x.json")
    warm = SimpleNamespace(rule_cache=cache, restored_times=13)
    cold = SimpleNamespace(rule_cache=cache, restored_times=0)
    assert _rule_cache_note("ssd", warm) == ("ssd: the strategy rule started from 13 times measured on this machine "
                                             "by earlier runs (/c/rule-x.json)")
    assert _rule_cache_note("ssd", cold) == ("ssd: the strategy rule measured each plan anew (kept for the next "
                                             "run: /c/rule-x.json)")
    assert _rule_cache_note("ssd", SimpleNamespace(rule_cache=None, restored_times=0)) is None
    assert _rule_cache_note("ar", object()) is None


def test_the_demo_says_whether_ssd_can_win_on_this_machine():
    """The cap line under the table (`ssd/cap`, `ssd/v`, `ssd/cap_batch`): the cap, at what batch size, v and
    why it is below 1 beside a worker; 'may beat' above 1; no v where it was not timed; nothing without a cap."""
    from rollout_ssd.cli import _cap_note

    def m(cap, v, batch):
        return {names.ssd_state("cap"): cap, names.ssd_state("v"): v, names.ssd_state("cap_batch"): batch}

    assert _cap_note("ssd", m(0.694, 0.56, 2)) == (
        "ssd: Corollary 9's cap on SSD over the best plan measured at 2 sequences (the last batch size decided "
        "at): 0.69, v = 0.56: SSD verifies on the target's own core, beside the draft worker (SSD cannot beat it "
        "there)")
    assert _cap_note("ssd", m(1.35, 1.0, 1)) == (
        "ssd: Corollary 9's cap on SSD over the best plan measured at 1 sequence (the last batch size decided "
        "at): 1.35, v = 1.00 (SSD may beat it there)")
    assert "v =" not in _cap_note("ssd", m(1.35, float("nan"), 4))
    assert _cap_note("sd", {}) is None and _cap_note("ssd", m(float("nan"), float("nan"), 4)) is None
