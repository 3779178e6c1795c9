"""The learner's optimizer: the torch path is exactly torch AdamW + clip_grad_norm_; DeepSpeed ZeRO 0-2 on
CPU reproduces it; DeepSpeed inside a torch.distributed world that holds a bystander rank never issues a
collective that involves the bystander.

Deterministic (seeded); nothing statistical. DeepSpeed runs in spawned processes, so neither the
single-rank world it starts nor DeepSpeed's globals leak into the pytest process; a child that cannot
import deepspeed reports it and the test skips with that reason.
"""

import datetime
import functools
import inspect
import os
import queue as queue_module
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rollout_ssd.rl.optim import OptimConfig, TorchTrainer, make_trainer

STEPS, MICRO = 3, 2  # updates, backward calls per update
ACTIVE_CLIP, NO_CLIP = 0.05, 100.0  # the gradient norms here are ~1 to 2
# When clipping, DeepSpeed's clip factor is an ulp from torch's (its norm is sqrt(sum of squared per-tensor
# norms), torch's the norm of the norms; ZeRO 1/2 scale by 1/((norm + 1e-6)/clip), torch by clip/(norm + 1e-6)),
# and Adam's step barely depends on the gradient's scale: weights of size ~0.5 end an ulp or two apart.
CLIP_ATOL = 2e-7


# ---------------------------------------------------------------------------------------------- the problem
def tiny_problem():
    """A seeded MLP and a value head outside it (as the learner's PPO head), and fixed micro-batches."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    head = nn.Linear(4, 1)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen), torch.randn(5, 1, generator=gen))
               for _ in range(STEPS * MICRO)]
    return module, head, batches


def loss_of(out, head, y, v):
    return ((out - y) ** 2).mean() + ((head(out) - v) ** 2).mean()


def train(cfg: OptimConfig, forward: str = "trainer"):
    """STEPS updates of MICRO backward calls each; forward "trainer" runs trainer.module, "direct" the
    module itself (as the learner does). Returns (final weights, metrics of each step)."""
    module, head, batches = tiny_problem()
    params = list(module.parameters()) + list(head.parameters())
    trainer = make_trainer(module, params, cfg)
    run = trainer.module if forward == "trainer" else module
    metrics = []
    for step in range(STEPS):
        for x, y, v in batches[step * MICRO:(step + 1) * MICRO]:
            trainer.backward(loss_of(run(x), head, y, v))
        metrics.append(trainer.step())
        assert all(p.grad is None or not p.grad.any() for p in params), "step() must clear the gradients"
    return [p.detach().clone() for p in params], metrics


def train_discarding(cfg: OptimConfig):
    """Two updates, each after a backward that zero_grad() discards. Returns the final weights."""
    module, head, batches = tiny_problem()
    params = list(module.parameters()) + list(head.parameters())
    trainer = make_trainer(module, params, cfg)
    for step in range(2):
        x, y, v = batches[-1]
        trainer.backward(loss_of(module(x), head, y, v))
        trainer.zero_grad()
        x, y, v = batches[step]
        trainer.backward(loss_of(module(x), head, y, v))
        trainer.step()
    return [p.detach().clone() for p in params]


def config(clip: float, stage=None) -> OptimConfig:
    ds = None if stage is None else {"zero_optimization": {"stage": stage}}
    return OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=clip, deepspeed=ds)


# ------------------------------------------------------------------------------------------------ torch path
@pytest.mark.parametrize("clip", [ACTIVE_CLIP, 0.0])
def test_torch_step_is_adamw_by_hand(clip):
    module, head, batches = tiny_problem()
    params = list(module.parameters()) + list(head.parameters())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6, grad_clip=clip)
    trainer = make_trainer(module, params, cfg)
    assert isinstance(trainer, TorchTrainer) and trainer.module is module

    ref_module, ref_head = tiny_problem()[:2]
    ref_params = list(ref_module.parameters()) + list(ref_head.parameters())
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    before = [p.detach().clone() for p in params]

    for x, y, v in batches[:MICRO]:
        trainer.backward(loss_of(module(x), head, y, v))
        loss_of(ref_module(x), ref_head, y, v).backward()
    metrics = trainer.step()
    norm = torch.nn.utils.clip_grad_norm_(ref_params, clip if clip > 0 else float("inf"))
    ref_opt.step()

    for p, q, b in zip(params, ref_params, before):
        assert torch.equal(p, q)
        assert not torch.equal(p, b)
        assert p.grad is None
    assert metrics == {"learner/grad_norm": float(norm), "learner/lr": 1e-2}
    assert float(norm) > ACTIVE_CLIP  # so clip=ACTIVE_CLIP really clips, and clip=0 really does not


# -------------------------------------------------------------------------------------- DeepSpeed, one rank
def _put_result(queue, rank, body):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the wrapper does before its import
    try:
        import deepspeed  # noqa: F401
    except Exception as err:
        queue.put(("skip", rank, f"deepspeed cannot import: {type(err).__name__}: {err}"))
        return
    try:
        queue.put(("ok", rank, body()))
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


def _as_lists(weights):
    return [w.tolist() for w in weights]


def _single_rank_child(queue):
    torch.set_num_threads(1)

    def body():
        out = {}
        for clip in (NO_CLIP, ACTIVE_CLIP):
            w, m = train(config(clip))
            out[("torch", clip)] = (_as_lists(w), m)
            for stage in (0, 1, 2):
                for forward in ("trainer", "direct"):
                    w, m = train(config(clip, stage), forward)
                    out[(stage, clip, forward)] = (_as_lists(w), m)
        out["discard", "torch"] = _as_lists(train_discarding(config(NO_CLIP)))
        for stage in (0, 1, 2):
            try:
                out["discard", stage] = _as_lists(train_discarding(config(NO_CLIP, stage)))
            except RuntimeError as err:
                out["discard", stage] = str(err)
        return out

    _put_result(queue, 0, body)


def _spawn(target, args_per_process: list, timeout: float) -> list:
    """Run target(*args, queue) in one spawned process per args; each puts one (status, rank, payload).
    Returns the payloads by rank; skips if a child could not import deepspeed."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, queue)) for args in args_per_process]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results = []
    try:
        while len(results) < len(procs):
            results.append(queue.get(timeout=max(0.0, deadline - time.monotonic())))
    except queue_module.Empty:
        pytest.fail(f"{len(procs) - len(results)} process(es) sent nothing within {timeout} s (hung in a collective?); "
                    f"reports so far: {results}")
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()
    for status, rank, payload in sorted(results, key=lambda r: r[1]):
        if status == "skip":
            pytest.skip(payload)
        assert status == "ok", f"rank {rank} failed:\n{payload}"
    return [payload for _, _, payload in sorted(results, key=lambda r: r[1])]


@pytest.fixture(scope="module")
def single_rank_runs():
    return _spawn(_single_rank_child, [()], 120)[0]


def _tensors(lists):
    return [torch.tensor(x, dtype=torch.float32) for x in lists]


@pytest.mark.parametrize("forward", ["trainer", "direct"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.slow
def test_deepspeed_matches_torch_exactly_without_clipping(single_rank_runs, stage, forward):
    ref, ref_metrics = single_rank_runs[("torch", NO_CLIP)]
    got, metrics = single_rank_runs[(stage, NO_CLIP, forward)]
    for a, b in zip(_tensors(got), _tensors(ref)):
        assert torch.equal(a, b)
    for m, r in zip(metrics, ref_metrics):
        assert m["learner/lr"] == r["learner/lr"]
        assert m["learner/grad_norm"] == pytest.approx(r["learner/grad_norm"], rel=1e-6)


@pytest.mark.parametrize("forward", ["trainer", "direct"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.slow
def test_deepspeed_matches_torch_when_clipping(single_rank_runs, stage, forward):
    ref, ref_metrics = single_rank_runs[("torch", ACTIVE_CLIP)]
    got, metrics = single_rank_runs[(stage, ACTIVE_CLIP, forward)]
    assert all(r["learner/grad_norm"] > ACTIVE_CLIP for r in ref_metrics)
    for a, b in zip(_tensors(got), _tensors(ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=CLIP_ATOL)
    for m, r in zip(metrics, ref_metrics):
        assert m["learner/grad_norm"] == pytest.approx(r["learner/grad_norm"], rel=1e-6)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.slow
def test_deepspeed_zero_grad_discards_like_torch(single_rank_runs, stage):
    for a, b in zip(_tensors(single_rank_runs["discard", stage]), _tensors(single_rank_runs["discard", "torch"])):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_zero2_refuses_to_discard_reduced_gradients(single_rank_runs):
    assert "ZeRO stage 2" in single_rank_runs["discard", 2]


# ------------------------------------------------------------------------- DeepSpeed beside a bystander rank
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "_all_gather_base", "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "gather", "scatter",
    "send", "recv", "isend", "irecv",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")


def record_collectives(calls: list):
    """Wrap torch.distributed's collectives and new_group so each call appends (name, global ranks involved).
    Returns a function that unwraps them."""

    def wrap(name, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            if name == "new_group":
                ranks = set(bound.get("ranks") or range(dist.get_world_size()))
                calls.append((name, sorted(ranks), bool(bound.get("use_local_synchronization"))))
                return fn(*args, **kwargs)
            ranks = set(dist.get_process_group_ranks(bound.get("group") or dist.group.WORLD))
            if name in POINT_TO_POINT:
                ranks.add(bound.get("dst", bound.get("src")))
            calls.append((name, sorted(ranks)))
            return fn(*args, **kwargs)

        return recorded

    originals = {name: getattr(dist, name) for name in (*COLLECTIVES, "new_group") if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    return lambda: [setattr(dist, name, fn) for name, fn in originals.items()]


def _world_child(rank, store, queue):
    torch.set_num_threads(1)

    def body():
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        side = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))  # the bystander's group, made by both
        if rank == 1:  # a rollout actor: waits here while rank 0 trains, never joins anything else
            dist.barrier(group=side)
            dist.destroy_process_group()
            return None
        # LOCAL_SIZE == world size would make DeepSpeed's shm all-reduce wait for rank 1 forever
        os.environ["LOCAL_SIZE"] = "2"
        calls = []
        unwrap = record_collectives(calls)
        out = {}
        for stage in (0, 1, 2):
            weights, metrics = train(config(ACTIVE_CLIP, stage))
            out[stage] = (_as_lists(weights), metrics)
        unwrap()
        dist.barrier(group=side)  # releases the bystander: the only call it ever joins
        dist.destroy_process_group()
        out["ref"] = _as_lists(train(config(ACTIVE_CLIP))[0])
        out["calls"] = calls
        return out

    _put_result(queue, rank, body)


@pytest.mark.slow
def test_deepspeed_never_involves_a_bystander_rank(tmp_path):
    store = str(tmp_path / "store")
    learner, bystander = _spawn(_world_child, [(0, store), (1, store)], 90)
    assert bystander is None
    ref = _tensors(learner["ref"])
    for stage in (0, 1, 2):
        for a, b in zip(_tensors(learner[stage][0]), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=CLIP_ATOL)
    calls = learner["calls"]
    assert any(name == "all_reduce" for name, *_ in calls), "the recorder saw no DeepSpeed collective"
    involving_rank_1 = [c for c in calls if c[1] != [0]]
    assert not involving_rank_1, involving_rank_1
    assert all(c[2] for c in calls if c[0] == "new_group"), "a group made by rank 0 alone must be local"


# -------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("deepspeed, named", [
    ({"zero_optimization": {"stage": 3}}, "stage"),
    ({"zero_optimization": {"stage": True}}, "stage"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
    ({"zero_optimization": {"stage": 1, "overlap_comm": True}}, "overlap_comm"),
    ({"zero_optimization": 2}, "zero_optimization"),
    ({"tensorboard": {"enabled": True}}, "tensorboard"),
    ({"train_batch_size": 8}, "train_batch_size"),
    ({"optimizer": {"type": "Adam"}}, "optimizer"),
    ({"gradient_clipping": 1.0}, "gradient_clipping"),
    ({"bf16": {"enabled": True}}, "bf16"),
    ({"steps_per_print": 0}, "steps_per_print"),
    ("ds_config.json", "dict"),
])
def test_unsupported_deepspeed_config_is_named(deepspeed, named):
    with pytest.raises(ValueError, match=named):
        OptimConfig(deepspeed=deepspeed)


@pytest.mark.parametrize("field, value", [
    ("lr", 0.0), ("lr", -1.0), ("lr", float("nan")), ("weight_decay", -0.1), ("eps", 0.0), ("grad_clip", -1.0),
    ("grad_clip", True), ("betas", (0.9,)), ("betas", (0.9, 1.0)), ("betas", "0.9"),
])
def test_bad_optim_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        OptimConfig(**{field: value})


def test_config_accepts_supported_deepspeed_and_list_betas():
    cfg = OptimConfig(betas=[0.8, 0.9], deepspeed={"zero_optimization": {"stage": 2, "overlap_comm": True,
                                                                          "reduce_bucket_size": 1 << 20}})
    assert cfg.betas == (0.8, 0.9) and cfg.zero_stage == 2
    assert OptimConfig().zero_stage is None and OptimConfig(deepspeed={}).zero_stage == 0


def test_deepspeed_path_rejects_non_fp32_params_before_importing():
    module = nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        make_trainer(module, list(module.parameters()), OptimConfig(deepspeed={}))
    with pytest.raises(ValueError, match="no parameters"):
        make_trainer(module, [], OptimConfig())
