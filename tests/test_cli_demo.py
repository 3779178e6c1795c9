"""The demo (`make run`, rollout_ssd/demo.py): its table says what ran where and times each engine's second
call apart from its first, and one sentence says what the SSD engine ran and why."""

from __future__ import annotations

import pytest
import torch

from rollout_ssd import metric_names as names
from rollout_ssd.demo import MethodRun, print_table, rule_cache_note, ssd_choice
from rollout_ssd.kernels.cpu import cpu_kind
from tests.support.models import build_tiny


def _metrics(tokens, seconds, per_round, accept=None, hit=None, rounds=None, **state):
    m = {names.ROLLOUT_TOKENS: tokens, names.ROLLOUT_SECONDS: seconds, names.ROLLOUT_TOKENS_PER_S: tokens / seconds,
         names.ROLLOUT_TOKENS_PER_ROUND: per_round}
    if accept is not None:
        m[names.SPEC_ACCEPT_RATE] = accept
    if hit is not None:
        m[names.SSD_HIT_RATE], m[names.SSD_STRATEGY_ROUNDS] = hit, rounds
    m.update({names.ssd_state(k): v for k, v in state.items()})
    return m


def test_table_says_where_it_ran_what_it_timed_and_what_each_method_chose(capsys):
    runs = [MethodRun("ar", _metrics(100, 3.0, 1.0), _metrics(100, 2.0, 1.0)),
            MethodRun("sd", _metrics(110, 1.5, 1.8), _metrics(110, 1.0, 1.8, accept=0.5)),
            MethodRun("ssd", _metrics(105, 4.0, 1.2), _metrics(105, 1.5, 1.2, accept=0.45, hit=0.25,
                                                                    rounds={"ssd+neural": 3, "ar": 20}))]
    print_table(runs, torch.bfloat16, torch.device("cpu"))  # a CPU run says the CPU's kind, GPU or not
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"CPU {cpu_kind()}, bfloat16, {torch.get_num_threads()} threads"
    assert "second call" in lines[1] and "first call" in lines[1]
    assert lines[2].split()[:4] == ["method", "tokens", "seconds", "tokens/s"] and lines[2].endswith("rounds by strategy")
    ar, sd, ssd = (line.split() for line in lines[3:])
    assert ar[:4] == ["ar", "100", "2.0", "50.0"] and ar[4] == "-" and ar[-4:] == ["3.0", "ar", "(every", "round)"]
    assert sd[:8] == ["sd", "110", "1.0", "110.0", "0.50", "1.80", "-", "1.5"]
    assert ssd[4:] == ["0.45", "1.20", "0.25", "4.0", "ssd+neural", "3,", "ar", "20"]


def test_the_ssd_choice_is_one_sentence_saying_what_ran_and_why():
    """Over both calls: SSD when it ran most rounds; else the plans it ran, and why: a CPU worker taking a
    core the verify needs (cap and v below 1), drafting too small a share (cap below 1), or the rule's
    measurements; nothing for AR and SD engines."""
    def ssd_run(rounds, **state):
        return MethodRun("ssd", _metrics(10, 1.0, 1.0, hit=0.0, rounds=rounds),
                         _metrics(10, 1.0, 1.0, hit=0.0, rounds=rounds, **state))

    two_core = ssd_choice(ssd_run({"ar": 2, "sd": 9}, cap=0.8, v=0.5, cap_batch=4), cores=2)
    assert two_core == ("Over both calls the SSD engine ran SD (18 rounds) and AR (4 rounds): on this machine's 2 "
                        "CPU cores SSD's draft would take a core the target needs (the target's verify ran 2.0x "
                        "slower without it), so SSD could reach at most 0.80x the speed of the best other plan; "
                        "on a machine with a device for the draft (a second GPU) it runs SSD.")
    small = ssd_choice(ssd_run({"sd": 9, "ssd+neural": 1}, cap=0.9, v=1.0), cores=16)
    assert small.startswith("Over both calls the SSD engine ran SD (18 rounds), SSD in 2 while measuring it: "
                            "drafting is too small")
    assert ssd_choice(ssd_run({"ssd+neural": 9, "sd": 1}, cap=1.4, v=1.0), cores=16) == (
        "Over both calls the SSD engine ran SSD in 18 of its 20 rounds: its strategy rule measured SSD as the fastest "
        "plan on this machine.")
    assert ssd_choice(ssd_run({"ar": 5}), cores=2).endswith("its strategy rule measured those faster than SSD on "
                                                              "this machine.")
    assert ssd_choice(MethodRun("sd", _metrics(1, 1.0, 1.0), _metrics(1, 1.0, 1.0)), cores=2) is None
    assert all(s.count(". ") == 0 and s.endswith(".") for s in (two_core, small))  # one sentence each


def test_the_demo_says_what_the_ssd_engines_rule_started_from():
    """The line under the table: restored times and the cache file, or that the rule measured anew (and
    where it keeps what it measured); nothing for an engine without a rule cache (AR, SD, cache off)."""
    from types import SimpleNamespace

    cache = SimpleNamespace(path="/c/rule-x.json")
    warm = SimpleNamespace(rule_cache=cache, restored_times=13)
    cold = SimpleNamespace(rule_cache=cache, restored_times=0)
    assert rule_cache_note("ssd", warm) == ("ssd: the strategy rule started from 13 times measured on this machine "
                                            "by earlier runs (/c/rule-x.json)")
    assert rule_cache_note("ssd", cold) == ("ssd: the strategy rule measured each plan anew (kept for the next "
                                            "run: /c/rule-x.json)")
    assert rule_cache_note("ssd", SimpleNamespace(rule_cache=None, restored_times=0)) is None
    assert rule_cache_note("ar", object()) is None


@pytest.mark.slow
def test_the_demo_end_to_end_on_a_tiny_pair(tmp_path, capsys):
    """`rollout-ssd demo` as `make run` runs it, on a tiny target with a word tokenizer and a draft of its own:
    a row per method, each engine's second call timed with its first call's seconds beside it, the same
    tokens from every method (greedy, and every method is exact), and the SSD engine's sentence."""
    from rollout_ssd.cli import main

    build_tiny(tmp_path / "target", tokenizer="words", vocab_size=96, max_position_embeddings=512, logit_scale=4.0)
    build_tiny(tmp_path / "draft", seed=1, vocab_size=96, max_position_embeddings=512, logit_scale=4.0)
    assert main(["demo", "--model", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                 "--dtype", "float32", "--max-new-tokens", "24"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("method "))
    assert lines[head - 2] == f"CPU {cpu_kind()}, float32, {torch.get_num_threads()} threads"
    rows = {line.split()[0]: line.split() for line in lines[head + 1: head + 4]}
    assert list(rows) == ["ar", "sd", "ssd"]
    assert len({row[1] for row in rows.values()}) == 1 and int(rows["ar"][1]) == 4 * 24  # no EOS in this vocab
    for row in rows.values():  # seconds (one decimal: a tiny model's call may show 0.0), tokens/s, first call's
        assert float(row[2]) >= 0 and float(row[3]) > 0 and float(row[7]) >= 0
    assert rows["ar"][-2:] == ["(every", "round)"] and rows["sd"][-2:] == ["(every", "round)"]
    choice = [line for line in lines[head + 4:] if line.startswith("Over both calls the SSD engine ran ")]
    assert len(choice) == 1 and choice[0].endswith(".")
