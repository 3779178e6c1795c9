"""ssd/cores.py: the target's CPU share beside the draft worker, per calling thread."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rollout_ssd.ssd.cores import split_for_worker

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs a process with two or more CPU cores")


@pytest.fixture(autouse=True)
def _threads_restored():
    """The tests set thread counts in threads of their own, yet not every library keeps its count per
    thread: without this thread's count set again afterwards, a later test's float32 GEMMs ran on another
    count and rounded differently (test_ssd_worker.py's bitwise logprobs of two engines failed after this
    file, and pass with it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _in_thread(fn):
    """Run fn in a fresh thread (affinity and OpenMP's thread count are per thread: the suite's own
    thread is left as it was) and return what it returned, re-raising what it raised."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed back to the test's thread
            out["error"] = err

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _state():
    return os.sched_getaffinity(0), torch.get_num_threads()


@needs_two
def test_narrow_and_widen_set_this_threads_cores_and_threads():
    def body():
        torch.set_num_threads(2)
        before = _state()
        split, worker_core = split_for_worker(True)
        assert worker_core == CORES[1] and _state() == before and split.is_wide  # made wide: rounds narrow it
        split.narrow()
        assert _state() == ({CORES[0]}, 1) and not split.is_wide
        split.widen()
        assert _state() == before and split.is_wide
        split.narrow()
        assert _state() == ({CORES[0]}, 1)
        # another thread (an engine driven from a different thread) gets its own setting, not a no-op
        other = _in_thread(lambda: (split.widen(), _state())[1])
        assert other == (set(CORES), 2) and _state() == ({CORES[0]}, 1)
        split.widen()
        return _state(), before

    after, before = _in_thread(body)
    assert after == before


def test_no_split_without_pinning_or_a_second_core(monkeypatch):
    assert split_for_worker(False) == (None, None)
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        assert split_for_worker(True) == (None, None)
