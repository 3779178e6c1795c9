"""Distil the default draft of a target: on-policy target samples + forward KL (rollout_ssd.draft).

    python -m recipes.distill_draft --out rollout_ssd/assets/drafts/smollm2-135m-instruct-draft

Steps: build procedural prompts (train / held-out by template; `--prompt-mix varied` takes
draft.varied_prompts' other kinds in turn with them), sample completions from the target
with the teacher's top-k log-probs recorded (until --tokens or --data-minutes; in the dtype the engine
runs on this CPU, so the teacher is the target as deployed here, on every core), pick the head's
--head-size most frequent tokens, train a --layers-layer draft for --minutes, round it to bfloat16,
measure held-out acceptance (greedy and T=1) and the decode-step cost ratio, save the checkpoint
and PROVENANCE.md beside it. Logs its full config first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("distill_draft")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--num-prompts", type=int, default=4000, help="training prompts available to sample from")
    p.add_argument("--heldout-prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=60000, help="stop sampling data after this many completion tokens")
    p.add_argument("--data-minutes", type=float, default=20.0, help="stop sampling data after this long")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--temperatures", default="1.0:0.5,0.7:0.25,0:0.25",
                   help="sampling temperature mix T:share,... (0 = greedy)")
    p.add_argument("--top-k", type=int, default=64, help="teacher log-probs kept per position")
    p.add_argument("--gen-batch-size", type=int, default=128, help="sequences the sampling engine runs at once")
    p.add_argument("--chunk-prompts", type=int, default=256, help="prompts per sampling chunk (data is cached per chunk)")
    p.add_argument("--sample-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the dtype the target samples (and so teaches) in: auto, what the engine runs on this CPU "
                        "(bfloat16 where bf16 matmuls run natively: its law is the deployed target's there)")
    p.add_argument("--sample-threads", type=int, default=0, help="threads while sampling (0: every core)")
    p.add_argument("--data-cache", default=None, help="torch file to reuse / extend the sampled data")
    p.add_argument("--first-prompt", type=int, default=0, help="index of the first training prompt to sample")
    p.add_argument("--prompt-mix", choices=("templates", "varied"), default="templates",
                   help="templates: build_prompts' training prompts; varied: draft.varied_prompts' kinds in "
                        "turn with the training prompts of --original-range")
    p.add_argument("--original-range", default="0:7900",
                   help="A:B, the training prompts that --prompt-mix varied interleaves (B <= 7900 keeps "
                        "the benches' unseen set, prompts 7900-7999 of 8000, out of the data)")
    p.add_argument("--extra-data", nargs="*", default=[], help="more data caches to train on (read only)")
    p.add_argument("--data-only", action="store_true", help="sample data into --data-cache and stop")
    p.add_argument("--init-from", default=None, help="warm-start from this draft checkpoint (keeps its head)")
    p.add_argument("--head-size", type=int, default=8192)
    p.add_argument("--reselect-head", action="store_true",
                   help="with --init-from: the head's tokens chosen again from this run's data (--head-size "
                        "most frequent; rows of tokens kept stay trained, new ones start from the target's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--grow-layers", type=int, default=None,
                   help="make a warm-started draft this many layers deep: the target's next layers, their output "
                        "projections zeroed, so training starts from what the warm start computes (build.grow)")
    p.add_argument("--minutes", type=float, default=25.0, help="training wall-clock budget")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--eval-max-new-tokens", type=int, default=96)
    p.add_argument("--eval-init", action="store_true", help="also measure the untrained draft's acceptance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="threads while training and measuring (0: every core)")
    p.add_argument("--max-checkpoint-bytes", type=int, default=None,
                   help="size limit of the saved draft (default: the package's, for a draft that ships in it; "
                        "0: none, for a candidate measured from outside the package)")
    args = p.parse_args(argv)
    if args.reselect_head and not args.init_from:
        p.error("--reselect-head chooses a warm-started draft's head again: it needs --init-from")
    if args.grow_layers is not None and not args.init_from:
        p.error("--grow-layers makes a warm-started draft deeper: it needs --init-from")
    return args


def temperature_mix(spec: str, n: int, seed: int) -> list[float]:
    import random

    pairs = [(float(t), float(w)) for t, w in (item.split(":") for item in spec.split(","))]
    rng = random.Random(seed)
    return rng.choices([t for t, _ in pairs], weights=[w for _, w in pairs], k=n)


def sampling_model(args, model):
    """The target that samples the data: `model` (float32, the one training and measuring use), or the same
    weights loaded again in --sample-dtype where that resolves to another dtype on this machine."""
    from rollout_ssd.models.loader import load_pretrained, parse_dtype

    dtype = parse_dtype(args.sample_dtype)
    if dtype == model.embed.dtype:
        return model
    log.info("sampling with the target in %s (--sample-dtype %s)", dtype, args.sample_dtype)
    return load_pretrained(args.target, dtype=dtype, with_tokenizer=False).model


def sample_data(args, model, prompt_ids, threads: int):
    """The run's samples (the data cache's, then new ones from `sampling_model` on `threads` threads until
    --tokens or --data-minutes) and the seconds spent sampling."""
    from rollout_ssd.draft import on_policy, teacher

    samples, next_prompt, recorded = [], args.first_prompt, None
    if args.data_cache and Path(args.data_cache).is_file():
        cache = teacher.load_cache(args.data_cache)
        samples, next_prompt, recorded = cache.samples, cache.next_prompt, cache.prompt_set
        log.info("loaded %d cached samples (%d tokens) from %s", len(samples),
                 sum(s.num_completion for s in samples), args.data_cache)
    if recorded is not None and sum(s.num_completion for s in samples) < args.tokens and next_prompt < len(prompt_ids):
        teacher.check_prompt_set(args.data_cache, recorded, prompt_set(args))  # sampling on: the same prompt list
        if not recorded:
            log.warning("%s records no prompt list (made before the record): sampling on from prompt %d of "
                        "this run's, %s, which it will record", args.data_cache, next_prompt, prompt_set(args))
    temps = temperature_mix(args.temperatures, len(prompt_ids), args.seed)
    deadline = time.monotonic() + args.data_minutes * 60
    start_t, sampler, training_threads = time.monotonic(), None, torch.get_num_threads()
    while sum(s.num_completion for s in samples) < args.tokens and next_prompt < len(prompt_ids):
        if time.monotonic() > deadline:
            break
        if sampler is None:
            sampler = sampling_model(args, model)
            torch.set_num_threads(threads)
        chunk = range(next_prompt, min(next_prompt + args.chunk_prompts, len(prompt_ids)))
        got = on_policy.sample_with_teacher(sampler, [prompt_ids[i] for i in chunk], [temps[i] for i in chunk],
                                          args.max_new_tokens, args.top_k, args.gen_batch_size,
                                          seed=args.seed + next_prompt, deadline=deadline)
        samples.extend(got)
        next_prompt = chunk.stop
        n = sum(s.num_completion for s in samples)
        log.info("data: %d samples, %d tokens, %.0f s (%.1f tok/s this run)", len(samples), n,
                 time.monotonic() - start_t, n / max(time.monotonic() - start_t, 1e-9))
        if args.data_cache:
            teacher.save_samples(args.data_cache, samples, next_prompt, prompt_set(args))
    torch.set_num_threads(training_threads)
    return samples, time.monotonic() - start_t


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cores = torch.get_num_threads()  # torch's default: the cores this process may use
    torch.set_num_threads(args.threads or cores)
    torch.manual_seed(args.seed)
    command = "python -m recipes.distill_draft " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    log.info("config: %s", json.dumps(vars(args), sort_keys=True))

    from rollout_ssd.draft import acceptance, build, checkpoint, prompts, teacher, train
    from rollout_ssd.models.loader import load_pretrained

    target = load_pretrained(args.target, dtype="float32")
    model = target.model
    if not args.data_only:  # a draft that could not be saved is refused before any data or training
        log.info("checkpoint: at most %d bytes (limit %s)", check_size_first(args, model), size_limit(args))
    split = prompts.build_prompts(args.num_prompts, args.heldout_prompts, args.seed)
    train_ids = prompts.chat_prompt_ids(target.tokenizer, training_texts(args, split))
    heldout_ids = prompts.chat_prompt_ids(target.tokenizer, split.heldout)

    samples, data_s = sample_data(args, model, train_ids, args.sample_threads or cores)
    if args.data_only:
        log.info("data only: %d samples, %d tokens in %s", len(samples), sum(s.num_completion for s in samples),
                 args.data_cache)
        return 0
    for extra in args.extra_data:
        samples = samples + teacher.load_samples(extra)[0]
        log.info("added %s: now %d samples", extra, len(samples))
    data_tokens = sum(s.num_completion for s in samples)
    if args.init_from:
        draft = load_pretrained(args.init_from, dtype="float32", with_tokenizer=False, share_embedding_from=model).model
        head = draft.head_token_ids.detach().clone()
        log.info("warm start from %s (%d layers, head %d)", args.init_from, draft.cfg.num_layers, len(head))
        if args.reselect_head:
            new_head = build.select_head_tokens(samples, args.head_size, always=model.cfg.eos_token_ids)
            log.info("head reselected: %d tokens kept, %d new; coverage %.3f -> %.3f", len(set(head.tolist()) &
                     set(new_head.tolist())), len(set(new_head.tolist()) - set(head.tolist())),
                     build.coverage(head, samples), build.coverage(new_head, samples))
            draft, head = build.rehead(draft, model, new_head), new_head
        if args.grow_layers is not None:
            log.info("grown from %d to %d layers (the target's next layers, output projections zeroed)",
                     draft.cfg.num_layers, args.grow_layers)
            draft = build.grow(draft, model, args.grow_layers)
    else:
        head = build.select_head_tokens(samples, args.head_size, always=model.cfg.eos_token_ids)
        draft = build.make_draft(model, head, args.layers)
    log.info("head: %d tokens cover %.3f of training completion tokens", len(head), build.coverage(head, samples))
    results = {}
    if args.eval_init:
        results["init_greedy"] = acceptance.measure_acceptance(model, draft, heldout_ids, 0.0, args.eval_max_new_tokens)
        log.info("untrained draft: %s", results["init_greedy"])
    config = train.DistillConfig(lr=args.lr, batch_tokens=args.batch_tokens, minutes=args.minutes,
                                 max_steps=args.max_steps, weight_decay=args.weight_decay, seed=args.seed,
                                 max_checkpoint_bytes=size_limit(args))
    stats = train.train_draft(draft, samples, config, on_log=lambda d: log.info("train %s", d))
    log.info("trained: %s", stats)
    build.round_weights(draft, torch.bfloat16)

    greedy = acceptance.measure_acceptance(model, draft, heldout_ids, 0.0, args.eval_max_new_tokens)
    log.info("held-out greedy: %s", greedy)
    t1 = acceptance.measure_acceptance(model, draft, heldout_ids, 1.0, args.eval_max_new_tokens)
    log.info("held-out T=1: %s", t1)
    cost = acceptance.measure_cost(model, draft)
    log.info("cost: %s", cost)

    out = Path(args.out)
    provenance = (command, args, split, data_tokens, len(samples), data_s, head, build.coverage(head, samples), config,
                  stats, greedy, t1, cost, draft.cfg.num_layers)
    try:
        size = checkpoint.save_draft(draft, build.draft_hf_config(target.hf_config, draft.cfg.num_layers, len(head)), out,
                                     max_bytes=size_limit(args))
    except checkpoint.CheckpointTooLarge as err:
        if err.kept_at is not None:
            write_provenance(err.kept_at / "PROVENANCE.md", *provenance, (err.kept_at / "model.safetensors").stat().st_size,
                             results)
        log.error("%s", err)
        return 1
    write_provenance(out / "PROVENANCE.md", *provenance, size, results)
    log.info("wrote %s (%d bytes)", out, size)
    return 0


def prompt_set(args) -> dict:
    """The options that make the training prompt list (`training_texts`) and its token ids (the target's
    tokenizer; the target is also the teacher of every sample), as kept with the data cache."""
    names = ["target", "num_prompts", "heldout_prompts", "seed", "prompt_mix"] + \
        (["original_range"] if args.prompt_mix == "varied" else [])
    return {name: getattr(args, name) for name in names}


def training_texts(args, split) -> list[str]:
    """The training prompts in sampling order: build_prompts' own, or (--prompt-mix varied) varied kinds in
    turn with those of --original-range; a varied prompt equal to a held-out one is refused."""
    if args.prompt_mix == "templates":
        return split.train
    from rollout_ssd.draft import prompts, varied_prompts

    start, stop = (int(v) for v in args.original_range.split(":"))
    stop = min(stop, len(split.train))
    unseen = set(prompts.eval_texts("unseen", prompts.UNSEEN_OF - prompts.UNSEEN_FROM))  # the benches' set
    originals = [t for t in split.train[start:stop] if t not in unseen]
    varied = varied_prompts.build_varied_prompts(len(originals), args.seed)
    clash = set(varied) & (set(split.heldout) | unseen)
    if clash:
        raise ValueError(f"varied prompts equal to held-out ones: {sorted(clash)[:3]}")
    log.info("prompt mix: %d varied prompts in turn with training prompts %d:%d", len(varied), start, stop)
    return varied_prompts.interleave(varied, originals)


def size_limit(args):
    """The checkpoint's size limit in bytes (None: no limit)."""
    from rollout_ssd.draft.checkpoint import MAX_CHECKPOINT_BYTES

    if args.max_checkpoint_bytes is None:
        return MAX_CHECKPOINT_BYTES
    return args.max_checkpoint_bytes or None


def check_size_first(args, model) -> int:
    """The draft's checkpoint size from its config, refused (CheckpointTooLarge) before any data is
    sampled or any step trained if save_draft would refuse it at the end."""
    from rollout_ssd.draft.build import check_grow, draft_config
    from rollout_ssd.draft.checkpoint import check_checkpoint_size

    if args.init_from:
        from transformers import AutoConfig

        from rollout_ssd.models.config import model_config_from_hf

        cfg = model_config_from_hf(AutoConfig.from_pretrained(args.init_from, local_files_only=True))
        if args.grow_layers is not None:
            try:
                check_grow(cfg.num_layers, args.grow_layers, model.cfg.num_layers)
            except ValueError as err:
                raise ValueError(f"--grow-layers {args.grow_layers} from the warm start {args.init_from}: {err}") from None
        if args.reselect_head or args.grow_layers is not None:
            cfg = draft_config(model.cfg, cfg.num_layers if args.grow_layers is None else args.grow_layers,
                               args.head_size if args.reselect_head else cfg.head_vocab_size)
    else:
        cfg = draft_config(model.cfg, args.layers, args.head_size)
    return check_checkpoint_size(cfg, max_bytes=size_limit(args))


def sample_dtype(args) -> str:
    """The dtype --sample-dtype stands for on this machine, by name."""
    from rollout_ssd.models.loader import parse_dtype

    return str(parse_dtype(args.sample_dtype)).removeprefix("torch.")


def write_provenance(path, command, args, split, data_tokens, num_samples, data_s, head, cov, config, stats,
                     greedy, t1, cost, layers, size, extra):
    cost_rows = "\n".join(f"| {b} | {c['target_s'] * 1e3:.1f} | {c['draft_s'] * 1e3:.2f} | {c['ratio']:.3f} |"
                          for b, c in cost.items())
    extra_rows = "".join(f"- {k}: {v}\n" for k, v in extra.items())
    kept = ("its layers and norm; its head's tokens chosen again from this run's data, the rows of tokens it "
            "had kept as trained, new ones from the target's output rows" if args.reselect_head else
            "its layers, norm and head")
    if args.grow_layers is not None:
        kept += (f"; made {args.grow_layers} layers deep by `build.grow`: the target's next layers after the warm "
                 f"start's own, their attention and MLP output projections zeroed, so the grown draft started "
                 f"from exactly the function of the warm start{' with its new head' if args.reselect_head else ''}")
    warm = (f"\nWarm-started from `{args.init_from}` ({kept}; that checkpoint's own provenance "
            f"describes how it was made); the data below may include caches sampled by earlier runs "
            f"({', '.join(args.extra_data) or 'none'}).\n" if args.init_from else "")
    by_warm = (" (by the run that made the warm start, then this run's growth, above)" if args.grow_layers is not None else
               " (by the run that made the warm start)" if args.init_from else "")
    mix = ("" if args.prompt_mix == "templates" else
           f" in turn with `draft.varied_prompts.build_varied_prompts` (more kinds of request, none a held-out "
           f"template), training prompts {args.original_range} of the former")
    text = f"""# Default draft for SmolLM2-135M-Instruct: provenance

Made by the project's distillation command (`recipes/distill_draft.py`, library `rollout_ssd/draft/`):

```
{command}
```
torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), float32 compute; weights stored in bfloat16
({size} bytes, embedding not stored: the draft shares its target's).

## Model
{warm}- {layers} Llama layers, hidden 576, the target's heads/rope/norm eps; initialised from the target's first
  {layers} layers and final norm{by_warm}; input embedding = the target's (frozen, shared at load time).
- LM head restricted to the {len(head)} most frequent tokens of the training completions (EOS forced in);
  rows initialised from the target's output embedding; they cover {cov:.3f} of the training completion tokens.
  Verification stays exact: q is the distribution the draft samples from and it is 0 outside the head.

## Data (seed {args.seed})
- Prompts: procedural (`prompts.build_prompts`{mix}): questions, explanations, lists, stories/poems, instructions,
  code requests, arithmetic word problems; chat template applied. Held-out prompts ({len(split.heldout)}) use a
  template of each kind that training never uses, filled from another seed.
- Completions sampled on-policy from the target (`{args.target}`, by this run in {sample_dtype(args)}: `--sample-dtype
  {args.sample_dtype}`; a data cache's earlier samples in the dtype of the runs that made them) with the engine's law,
  temperatures {args.temperatures} (T:share), at most {args.max_new_tokens} new tokens: {num_samples} completions,
  {data_tokens} tokens, {data_s / 60:.1f} min of sampling. Teacher = the target's top-{args.top_k} log-probs at
  every completion position, recorded while sampling.

## Training
Forward KL(p_target || q_draft) on the head's support (teacher top-k restricted to the head, renormalised),
AdamW lr {config.lr}, warm-up {config.warmup_steps} steps, cosine over the wall-clock budget to
{config.min_lr_ratio}x, ~{config.batch_tokens} positions per step, grad clip {config.grad_clip}:
{stats.steps} steps, {stats.seconds / 60:.1f} min, {stats.positions_seen} positions seen
(loss {stats.first_loss:.3f} -> {stats.last_loss:.3f}).

## Measured (held-out prompts, bfloat16-rounded weights, float32 compute)
Expected per-token SD acceptance along target-sampled continuations (at most {args.eval_max_new_tokens} tokens each):
- greedy (P[argmax q = argmax p]): **{greedy.accept_rate:.3f}** ({greedy.positions} positions, {greedy.sequences} prompts)
- T=1 (sum_x min(p, q)): **{t1.accept_rate:.3f}** ({t1.positions} positions, {t1.sequences} prompts)
{extra_rows}
Decode-step cost, our runner, float32, 128 cached tokens, median of 20 steps (machine shared, so noisy):

| batch | target ms | draft ms | draft / target |
|---|---|---|---|
{cost_rows}
"""
    Path(path).write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
