"""How far the target's distributions in bfloat16 are from float32's, on a data cache's sequences.

The distill recipe samples (and so teaches) in the dtype the engine runs on this CPU (`--sample-dtype
auto`). This measures what that changes: over the completion positions of the first --sequences samples
of a data cache (`recipes.distill_draft --data-cache`), both dtypes' full-vocabulary distributions from
one causal pass each (`forward_train`): top-1 agreement, mean KL(p_f32 || p_other) and mean total
variation; and how often the top-1 recorded while sampling equals the other dtype's pass (the engine's
decode kernels and the causal pass round differently). Table, JSON last line.

    .venv/bin/python bench/teacher_dtype.py --data /tmp/s27/data/new.pt --sequences 96
    .venv/bin/python bench/teacher_dtype.py --quick   # 4 prompts sampled here in --dtype, 16 tokens each
"""

from __future__ import annotations

import argparse

import torch
from common import add_repo_to_path, machine_note, print_json_line, print_table

add_repo_to_path()

from rollout_ssd.draft.on_policy import sample_with_teacher  # noqa: E402
from rollout_ssd.draft.prompts import chat_prompt_ids, eval_texts  # noqa: E402
from rollout_ssd.draft.teacher import load_samples  # noqa: E402
from rollout_ssd.models.cpu_backend import cpu_kind  # noqa: E402
from rollout_ssd.models.loader import load_pretrained  # noqa: E402


@torch.no_grad()
def compare(samples, reference, other) -> dict:
    n = agree = recorded = 0
    kl = tv = 0.0
    for s in samples:
        ids = torch.tensor([s.token_ids[:-1]])
        logp = [torch.log_softmax(m.logits(m.forward_train(ids)[0, s.prompt_len - 1:]).float(), -1)
                for m in (reference, other)]
        p, q = logp[0].exp(), logp[1].exp()
        n += p.shape[0]
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p * (logp[0] - logp[1])).sum())
        tv += 0.5 * float((p - q).abs().sum())
        recorded += int((s.topk_ids[:, 0].long() == q.argmax(-1)).sum())
    return {"sequences": len(samples), "positions": n, "top-1 agreement": agree / n, "mean KL nats": kl / n,
            "mean TV": tv / n, "recorded top-1 = other's pass": recorded / n}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="a recipes.distill_draft data cache (default: sample the "
                   "bench's unseen prompts here, in --dtype at T = 1, --new-tokens each)")
    p.add_argument("--sequences", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 prompts sampled here, 16 tokens each")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", help="the dtype compared with float32")
    args = p.parse_args(argv)
    if args.quick:
        args.data, args.sequences, args.new_tokens = None, 4, 16
    reference = load_pretrained(args.target, dtype="float32", with_tokenizer=False).model
    loaded = load_pretrained(args.target, dtype=args.dtype)
    other = loaded.model
    if args.data:
        samples = load_samples(args.data)[0][:args.sequences]
    else:
        prompts = chat_prompt_ids(loaded.tokenizer, eval_texts("unseen", args.sequences))
        samples = sample_with_teacher(other, prompts, [1.0] * len(prompts), args.new_tokens, batch_size=len(prompts))
    row = {"CPU": cpu_kind(), "dtype": args.dtype, **compare(samples, reference, other)}
    print_table([row], floatfmt=".4f")
    print_json_line({"bench": "teacher_dtype", "machine": machine_note(), "args": vars(args), "rows": [row]})


if __name__ == "__main__":
    main()
