"""Weight sync and draft drift on the default model (issue 5): what a learner's step costs to ship, and
what a frozen vs a following draft does to acceptance and the SSD hit rate as the policy moves.

Part 1, transfers. The learner (SmolLM2-135M-Instruct, float32 master weights) takes AdamW steps
(lr 1e-6 and 1e-5, from the same start) on a small GRPO-like loss over a few sequences it sampled
itself; after each step the weights go out in the rollout dtype (bfloat16) through three
LearnerSync-style pipelines into WeightReceivers holding their own bf16 copies: always full, exact
delta with zlib, exact delta without compression. Per step: bytes on the wire, sender seconds
(cast + encode + send), receiver seconds (verify + apply), and the share of bf16 elements that changed.

Part 2, drift. Two float32 SSD engines (in process: acceptance and hit rate do not depend on where the
draft runs) serve the same policy trajectory: each step both sample the same prompts under policy
version v, the learner takes a GRPO-like step on one engine's rollouts, and LearnerSync sends version
v+1 to both. One engine's draft stays frozen; the other's follows (DraftFollower: a few AdamW steps of
forward KL toward the new policy on the step's rollouts, then a draft sync). Per version: spec/accept_rate,
ssd/hit_rate, spec/accept_length, drift/kl_target_draft, mismatch/token_mult_prob_error, sync bytes
(the engines run float32 here, as CPUs without native bf16 do: an AdamW step moves nearly every float32
element, so these target transfers are full; part 1 is the bf16 case).
The draft is the built-in default draft when it is installed; otherwise (labelled in the output) the
target's first layers with its full head, untrained, a much weaker draft.

The reward is synthetic (share of completion tokens with an even id): the bench measures the
mechanics of sync and drift, not learning. Run:

    .venv/bin/python bench/bench_sync.py            # full (about half an hour on a quiet CPU)
    .venv/bin/python bench/bench_sync.py --quick    # a short smoke run
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch
from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.draft.build import make_draft  # noqa: E402
from rollout_ssd.draft.drift import DriftLog, kl_target_draft, token_mult_prob_error  # noqa: E402
from rollout_ssd.draft.follow import DraftFollower, FollowConfig  # noqa: E402
from rollout_ssd.draft.prompts import build_prompts, chat_prompt_ids  # noqa: E402
from rollout_ssd.models.loader import LoadedModel, load_pretrained  # noqa: E402
from rollout_ssd.models.registry import DEFAULT_TARGET, resolve_draft  # noqa: E402
from rollout_ssd.weight_sync import (  # noqa: E402
    InProcessTransport,
    LearnerSync,
    SenderConfig,
    WeightReceiver,
    WeightSender,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lrs", default="1e-6,1e-5", help="AdamW learning rates of part 1")
    p.add_argument("--transfer-steps", type=int, default=8, help="optimizer steps per learning rate (part 1)")
    p.add_argument("--updates", type=int, default=30, help="policy updates of part 2")
    p.add_argument("--drift-lr", type=float, default=1e-5)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--fanout", default=None, help="manual SSD fan-out F_0..F_k, e.g. 1,1,1,1,2 (default: planner)")
    p.add_argument("--fallback-layers", type=int, default=4, help="layers of the fallback draft")
    p.add_argument("--follow-lr", type=float, default=1e-4)
    p.add_argument("--follow-steps", type=int, default=4)
    p.add_argument("--skip-transfers", action="store_true")
    p.add_argument("--skip-drift", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.transfer_steps, args.updates, args.prompts, args.n, args.new_tokens = 2, 2, 2, 2, 16
        args.fanout, args.fallback_layers = args.fanout or ",".join(["1"] * args.k + ["2"]), 2
    args.fanout = None if args.fanout is None else tuple(int(x) for x in args.fanout.split(","))
    return args


# ----------------------------------------------------------------------------------- the learner
def even_token_reward(completion: list[int]) -> float:
    return sum(t % 2 == 0 for t in completion) / max(len(completion), 1)


def grpo_step(model, optimizer, rollouts, group: int) -> list[list[float]]:
    """One AdamW step of -A_i * mean_t log p(y_i,t) with group-normalised advantages (GRPO without
    clipping or KL), gradients accumulated one sequence at a time. Returns the learner's logprobs of
    every completion token BEFORE the step (what a trainer compares with the rollout's)."""
    rewards = torch.tensor([even_token_reward(r.token_ids) for r in rollouts]).view(-1, group)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer.zero_grad(set_to_none=True)
    learner_logprobs = []
    for r, a in zip(rollouts, adv.tolist()):
        ids = list(r.prompt_token_ids) + list(r.token_ids)
        hidden = model.forward_train(torch.tensor([ids[:-1]]))[0, len(r.prompt_token_ids) - 1:]
        logp = torch.log_softmax(model.logits(hidden), -1).gather(1, torch.tensor(r.token_ids)[:, None]).squeeze(1)
        learner_logprobs.append(logp.detach().tolist())
        (-a * logp.mean() / len(rollouts)).backward()
    optimizer.step()
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    return learner_logprobs


def sample_prompts(loaded: LoadedModel, count: int, seed: int) -> list[list[int]]:
    return chat_prompt_ids(loaded.tokenizer, build_prompts(count, 0, seed=seed).train)


# ---------------------------------------------------------------------------------- part 1
class Pipeline:
    """A sender and a receiver with its own bf16 copy, driven synchronously in this thread."""

    def __init__(self, name: str, config: SenderConfig, initial: dict, force_full: bool):
        self.name, self.force_full = name, force_full
        wire = InProcessTransport()
        self.sender = WeightSender(wire, config)
        self.receiver = WeightReceiver(wire.receiver(0), version=0)
        self.params = {n: t.detach().to(config.dtype).clone() for n, t in initial.items()}
        self.sender.seed(initial.items(), 0)

    def sync(self, weights: dict, version: int) -> dict:
        stats = self.sender.send(weights.items(), version, force_full=self.force_full)
        t0 = time.perf_counter()
        self.receiver.receive(timeout=60).apply_to(self.params)
        received = time.perf_counter() - t0
        assert self.sender.wait_ack(timeout=60)
        return {"bytes": stats.bytes_sent, "sender_s": stats.seconds, "receiver_s": received,
                "changed": stats.changed_fraction, "kind": stats.kind}


def run_transfers(args, loaded: LoadedModel, prompts) -> tuple[list[dict], dict]:
    rows, summary = [], {}
    initial = {n: t.detach().clone() for n, t in loaded.model.hf_parameters().items()}
    engine_model = copy.deepcopy(loaded.model)
    engine = RolloutEngine(LoadedModel(engine_model, loaded.hf_config, loaded.tokenizer, loaded.source),
                           SpecConfig(method="ar"), EngineConfig(max_batch_size=len(prompts) * args.n))
    rollouts = engine.sample(prompts, SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0))
    engine.close()
    for lr in [float(x) for x in args.lrs.split(",")]:
        model = copy.deepcopy(loaded.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        pipes = [Pipeline("full", SenderConfig(dtype=torch.bfloat16), initial, True),
                 Pipeline("delta+zlib", SenderConfig(dtype=torch.bfloat16, compression="zlib"), initial, False),
                 Pipeline("delta", SenderConfig(dtype=torch.bfloat16, compression="none"), initial, False)]
        per = {p.name: [] for p in pipes}
        for step in range(1, args.transfer_steps + 1):
            t0 = time.perf_counter()
            grpo_step(model, optimizer, rollouts, args.n)
            train_s = time.perf_counter() - t0
            weights = {n: t.detach() for n, t in model.hf_parameters().items()}
            for p in pipes:
                r = p.sync(weights, step)
                per[p.name].append(r)
                rows.append({"lr": f"{lr:g}", "step": step, "pipeline": p.name, "kind": r["kind"],
                             "MB": r["bytes"] / 1e6, "sender_s": r["sender_s"], "receiver_s": r["receiver_s"],
                             "changed_%": 100 * r["changed"] if p.name != "full" else None, "train_s": train_s})
            for p in pipes:  # every pipeline's receiver holds the learner's weights in bf16, bitwise
                assert all(torch.equal(p.params[n], weights[n].to(torch.bfloat16)) for n in weights)
        summary[f"{lr:g}"] = {
            name: {"mean_bytes": sum(r["bytes"] for r in rs) / len(rs),
                   "mean_sender_s": sum(r["sender_s"] for r in rs) / len(rs),
                   "mean_receiver_s": sum(r["receiver_s"] for r in rs) / len(rs),
                   "mean_changed_fraction": sum(r["changed"] for r in rs) / len(rs)}
            for name, rs in per.items()}
    return rows, summary


# ---------------------------------------------------------------------------------- part 2
def load_draft(loaded: LoadedModel, target_model, layers_if_missing: int):
    """(draft Decoder sharing `target_model`'s embedding, label)."""
    try:
        path = resolve_draft("default", DEFAULT_TARGET)
    except ValueError:
        path = None
    if path is not None:
        return load_pretrained(path, dtype="float32", with_tokenizer=False, share_embedding_from=target_model).model, \
            "default draft"
    draft = make_draft(target_model, torch.arange(target_model.cfg.vocab_size), num_layers=layers_if_missing)
    for p in draft.parameters():
        p.requires_grad_(False)
    return draft, f"fallback: target's first {layers_if_missing} layers, untrained (default draft missing)"


def make_engine(loaded: LoadedModel, learner_model, learner_draft, args, batch: int) -> RolloutEngine:
    target = copy.deepcopy(learner_model)
    draft = copy.deepcopy(learner_draft)
    draft.embed = target.embed  # a built-in draft shares its target's embedding, in the engine too
    spec = SpecConfig(method="ssd", k=args.k, fanout=args.fanout, worker=False, strategy_rule=False)
    return RolloutEngine(LoadedModel(target, loaded.hf_config, loaded.tokenizer, loaded.source), spec,
                         EngineConfig(max_batch_size=batch, max_model_len=1024),
                         draft=LoadedModel(draft, None, None, "draft"))


def run_drift(args, loaded: LoadedModel, prompts) -> tuple[list[dict], dict]:
    learner = copy.deepcopy(loaded.model)
    base_draft, label = load_draft(loaded, learner, args.fallback_layers)
    drafts = {"frozen": base_draft, "follow": copy.deepcopy(base_draft)}
    drafts["follow"].embed = learner.embed  # both learner-side drafts share the learner's embedding
    followers = {"frozen": DraftFollower(drafts["frozen"], FollowConfig(mode="frozen")),
                 "follow": DraftFollower(drafts["follow"], FollowConfig(mode="follow", steps=args.follow_steps,
                                                                        lr=args.follow_lr, batch_tokens=1024))}
    batch = len(prompts) * args.n
    engines, syncs, logs = {}, {}, {}
    for mode in ("frozen", "follow"):
        engines[mode] = make_engine(loaded, learner, drafts[mode], args, batch)
        t_wire, d_wire = InProcessTransport(), InProcessTransport()
        engines[mode].attach_receiver(WeightReceiver(t_wire.receiver(0)))
        engines[mode].attach_draft_receiver(WeightReceiver(d_wire.receiver(0)))
        syncs[mode] = LearnerSync(t_wire, d_wire, config=SenderConfig(dtype=torch.float32), timeout=120)
        syncs[mode].seed_target(learner, 0)
        syncs[mode].seed_draft(followers[mode].named_tensors(), 0)
        logs[mode] = DriftLog()
    optimizer = torch.optim.AdamW(learner.parameters(), lr=args.drift_lr, weight_decay=0.0)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
    for version in range(args.updates + 1):
        outs = {}
        for mode, engine in engines.items():
            engine.metrics(reset=True)
            t0 = time.perf_counter()
            outs[mode] = engine.sample(prompts, dataclasses.replace(params, seed=version))
            m = engine.metrics()
            kl = kl_target_draft(learner, drafts[mode], outs[mode])
            logs[mode].record(version, metrics=m, kl_target_draft=kl, sample_seconds=time.perf_counter() - t0)
        if version == args.updates:
            break
        learner_lp = grpo_step(learner, optimizer, outs["frozen"], args.n)  # both engines' policy: one trajectory
        mismatch = token_mult_prob_error(learner_lp, [r.logprobs for r in outs["frozen"]])
        for mode in engines:
            logs[mode].record(version, token_mult_prob_error=mismatch)
            stats = syncs[mode].sync_target(learner, version + 1)
            result = followers[mode].step(version + 1, outs[mode], target=learner)
            kw = {}
            if result.trained:
                kw["draft_sync"] = syncs[mode].sync_draft(followers[mode].named_tensors(), version + 1)
                kw["follow_seconds"] = result.seconds
            logs[mode].record(version + 1, target_sync=stats, **kw)
    rows = []
    for mode in engines:
        for row in logs[mode].rows():
            rows.append({"mode": mode, "version": row["sync/version"], "accept": row.get("spec/accept_rate"),
                         "hit": row.get("ssd/hit_rate"), "acc_len": row.get("spec/accept_length"),
                         "kl": row.get("drift/kl_target_draft"), "mult_err": row.get("mismatch/token_mult_prob_error"),
                         "sync_MB": row.get("sync/bytes", 0) / 1e6, "draft_MB": row.get("sync/draft_bytes", 0) / 1e6})
        engines[mode].close()

    def mean(mode, key, first):
        xs = [r[key] for r in rows if r["mode"] == mode and r[key] is not None and (r["version"] >= first)]
        return sum(xs) / len(xs) if xs else None

    late = max(1, args.updates // 2)
    summary = {"draft": label, "updates": args.updates, "drift_lr": args.drift_lr, "fanout": args.fanout,
               "engine_dtype": "float32",
               **{mode: {"accept_rate": mean(mode, "accept", 0), "hit_rate": mean(mode, "hit", 0),
                         "kl": mean(mode, "kl", 0), f"accept_rate_from_v{late}": mean(mode, "accept", late),
                         f"hit_rate_from_v{late}": mean(mode, "hit", late), f"kl_from_v{late}": mean(mode, "kl", late),
                         "rows": logs[mode].rows()} for mode in engines}}
    return rows, summary


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_pretrained(DEFAULT_TARGET, dtype="float32")
    prompts = sample_prompts(loaded, args.prompts, seed=0)
    result = {"bench": "sync", "machine": machine_note(), "quick": args.quick, "prompts": args.prompts, "n": args.n,
              "new_tokens": args.new_tokens}
    if not args.skip_transfers:
        rows, result["transfers"] = run_transfers(args, loaded, prompts)
        print("Part 1: one learner step shipped as bf16 (full vs exact delta)")
        print_table(rows, floatfmt=".3f")
        print()
    if not args.skip_drift:
        rows, result["drift"] = run_drift(args, loaded, prompts)
        print(f"Part 2: frozen vs following draft over {args.updates} policy updates "
              f"(AdamW lr {args.drift_lr:g}; draft: {result['drift']['draft']})")
        print_table(rows, floatfmt=".3f")
        print()
    print_json_line(result)


if __name__ == "__main__":
    main()
