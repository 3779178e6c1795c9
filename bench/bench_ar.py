"""AR decode throughput of our engine against transformers' `generate`, and the batch-1 roofline.

Both sides run the built-in SmolLM2-135M-Instruct with the *same* float32 tensors (the HF model is
built from our decoder's `hf_parameters()`, which the bench checks by comparing logits), greedy,
with fixed lengths (ours: ignore_eos; HF: no eos_token_id), the same batches of token-id prompts
(HF left-padded), interleaved in one process so machine noise hits both alike.

Rates: `e2e` = B * new_tokens / time of the whole call (prefill included); `decode` =
B * (new_tokens - 1) / (time(new_tokens) - time(1)), which cancels prefill and set-up, so it is the
steady decode-step rate. Medians over --repeats.

Roofline (batch 1): a decode step must stream every weight it touches from DRAM once: all layers, the
final norm, the LM head (the tied embedding counts once, as the head) and B embedding rows. The
134.5M-parameter model does not fit in cache (8 MiB L3 here), so max tokens/s = bandwidth / bytes
per step, with the bandwidth of a large torch copy counted as 2 * size / time (read + write).

    python bench/bench_ar.py            # full run (a few minutes)
    python bench/bench_ar.py --quick    # smoke run
    python bench/bench_ar.py --against-rev 523bad3   # + decode steps of decoder.py at that git
                                                     #   revision vs now, interleaved, same weights
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import types

import common  # bench/common.py (the script's folder is on sys.path)
import torch

common.add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from rollout_ssd.models import decoder as decoder_module  # noqa: E402
from rollout_ssd.models.loader import LoadedModel, build_decoder, load_state  # noqa: E402
from rollout_ssd.runner import ModelRunner  # noqa: E402

MODEL = "smollm2-135m-instruct"
PAD_ID = 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batches 1 and 8, 16 new tokens, one repeat")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--no-bf16", action="store_true", help="skip our bfloat16 batch-1 run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--against-rev", default=None, metavar="REV",
                   help="also time decode steps of rollout_ssd/models/decoder.py at this git revision vs now")
    p.add_argument("--ab-steps", type=int, default=16, help="forwards per configuration in the --against-rev A/B")
    p.add_argument("--ab-only", action="store_true", help="with --against-rev: skip the engine/HF runs")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats = "1,8", 16, 1
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def make_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random token-id prompts of 20..60 tokens (content is irrelevant to a fixed-length run)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(20, 60))] for _ in range(count)]


def hf_model_from(loaded: LoadedModel):
    """transformers' LlamaForCausalLM holding exactly our decoder's float32 tensors."""
    from transformers import GenerationConfig, LlamaForCausalLM

    state = {k: v.detach().float().clone() for k, v in loaded.model.hf_parameters().items()}
    model = LlamaForCausalLM(loaded.hf_config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight), "LM head is not tied"
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
    return model


def ours_run(engine: RolloutEngine, prompts, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    out = engine.sample(prompts, params)
    assert all(len(r.token_ids) == new_tokens for r in out)
    return [r.token_ids for r in out]


@torch.inference_mode()
def hf_run(model, prompts, new_tokens: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == width + new_tokens
    return out[:, width:].tolist()


@torch.inference_mode()
def logits_errors(engine: RolloutEngine, hf, prompt: list[int]) -> dict:
    """max |ours - HF| / max |HF| of the last-position logits of one prompt, reached by a prefill of the
    whole prompt (an M = len(prompt) GEMM) and by a prefill of all but the last token then one batch-1
    decode step (the M = 1 GEMV path)."""
    ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    runner = engine.runner
    slot = runner.allocate()
    try:
        prefill = runner.prefill([slot], [prompt])[0]
        runner.rollback(slot, 0)
        runner.prefill([slot], [prompt[:-1]])
        decode = runner.decode([slot], [prompt[-1]])[0]
    finally:
        runner.free(slot)
    err = lambda ours: float((ours - ref).abs().max() / ref.abs().max())  # noqa: E731
    return {"logits_rel_err_prefill": err(prefill), "logits_rel_err_decode_b1": err(decode)}


def fast_path_checks() -> dict:
    """The decoder's float32 shortcuts are bitwise equal to the HF formulas they replace."""
    gen = torch.Generator().manual_seed(0)
    rms_ok, rope_ok = True, True
    for shape in [(1, 1, 576), (32, 1, 576), (4, 37, 576), (8, 3, 12, 64), (2, 5, 4096)]:
        x, w = torch.randn(*shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
        x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        rms_ok &= torch.equal(decoder_module.rms_norm(x, w, 1e-5), w * x32)
        cos, sin = torch.randn(shape[-1], generator=gen), torch.randn(shape[-1], generator=gen)
        half = shape[-1] // 2
        signed = torch.cat((-sin[:half], sin[half:]))
        rope_ok &= torch.equal(decoder_module.apply_rope(x, cos, signed),
                               x * cos + decoder_module.rotate_half(x) * sin)
    return {"rms_norm_fp32_bitwise": rms_ok, "apply_rope_bitwise": rope_ok}


def decoder_at_rev(rev: str, loaded: LoadedModel):
    """Our decoder class as of git revision `rev`, built with the same float32 tensors."""
    src = subprocess.run(["git", "-C", str(common.REPO_ROOT), "show", f"{rev}:rollout_ssd/models/decoder.py"],
                         capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"decoder_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:rollout_ssd/models/decoder.py", "exec"), module.__dict__)
    now = loaded.model
    old = module.Decoder(now.cfg, now.inv_freq, now.rope_scaling, dtype=torch.float32)
    load_state(old, dict(now.hf_parameters()))
    return old


def ab_decode_steps(old, new, prompts, batches, steps: int, rev: str) -> list[dict]:
    """Forwards of two decoders over their own caches, alternating which goes first, with the max
    relative logit difference and argmax agreement. Decode steps (1 new token per row) at each batch,
    also with the slots in reverse order (what the engine's slot free-list hands out on every other
    call), and SD verifications: batch 1 with 4, 5 and 6 new tokens per forward (k = 3, 4, 5), and
    batch 8 with 4."""
    configs = ([(b, 1, False) for b in batches] + [(b, 1, True) for b in batches if b > 1]
               + [(1, 4, False), (1, 5, False), (1, 6, False)] + ([(8, 4, False)] if max(batches) >= 8 else []))
    rows = []
    for b, t, reverse in configs:
        runners = [ModelRunner(m, max(batches), 256) for m in (old, new)]
        slots = [[r.allocate() for _ in range(b)] for r in runners]
        if reverse:
            slots = [s[::-1] for s in slots]
        logits = [r.prefill(s, prompts[:b])[:, None] for r, s in zip(runners, slots)]
        times, err, agree = ([], []), 0.0, 0
        for step in range(steps):
            feed = [[int(x)] + [(int(x) + i + 1) % 49152 for i in range(t - 1)] for x in logits[0][:, -1].argmax(-1)]
            for j in ((0, 1) if step % 2 else (1, 0)):
                logits[j], seconds = common.timed(runners[j].extend, slots[j], feed)
                times[j].append(seconds)
            err = max(err, float((logits[1] - logits[0]).abs().max() / logits[0].abs().max()))
            agree += int(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1)))
        med = [common.median(x) for x in times]
        rows.append({"batch": b, "new_per_row": t, "slots": "reversed" if reverse else "in order",
                     f"ms@{rev}": 1e3 * med[0], "ms_now": 1e3 * med[1], "speedup": med[0] / med[1],
                     "min_speedup": min(times[0]) / min(times[1]), "max_rel_diff": err,
                     "argmax_agree": f"{agree}/{steps}"})
    return rows


def step_weights(model) -> list:
    """The weight tensors a decode step reads whole: the final norm, the head, every layer's (a tied head
    counted once; an untied embedding is read only at its looked-up rows)."""
    return [model.norm, model.lm_head, *model.layers.parameters()]


def bytes_per_step(model, batch: int) -> int:
    """Weight bytes a decode step of `batch` rows reads (tied head counted once; B embedding rows)."""
    elems = sum(t.numel() for t in step_weights(model))
    if model.lm_head is not model.embed:  # an untied embedding is read only at the B looked-up rows
        elems += batch * model.cfg.hidden_size
    return elems * model.embed.element_size()


def rate_row(name, batch, new_tokens, full_s, one_s, hf_row=None):
    e2e = batch * new_tokens / common.median(full_s)
    step = (common.median(full_s) - common.median(one_s)) / (new_tokens - 1)
    row = {"impl": name, "batch": batch, "e2e_tok_s": e2e, "decode_tok_s": batch / step, "step_ms": 1e3 * step}
    if hf_row is not None:
        row["x_hf_e2e"] = e2e / hf_row["e2e_tok_s"]
        row["x_hf_decode"] = row["decode_tok_s"] / hf_row["decode_tok_s"]
    return row


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    n = args.new_tokens
    max_b = max(args.batches)
    # max_model_len 256 holds prompt + new tokens; a step reads only the filled part of the cache
    engine = RolloutEngine.from_pretrained(MODEL, dtype="float32", max_batch_size=max_b, max_model_len=256)
    loaded = engine.target
    prompts = make_prompts(max_b, loaded.model.cfg.vocab_size, args.seed)
    if args.ab_only:
        if not args.against_rev:
            raise SystemExit("--ab-only needs --against-rev")
        ab = ab_decode_steps(decoder_at_rev(args.against_rev, loaded), loaded.model, prompts, args.batches,
                             args.ab_steps, args.against_rev)
        common.print_table(ab, floatfmt=".3g")
        common.print_json_line({"bench": "ar", "machine": common.machine_note(), "against_rev": args.against_rev,
                                "ab": ab})
        return

    hf = None if args.no_hf else hf_model_from(loaded)
    bf16 = None
    if not args.no_bf16:  # same tensors, cast: the dtype "auto" would not pick here
        state = {k: v.detach().clone() for k, v in loaded.model.hf_parameters().items()}
        bf16 = RolloutEngine(LoadedModel(build_decoder(loaded.hf_config, state, torch.bfloat16),
                                         loaded.hf_config, None, loaded.source),
                             engine=EngineConfig(max_batch_size=1, max_model_len=256))

    exact = fast_path_checks()
    if hf is not None:
        exact.update(logits_errors(engine, hf, prompts[0]))

    # warm-up (allocator, thread pools, first-call dispatch)
    ours_run(engine, prompts[:2], 2)
    if hf is not None:
        hf_run(hf, prompts[:2], 2)
    if bf16 is not None:
        ours_run(bf16, prompts[:1], 2)

    bw_size = 256 if args.quick else 512
    bw_before = common.memory_bandwidth(bw_size)
    runs = [("ours", b, ours_run, engine) for b in args.batches]
    if hf is not None:
        runs += [("hf", b, hf_run, hf) for b in args.batches]
    if bf16 is not None:
        runs.append(("ours_bf16", 1, ours_run, bf16))
    runs.sort(key=lambda r: r[1])  # interleaved: ours then HF at each batch size
    times, tokens = {}, {}  # (impl, batch, new tokens) -> [seconds] / last output
    for _ in range(args.repeats):
        for impl, b, run, model in runs:
            for new in (n, 1):
                tokens[impl, b, new], seconds = common.timed(run, model, prompts[:b], new)
                times.setdefault((impl, b, new), []).append(seconds)

    bw_after = common.memory_bandwidth(bw_size)
    bw = {k: max(bw_before[k], bw_after[k]) for k in bw_before}  # best of before and after
    step_bytes = bytes_per_step(loaded.model, 1)
    roofline = bw["copy_gbps"] * 1e9 / step_bytes
    read_roofline = bw["read_gbps"] * 1e9 / step_bytes

    rows = []
    for b in args.batches:
        hf_row = None
        if hf is not None:
            hf_row = rate_row("hf generate fp32", b, n, times[("hf", b, n)], times[("hf", b, 1)])
        row = rate_row("ours fp32", b, n, times[("ours", b, n)], times[("ours", b, 1)], hf_row)
        if hf is not None:
            same = sum(x == y for x, y in zip(tokens[("ours", b, n)], tokens[("hf", b, n)]))
            exact[f"greedy_rows_equal_hf_b{b}"] = f"{same}/{b}"
        for r in (row, hf_row):
            if b == 1 and r is not None:
                r["pct_roofline"] = 100 * r["decode_tok_s"] / roofline
                r["pct_read_roofline"] = 100 * r["decode_tok_s"] / read_roofline
        rows.append(row)
        if hf_row is not None:
            rows.append(hf_row)
    if bf16 is not None:
        rows.append(rate_row("ours bf16", 1, n, times[("ours_bf16", 1, n)], times[("ours_bf16", 1, 1)]))
        rows[-1]["pct_roofline"] = 100 * rows[-1]["decode_tok_s"] / (roofline * 2)  # half the bytes

    machine = common.machine_note()
    print(f"# AR decode, {MODEL}, greedy, {n} new tokens, prompts 20-60 tokens, {args.repeats} repeat(s), "
          f"{machine['threads']} thread(s), load avg {machine['load_avg_1m']}")
    common.print_table(rows, ["impl", "batch", "e2e_tok_s", "decode_tok_s", "step_ms", "x_hf_e2e", "x_hf_decode",
                              "pct_roofline", "pct_read_roofline"])
    print(f"# bandwidth (best of before/after): copy {bw['copy_gbps']:.2f} GB/s (2*size/time), read "
          f"{bw['read_gbps']:.2f} GB/s (sum); float32 weights per batch-1 step {step_bytes / 1e6:.1f} MB -> "
          f"roofline {roofline:.2f} tok/s (copy: pct_roofline) / {read_roofline:.2f} tok/s (read: pct_read_roofline)")
    print(f"# exactness: {exact}")
    ab = []
    if args.against_rev:
        ab = ab_decode_steps(decoder_at_rev(args.against_rev, loaded), loaded.model, prompts, args.batches,
                             args.ab_steps, args.against_rev)
        print(f"# forwards (runner.extend: model + LM head, no sampling), decoder.py at {args.against_rev} vs "
              f"now, {args.ab_steps} interleaved forwards each, medians")
        common.print_table(ab, floatfmt=".3g")
    common.print_json_line({"bench": "ar", "model": MODEL, "new_tokens": n, "repeats": args.repeats,
                            "machine": machine, "bandwidth": bw, "bytes_per_step_b1": step_bytes,
                            "roofline_tok_s_b1": roofline, "read_roofline_tok_s_b1": read_roofline, "rows": rows,
                            "exactness": exact, "against_rev": args.against_rev, "ab": ab})


if __name__ == "__main__":
    main()
