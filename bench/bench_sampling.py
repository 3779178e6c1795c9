"""top-k / top-p truncation: the full-vocabulary sort vs the candidate path (sampling._drop).

    .venv/bin/python bench/bench_sampling.py [--rows 32] [--threads 1]

Logits are SmolLM2-135M-Instruct's own, at the last positions of chat-formatted arithmetic prompts
(real next-token laws, not random ones: how peaked they are decides how often the candidates settle a
row). Both paths are timed interleaved on the same rows, and their kept sets are checked equal.
"""

from __future__ import annotations

import argparse

from common import add_repo_to_path, machine_note, median, print_json_line, print_table, time_call

add_repo_to_path()

import torch  # noqa: E402

from rollout_ssd.models.loader import load_pretrained  # noqa: E402
from rollout_ssd.rl.tasks import arithmetic_dataset  # noqa: E402
from rollout_ssd.sampling import _drop, _drop_full_sort  # noqa: E402


def real_logits(rows: int) -> torch.Tensor:
    loaded = load_pretrained("smollm2-135m-instruct", dtype="float32")
    per_prompt = 8
    texts = list(arithmetic_dataset(-(-rows // per_prompt), seed=0)["prompt"])
    ids = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=True) for t in texts]
    ids = [x if isinstance(x, list) else x["input_ids"] for x in ids]
    shortest = min(len(x) for x in ids)
    with torch.no_grad():
        hidden = loaded.model.forward_train(torch.tensor([x[:shortest] for x in ids]))
        logits = loaded.model.logits(hidden[:, -per_prompt:])
    return logits.reshape(-1, logits.shape[-1])[:rows]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logits = real_logits(args.rows)
    vocab = logits.shape[1]
    table, result = [], {"bench": "sampling", "machine": machine_note(), "rows": args.rows, "vocab": vocab, "cases": []}
    for temperature, top_k, top_p in ((1.0, 0, 0.9), (0.7, 0, 0.9), (1.0, 0, 0.99), (1.0, 50, 0.95)):
        scaled = logits / temperature
        k = torch.full((scaled.shape[0],), top_k if top_k else vocab)
        p_ = torch.full((scaled.shape[0],), top_p)
        same = torch.equal(_drop(scaled, k, p_), _drop_full_sort(scaled, k, p_))
        sort_t, cand_t = [], []
        for _ in range(args.repeats):  # interleaved
            sort_t += time_call(lambda s=scaled, k=k, p=p_: _drop_full_sort(s, k, p), 1)
            cand_t += time_call(lambda s=scaled, k=k, p=p_: _drop(s, k, p), 1)
        row = {"T": temperature, "top_k": top_k, "top_p": top_p, "full sort ms": 1000 * median(sort_t),
               "candidates ms": 1000 * median(cand_t), "speedup": median(sort_t) / median(cand_t), "same kept set": same}
        table.append(row)
        result["cases"].append(row)
    print_table(table)
    print_json_line(result)


if __name__ == "__main__":
    main()
