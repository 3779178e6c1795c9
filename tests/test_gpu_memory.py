"""The KV cache sized from a GPU's free memory (rollout_ssd/gpu/memory.py, issue 17 part B): the
arithmetic by hand, the CUDA reading with torch.cuda faked, and the engine path with the reading faked
for a CPU model (the branch a CUDA target takes), SD's and SSD's draft KV counted when it shares the
device, kv_cache_bytes taking precedence, and the error that names the knob."""

from __future__ import annotations

import pytest
import torch

from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig
from rollout_ssd.gpu import memory
from rollout_ssd.gpu.memory import FIXED_MARGIN_BYTES, kv_slots_that_fit, step_reserve_bytes
from rollout_ssd.kv_cache import KVCache
from rollout_ssd.models.config import ModelConfig
from tests.support.models import tiny_pair

GiB = 2**30


def test_slots_by_hand():
    # 12 GiB free of 16: 0.75 keeps 4 GiB back, the reserve 1 GiB, leaving 7 GiB = 6 slots + scratch
    assert kv_slots_that_fit(12 * GiB, 16 * GiB, GiB, GiB, 0.75, max_slots=32) == 6
    assert kv_slots_that_fit(12 * GiB, 16 * GiB, GiB, GiB, 0.75, max_slots=4) == 4
    assert kv_slots_that_fit(12 * GiB, 16 * GiB, GiB, GiB + 1, 0.75, max_slots=32) == 5  # one byte short
    assert kv_slots_that_fit(12 * GiB, 16 * GiB, GiB, 0, 1.0, max_slots=32) == 11  # nothing kept back


def test_no_room_for_one_sequence_names_the_knob():
    with pytest.raises(ValueError, match="EngineConfig.gpu_memory_utilization=0.5"):
        kv_slots_that_fit(9 * GiB, 16 * GiB, GiB, 0, 0.5, max_slots=32)  # 8 GiB kept back: 1 GiB = the scratch slot
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_slots_that_fit(GiB, 16 * GiB, GiB, 0, 1.0, max_slots=32)  # one slot's worth: the scratch slot only
    assert kv_slots_that_fit(2 * GiB, 16 * GiB, GiB, 0, 1.0, max_slots=32) == 1


def test_step_reserve_by_hand():
    cfg = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False, max_position_embeddings=128, bos_token_id=None,
                      eos_token_ids=())
    qkv = (4 + 2 * 2) * 16
    # bf16: logits 8 rows x 16 tokens x 1000 x (2 + 4); prefill 4096 tokens x (4 x 64 + qkv + 3 x 128) x 2;
    # scores 4096 tokens x 4 heads x 128 keys x 4 x 2
    assert step_reserve_bytes(cfg, torch.bfloat16, rows=8, step_tokens=16, prefill_tokens=4096, max_len=128) == \
        8 * 16 * 1000 * 6 + 4096 * (256 + qkv + 384) * 2 + 4096 * 4 * 128 * 8


def test_device_memory_reads_cuda_and_counts_the_allocators_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * GiB, 16 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * GiB)
    assert memory.device_memory(torch.device("cuda", 0)) == (6 * GiB, 16 * GiB)
    assert memory.device_memory(torch.device("cpu")) is None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("pair"), vocab=48)


def _per_token(model) -> int:
    cfg = model.cfg
    return KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)


def _reserve(*models, rows: int, lens=(64, 64)) -> int:
    return FIXED_MARGIN_BYTES + sum(step_reserve_bytes(m.cfg, m.dtype, rows, 16, 4096, n) for m, n in zip(models, lens))


def _engine(monkeypatch, pair, free: int, spec=SpecConfig(), **options):
    """An engine whose target device reads as a GPU with `free` bytes free of 64 GiB (utilization 1)."""
    monkeypatch.setattr(memory, "device_memory", lambda device: (free, 64 * GiB))
    target, draft = pair
    config = EngineConfig(max_batch_size=8, max_model_len=64, gpu_memory_utilization=1.0, **options)
    engine = RolloutEngine(target, spec, config, draft=None if spec.method == "ar" else draft)
    engine.close()
    return engine.runner.cache.num_slots


def test_engine_sizes_the_target_kv_from_free_memory(monkeypatch, pair):
    target, _ = pair
    per_slot, reserve = _per_token(target.model) * 64, _reserve(target.model, rows=8)
    assert _engine(monkeypatch, pair, reserve + 4 * per_slot) == 3  # 3 slots + scratch
    assert _engine(monkeypatch, pair, reserve + 4 * per_slot - 1) == 2
    assert _engine(monkeypatch, pair, reserve + 100 * per_slot) == 8  # max_batch_size caps it
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _engine(monkeypatch, pair, reserve + per_slot)


def test_graphs_reserve_the_logits_of_the_padded_bucket(monkeypatch, pair):
    target, _ = pair
    per_slot = _per_token(target.model) * 64
    free = _reserve(target.model, rows=8) + 4 * per_slot  # 5 rows pad to the bucket of 8 under graphs
    monkeypatch.setattr(memory, "device_memory", lambda device: (free, 64 * GiB))
    slots = {}
    for graphs in (True, False):
        config = EngineConfig(max_batch_size=5, max_model_len=64, gpu_memory_utilization=1.0, cuda_graphs=graphs)
        slots[graphs] = RolloutEngine(target, SpecConfig(), config).runner.cache.num_slots
    assert slots[True] == 3
    assert slots[False] == min(5, (free - _reserve(target.model, rows=5)) // per_slot - 1) > 3


def test_sd_counts_the_draft_kv_on_the_same_device(monkeypatch, pair):
    # ran-check: KV sizing only; the engines are built and closed, never sample
    target, draft = pair
    per_slot = (_per_token(target.model) + _per_token(draft.model)) * 64
    reserve = _reserve(target.model, draft.model, rows=8)
    assert _engine(monkeypatch, pair, reserve + 4 * per_slot, SpecConfig(method="sd", k=3)) == 3
    assert _engine(monkeypatch, pair, reserve + 4 * per_slot - 1, SpecConfig(method="sd", k=3)) == 2


def test_ssd_counts_the_draft_sides_kv_and_tree(monkeypatch, pair):
    # ran-check: KV sizing only; the engines are built and closed, never sample
    from rollout_ssd.ssd.draft_server import draft_max_len

    target, draft = pair
    spec = SpecConfig(method="ssd", k=3, worker=False, strategy_rule=False)
    ssd = spec.ssd_config()
    per_slot = _per_token(target.model) * 64 + _per_token(draft.model) * draft_max_len(64, 3, ssd.max_branches)
    tree = 8 * ssd.max_branches * 48 * (2 * 4 * 3 + 8)
    reserve = _reserve(target.model, draft.model, rows=8, lens=(64, draft_max_len(64, 3, ssd.max_branches))) + tree
    assert _engine(monkeypatch, pair, reserve + 4 * per_slot, spec) == 3
    assert _engine(monkeypatch, pair, reserve + 4 * per_slot - 1, spec) == 2


def test_kv_cache_bytes_wins_and_cpu_models_keep_max_batch_size(monkeypatch, pair):
    def unreachable(device):
        raise AssertionError("kv_cache_bytes given: free memory must not be read")

    target, _ = pair
    monkeypatch.setattr(memory, "device_memory", unreachable)
    per_slot = _per_token(target.model) * 64
    engine = RolloutEngine(target, SpecConfig(), EngineConfig(max_batch_size=8, max_model_len=64,
                                                              kv_cache_bytes=5 * per_slot))
    assert engine.runner.cache.num_slots == 5
    monkeypatch.undo()
    engine = RolloutEngine(target, SpecConfig(), EngineConfig(max_batch_size=8, max_model_len=64))
    assert engine.runner.cache.num_slots == 8  # a CPU target: no sizing from free memory


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, True, "0.9", None])
def test_gpu_memory_utilization_is_validated(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in \\(0, 1\\]"):
        EngineConfig(gpu_memory_utilization=value)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_the_default_batch_on_a_cpu_is_128_as_far_as_half_the_memory_available_holds_it(monkeypatch, pair):
    """EngineConfig.max_batch_size=None: CPU_MAX_BATCH KV slots on a CPU where CPU_KV_MEMORY_SHARE of the
    memory available holds their KV at max_model_len (the target's, and SD's or SSD's draft's), else as many as it
    holds (at least one); unknown memory: CPU_MAX_BATCH; an explicit max_batch_size stands whatever the
    memory."""
    # ran-check: KV sizing only; the engines are built and closed, never sample
    from rollout_ssd.config import CPU_KV_MEMORY_SHARE, CPU_MAX_BATCH
    from rollout_ssd.models import cpu_memory
    from rollout_ssd.ssd.draft_server import draft_max_len

    target, draft = pair
    per_slot = _per_token(target.model) * 64
    with_draft = per_slot + _per_token(draft.model) * 64
    assert cpu_memory.available_bytes() > 0  # this machine's, read

    def slots(free, spec=SpecConfig(), **engine):
        monkeypatch.setattr(cpu_memory, "available_bytes", lambda: free)
        config = EngineConfig(max_model_len=64, **engine)
        made = RolloutEngine(target, spec, config, draft=None if spec.method == "ar" else draft)
        made.close()
        return made.runner.cache.num_slots
    assert slots(None) == CPU_MAX_BATCH
    assert slots(int(CPU_MAX_BATCH * per_slot / CPU_KV_MEMORY_SHARE)) == CPU_MAX_BATCH
    assert slots(int(5.5 * per_slot / CPU_KV_MEMORY_SHARE)) == 5
    assert slots(int(5.5 * with_draft / CPU_KV_MEMORY_SHARE), SpecConfig(method="sd", k=3)) == 5
    ssd = SpecConfig(method="ssd", k=3, worker=False)  # the draft side's cache, room for a tree, and SD's
    cfg = ssd.ssd_config()
    with_ssd = per_slot + _per_token(draft.model) * (draft_max_len(64, cfg.k, cfg.max_branches) + 64)
    assert slots(int(5.5 * with_ssd / CPU_KV_MEMORY_SHARE), ssd) == 5
    assert slots(0) == 1
    assert slots(0, max_batch_size=8) == 8
