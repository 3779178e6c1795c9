"""SD on the default pair (issue 3): our AR, our SD with the neural draft and with the suffix
speculator, transformers' assisted generation with the same draft, and transformers' prompt-lookup
decoding, in one run; K sweep; batch 1 and 8; greedy and T=1.

Prompts (`--prompt-set`, `common.bench_prompts`), as chat turns: "templates" (default) = the
distillation command's held-out prompts, templates the draft never trained on; "unseen" = unseen
prompts of its training templates, as in an RL job whose draft is distilled on the policy's own
prompt set. Greedy runs also check that SD's tokens equal AR's. Run:

    .venv/bin/python bench/bench_sd.py            # full
    .venv/bin/python bench/bench_sd.py --prompt-set unseen
    .venv/bin/python bench/bench_sd.py --quick    # a short smoke run
"""

from __future__ import annotations

import argparse
import time

import torch
from common import (
    add_prompt_set_arg,
    add_repo_to_path,
    bench_prompts,
    load_default_pair,
    machine_note,
    print_json_line,
    print_table,
)

add_repo_to_path()

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ks", default="2,3,4,5")
    p.add_argument("--stop-probs", default="0,0.3", help="neural draft: SpecConfig.stop_prob values (0 = always K)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-hf", action="store_true")
    add_prompt_set_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.ks, args.batches, args.prompts, args.new_tokens = "3", "1", 2, 24
    return args


def run_ours(engine, prompts, temperature, new_tokens, batch):
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    engine.metrics(reset=True)
    out = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out += engine.sample(prompts[i:i + batch], params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in out)
    return [r.token_ids for r in out], tokens / seconds, engine.metrics()


def hf_models(target, draft):
    """transformers models holding exactly our float32 weights; the draft's restricted head is a
    full-vocabulary head whose rows outside the head give -inf logits (same q as ours)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(loaded, cls=LlamaForCausalLM, **overrides):
        cfg = LlamaConfig(**{**loaded.hf_config.to_dict(), **overrides})
        model = cls(cfg).float().eval()
        state = {k: v.detach().float() for k, v in loaded.model.hf_parameters().items() if k != "lm_head.token_ids"}
        if loaded.model.head_token_ids is not None:
            full = torch.zeros(cfg.vocab_size, cfg.hidden_size)
            full[loaded.model.head_token_ids] = state["lm_head.weight"]
            state["lm_head.weight"] = full
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        return model

    class RestrictedHead(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + self.head_bias.to(out.logits.dtype)
            return out

    hf_target = build(target)
    hf_draft = build(draft, RestrictedHead, tie_word_embeddings=False)
    bias = torch.full((draft.model.cfg.vocab_size,), float("-inf"))
    bias[draft.model.head_token_ids] = 0.0
    hf_draft.register_buffer("head_bias", bias, persistent=False)
    return hf_target, hf_draft


@torch.inference_mode()
def run_hf(model, prompts, new_tokens, **gen_kwargs):
    out, tokens = [], 0
    t0 = time.perf_counter()
    for p in prompts:  # assisted generation supports batch 1 only
        ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=None, **gen_kwargs)
        out.append(ids[0, len(p):].tolist())
        tokens += len(out[-1])
    return out, tokens / (time.perf_counter() - t0)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_default_pair()
    prompts = bench_prompts(target.tokenizer, args.prompt_set, args.prompts)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    cfg = EngineConfig(max_batch_size=max(batches), max_model_len=max(map(len, prompts)) + args.new_tokens + 8)
    rows = []

    stops = [float(x) for x in args.stop_probs.split(",")]

    def row(method, k, batch, temp, tok_s, ar_tok_s, metrics=None, same=None, stop=None):
        metrics = metrics or {}
        rows.append({"method": method, "K": k, "stop": stop, "batch": batch, "T": temp, "tok/s": tok_s,
                     "x AR": tok_s / ar_tok_s, "accept": metrics.get("spec/accept_rate"),
                     "len/round": metrics.get("spec/accept_length"),
                     "draft share": metrics.get("spec/draft_time_share"), "greedy==AR": same})

    for temp in temps:
        for batch in batches:
            ar_engine = RolloutEngine(target, SpecConfig(method="ar"), cfg)
            ar_tokens, ar_rate, _ = run_ours(ar_engine, prompts, temp, args.new_tokens, batch)
            row("ours AR", None, batch, temp, ar_rate, ar_rate)
            for k in ks:
                for spec_name, stop in [("draft", x) for x in stops] + [("suffix", None)]:
                    spec = SpecConfig(method="sd", k=k, speculator=spec_name, stop_prob=stop or 0.0)
                    engine = RolloutEngine(target, spec, cfg, draft=draft)
                    tokens, rate, m = run_ours(engine, prompts, temp, args.new_tokens, batch)
                    same = tokens == ar_tokens if temp == 0 else None
                    row(f"ours SD {spec_name}", k, batch, temp, rate, ar_rate, m, same, stop)
            if batch == 1 and temp == 0 and not args.no_hf:
                hf_target, hf_draft = hf_models(target, draft)
                _, hf_ar = run_hf(hf_target, prompts, args.new_tokens)
                row("hf generate", None, 1, 0.0, hf_ar, ar_rate)
                for k in ks:
                    hf_draft.generation_config.num_assistant_tokens = k
                    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
                    hf_draft.generation_config.assistant_confidence_threshold = 0.0
                    _, rate = run_hf(hf_target, prompts, args.new_tokens, assistant_model=hf_draft)
                    row("hf assisted (same draft)", k, 1, 0.0, rate, ar_rate)
                _, rate = run_hf(hf_target, prompts, args.new_tokens, prompt_lookup_num_tokens=max(ks))
                row("hf prompt lookup", max(ks), 1, 0.0, rate, ar_rate)
    print_table(rows)
    best = {}
    for r in rows:
        key = (r["method"] + ("" if r["stop"] is None else f" stop={r['stop']}"), r["batch"], r["T"])
        if r["method"].startswith(("ours SD", "hf assisted")) and (key not in best or r["tok/s"] > best[key]["tok/s"]):
            best[key] = r
    summary = {f"{m}|b{b}|T{t}": {"K": r["K"], "stop": r["stop"], "x_ar": round(r["x AR"], 3), "tok_s": round(r["tok/s"], 2),
                                  "accept": r["accept"]} for (m, b, t), r in best.items()}
    print_json_line({"bench": "sd", "machine": machine_note(), "new_tokens": args.new_tokens,
                     "prompt_set": args.prompt_set,
                     "prompts": len(prompts), "best": summary, "rows": rows})


if __name__ == "__main__":
    main()
