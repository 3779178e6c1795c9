"""A draft that reads the target's features (EAGLE-style), measured teacher-forced beside the default draft
(issue 15, part 1: draft acceptance on prompts of kinds training never used).

The default draft is a small LM of its own: it knows what it was distilled on, and accepts far more on new
prompts of its training templates than on templates it never saw (bench/RESULTS.md, "More kinds of prompt
for the draft"). A draft that reads the target's last hidden state (the vector the target's head reads)
brings the target's knowledge of the context into each proposal. Here: one decoder layer over
fc([embedding of the next token, the target's feature]), its output normed and read by the target's own
head rows for the default draft's 8k tokens (frozen). A chain's later steps feed the draft's own output
back as the feature (no target feature exists for an unverified token); training unrolls `--depths` such
steps, each position attending to the true-feature entries before its chain and its chain's own entries,
so deeper steps are trained as they run.

Steps: (1) target continuations of training-template prompts (`bench/feature_draft_data.py`, or a data
cache of `recipes.distill_draft --data-only`), (2) the target's features over them (its dtype, widened),
(3) training for --minutes (cross-entropy from the target's distribution on the head's tokens, taken from
its own features), (4) per-depth expected acceptance on both bench prompt sets along target continuations
(96 tokens, greedy and T = 1), the default draft's on the same positions. Acceptance only, no engine path:
what the route is worth before what it costs.

    .venv/bin/python bench/feature_draft_probe.py --data /tmp/s26/seqs_b.pt --minutes 25 --autocast --save /tmp/s26/fd.pt
    .venv/bin/python bench/feature_draft_probe.py --load /tmp/s26/fd.pt --minutes 0     # evaluate only
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.nn.functional as F
from common import add_repo_to_path, bench_prompts, load_default_pair, machine_note, print_json_line, print_table
from torch import nn
from torch.nn.utils.rnn import pad_sequence

add_repo_to_path()

from rollout_ssd.draft.acceptance import expected_acceptance  # noqa: E402
from rollout_ssd.draft.on_policy import sample_continuations  # noqa: E402
from rollout_ssd.models.decoder import apply_rope, rms_norm  # noqa: E402


class FeatureDraft(nn.Module):
    """fc([embed(x_{i+1}), f_i]) -> one decoder layer -> norm -> frozen head rows: predicts f_{i+1} and
    so the distribution of x_{i+2}. Float32, plain torch ops (trainable)."""

    def __init__(self, target, head_ids: torch.Tensor, init_layer: int, fused: int = 0):
        super().__init__()
        cfg = target.cfg
        self.cfg, h = cfg, cfg.hidden_size
        # EAGLE-3's fusion: `fused` lower layers' states and the final one -> H, the first step's feature
        self.fuse = nn.Parameter(torch.randn(h, (fused + 1) * h) * ((fused + 1) * h) ** -0.5) if fused else None
        params = {k: v.detach().float().clone() for k, v in target.hf_parameters().items()}
        pre = f"model.layers.{init_layer}."
        w = lambda name: nn.Parameter(params[pre + name])  # noqa: E731
        self.fc = nn.Parameter(torch.randn(h, 2 * h) * (2 * h) ** -0.5)
        self.input_norm, self.post_norm = w("input_layernorm.weight"), w("post_attention_layernorm.weight")
        self.wq, self.wk, self.wv = w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")
        self.wo = w("self_attn.o_proj.weight")
        self.w_gate, self.w_up, self.w_down = w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), w("mlp.down_proj.weight")
        self.out_norm = nn.Parameter(params["model.norm.weight"])
        self.register_buffer("embed", params["model.embed_tokens.weight"])
        self.register_buffer("head_ids", head_ids.long())
        self.register_buffer("head", params["model.embed_tokens.weight"][head_ids.long()])
        self.register_buffer("inv_freq", target.inv_freq.float())

    def rope(self, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        half = emb.shape[-1] // 2
        cos, sin = emb.cos(), emb.sin()
        return cos[:, :, None], torch.cat((-sin[..., :half], sin[..., half:]), -1)[:, :, None]

    def qkv(self, feats: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """Inputs [B, T, H] features and [B, T] next tokens -> (residual x, q [B,Hq,T,D], k, v [B,Hkv,T,D])."""
        cfg = self.cfg
        b, t, _ = feats.shape
        x = torch.cat((F.embedding(next_tokens, self.embed), feats), -1) @ self.fc.T
        hn = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        cos, ss = self.rope(positions)
        q = apply_rope((hn @ self.wq.T).view(b, t, cfg.num_heads, cfg.head_dim), cos, ss)
        k = apply_rope((hn @ self.wk.T).view(b, t, cfg.num_kv_heads, cfg.head_dim), cos, ss)
        v = (hn @ self.wv.T).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        return x, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream after attention -> the predicted feature (normed) [B, T, H]."""
        cfg = self.cfg
        b, _, t, _ = attn.shape
        x = x + attn.transpose(1, 2).reshape(b, t, -1) @ self.wo.T
        hn = rms_norm(x, self.post_norm, cfg.rms_norm_eps)
        x = x + (F.silu(hn @ self.w_gate.T) * (hn @ self.w_up.T)) @ self.w_down.T
        return rms_norm(x, self.out_norm, cfg.rms_norm_eps)

    def head_logp(self, feats: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(feats @ self.head.T, -1)

    def unroll(self, feats: torch.Tensor, tokens: torch.Tensor, depths: int) -> list[torch.Tensor]:
        """Depth-k outputs [B, T-1, H] for k = 1..depths over a sequence with true features `feats` [B, T, H]
        and tokens [B, T]: depth k at position i has true features up to f_{i-k+1} and the draft's own
        after them, and predicts f_{i+1} (so x_{i+2}). Position i attends to the depth-1 entries at
        positions <= i-k+1 and to depth m's entry at position i-k+m (m = 2..k): its chain."""
        b, t, _ = feats.shape
        n = t - 1
        positions = torch.arange(1, t, device=feats.device).expand(b, n)
        nxt = tokens[:, 1:]
        keys, values, outs = [], [], []
        cur = feats[:, :n] @ self.fuse.T if self.fuse is not None else feats[:, :n]
        idx = torch.arange(n)
        for k in range(1, depths + 1):
            x, q, kk, vv = self.qkv(cur, nxt, positions)
            keys.append(kk)
            values.append(vv)
            mask = torch.zeros(n, k * n, dtype=torch.bool)
            mask[:, :n] = idx[None, :] <= (idx[:, None] - k + 1)
            for m in range(2, k + 1):
                j = idx - k + m
                ok = j >= 0
                mask[idx[ok], (m - 1) * n + j[ok]] = True
            mask[idx, (k - 1) * n + idx] = True  # its own entry (rows i < k-1 are not scored)
            attn = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                  enable_gqa=True)
            out = self.finish(x, attn)
            outs.append(out)
            cur = torch.cat((out[:, :1], out[:, :-1]), 1)  # depth k+1 at i reads depth k's output at i-1 (row 0 unused)
        return outs


@torch.no_grad()
def check_unroll(model: FeatureDraft, length: int = 10, depths: int = 3) -> None:
    """Each depth's output at each position changes with the features and tokens a round would give it
    (true features up to f_{i-k+1}, tokens up to x_{i+1}) and with nothing else; raises if not."""
    gen = torch.Generator().manual_seed(0)
    width = model.cfg.hidden_size if model.fuse is None else model.fuse.shape[1]
    feats = torch.randn(1, length, width, generator=gen)
    tokens = torch.randint(0, 1000, (1, length), generator=gen)
    base = model.unroll(feats, tokens, depths)
    for k in range(1, depths + 1):
        for i in range(k - 1, length - 1):
            for j in range(length):
                f2 = feats.clone()
                f2[0, j] += 1.0
                changed = not torch.allclose(model.unroll(f2, tokens, depths)[k - 1][0, i], base[k - 1][0, i], atol=1e-5)
                if changed != (j <= i - k + 1):
                    raise AssertionError(f"depth {k}, position {i}: feature {j} {'changed' if changed else 'did not change'} it")
                if j > i + 1:
                    t2 = tokens.clone()
                    t2[0, j] = (t2[0, j] + 1) % 1000
                    if not torch.allclose(model.unroll(feats, t2, depths)[k - 1][0, i], base[k - 1][0, i], atol=1e-5):
                        raise AssertionError(f"depth {k}, position {i}: a later token {j} changed it")
    print(f"check_unroll: depths 1-{depths} over {length} positions see what a round gives them", flush=True)


@torch.no_grad()
def target_features(target, sequences: list[list[int]], layers: tuple[int, ...] = (), batch: int = 8) -> list[torch.Tensor]:
    """The target's hidden states at every position of each sequence (float32, [len, H * (len(layers) + 1)]):
    the residual stream after each of `layers` (1-based; RMS-normalised, no weight), then the final-normed
    state the head reads (always last: the teacher's distribution comes from it)."""
    out = []
    for s in range(0, len(sequences), batch):
        chunk = sequences[s:s + batch]
        kept = []
        for i, x in target.layer_outputs(pad_sequence([torch.tensor(seq) for seq in chunk], batch_first=True)):
            if i + 1 in layers:
                kept.append(F.rms_norm(x.float(), (x.shape[-1],)).to(x.dtype))
        hidden = torch.cat(kept + [rms_norm(x, target.norm, target.cfg.rms_norm_eps)], -1).float()
        out += [hidden[r, :len(seq)].clone() for r, seq in enumerate(chunk)]
    return out


def train(model: FeatureDraft, samples, feats, args) -> list[dict]:
    """AdamW on the unrolled loss (each depth alike) until --minutes; a log row every ~60 s."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    rng = random.Random(0)
    order = list(range(len(samples)))
    t0, step, log, last = time.monotonic(), 0, [], time.monotonic()
    budget = args.minutes * 60
    while time.monotonic() - t0 < budget:
        rng.shuffle(order)
        for s in range(0, len(order), args.batch):
            frac = (time.monotonic() - t0) / budget
            if frac >= 1:
                break
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                loss, parts = unrolled_loss(model, [samples[i] for i in order[s:s + args.batch]],
                                            [feats[i] for i in order[s:s + args.batch]], args.depths)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if time.monotonic() - last > 60:
                last = time.monotonic()
                log.append({"minute": round((last - t0) / 60, 1), "step": step, "loss": float(loss),
                            **{f"ce{k + 1}": v for k, v in enumerate(parts)}})
                print(log[-1], flush=True)
    return log


def unrolled_loss(model: FeatureDraft, samples, feats, depths: int):
    """Cross-entropy from the target's distribution over the head's tokens (its own logits there, from its
    feature: the full distribution renormalised onto the head) to the draft's, summed over depths, on
    completion tokens from the second on (the first is the target's own, after its prefill)."""
    tokens = pad_sequence([torch.tensor(seq) for seq, _ in samples], batch_first=True)  # right-padded, as feats
    outs = model.unroll(pad_sequence(feats, batch_first=True), tokens, depths)
    # token x_t (t >= prompt_len + 1) is drawn from head(f_{t-1}) and predicted at position t - 2 at each depth
    rows = [(r, torch.arange(plen + 1, len(seq))) for r, (seq, plen) in enumerate(samples)]
    with torch.no_grad():
        h = model.cfg.hidden_size
        teacher = [torch.softmax(feats[r][ts - 1, -h:].float() @ model.head.T, -1) for r, ts in rows]
    total, parts = 0.0, []
    for k, out in enumerate(outs, start=1):
        num, den = torch.zeros(()), 0
        for (r, ts), p in zip(rows, teacher):
            keep = ts - 2 >= k - 1
            num = num - (p[keep] * model.head_logp(out[r, ts[keep] - 2]).float()).sum()
            den += int(keep.sum())
        part = num / max(den, 1)
        parts.append(float(part.detach()))
        total = total + part
    return total, parts


def load_sequences(paths) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of each sequence in `bench/feature_draft_data.py` files or teacher data
    caches (`recipes.distill_draft --data-only`: `draft.teacher.save_samples` writes the same two lists)."""
    out = []
    for path in paths:
        data = torch.load(path, weights_only=True)
        out += list(zip(data["token_ids"], data["prompt_len"]))
    return out


@torch.no_grad()
def evaluate(model: FeatureDraft, target, draft, prompt_set: str, temperature: float, args) -> dict:
    """Per-depth expected acceptance of the feature draft, and the default draft's, on the same positions
    (completion tokens from the second on) of target continuations."""
    prompts = bench_prompts(target.tokenizer, prompt_set, args.eval_prompts)
    comps = sample_continuations(target.model, prompts, [temperature] * len(prompts), args.eval_tokens, 16, 1234)
    seqs = [list(p) + list(c) for p, c in zip(prompts, comps) if len(c) > 1]
    plens = [len(p) for p, c in zip(prompts, comps) if len(c) > 1]
    feats = target_features(target.model, seqs, args.feature_layers)
    hits = {k: [] for k in range(1, args.eval_depths + 1)}
    base = []
    for seq, plen, f in zip(seqs, plens, feats):
        tokens = torch.tensor([seq])
        final = f[None, :, -target.model.cfg.hidden_size:].to(target.model.dtype)  # this dtype's, widened
        p_logits = target.model.logits(final)[0].float()  # row i: x_{i+1}
        outs = model.unroll(f[None], tokens, args.eval_depths)
        d_logits = draft.model.logits(draft.model.forward_train(tokens))[0].float()
        ts = torch.arange(plen + 1, len(seq))  # scored tokens x_t
        for k, out in enumerate(outs, start=1):
            q = torch.full((len(ts), p_logits.shape[-1]), float("-inf"))
            q[:, model.head_ids] = out[0, ts - 2] @ model.head.T
            ok = ts - 2 >= k - 1
            hits[k].append(expected_acceptance(p_logits[ts - 1][ok], q[ok], temperature))
        base.append(expected_acceptance(p_logits[ts - 1], d_logits[ts - 1], temperature))
    row = {"set": prompt_set, "T": temperature, "positions": int(sum(len(b) for b in base)),
           "default draft": float(torch.cat(base).mean())}
    for k, h in hits.items():
        row[f"depth {k}"] = float(torch.cat(h).mean())
    return row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="*", default=[], help="bench/feature_draft_data.py files or data caches of "
                   "recipes.distill_draft --data-only")
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--depths", type=int, default=3, help="chain steps unrolled in training")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init-layer", type=int, default=29, help="the target layer the draft's layer starts from")
    p.add_argument("--feature-layers", default="", help="comma-separated target layers (1-based) whose states are "
                   "fused with the final one for a chain's first step (EAGLE-3); empty: the final state alone")
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--eval-depths", type=int, default=4)
    p.add_argument("--max-samples", type=int, default=0, help="train on the first N samples (0: all)")
    p.add_argument("--save", default="", help="write the trained draft's state_dict here")
    p.add_argument("--load", default="", help="start from this state_dict (weights_only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="the target's (features, and the p acceptance is scored against)")
    p.add_argument("--autocast", action="store_true", help="train the draft's matmuls in bf16 (float32 weights)")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 sequences, 12 s of training, 2 prompts x 16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.max_samples, args.minutes = 16, (0.2 if args.data else 0.0)
        args.eval_prompts, args.eval_tokens, args.eval_depths = 2, 16, 2
    args.feature_layers = tuple(int(x) for x in args.feature_layers.split(",") if x)
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, draft = load_default_pair("default", dtype=args.dtype)
    model = FeatureDraft(target.model, draft.model.head_token_ids.detach(), args.init_layer, len(args.feature_layers))
    if args.load:
        model.load_state_dict(torch.load(args.load, weights_only=True))
    if args.quick:
        check_unroll(model)
    log = []
    if args.minutes > 0:
        samples = load_sequences(args.data)
        if args.max_samples:
            samples = samples[:args.max_samples]
        t0 = time.monotonic()
        feats = target_features(target.model, [seq for seq, _ in samples], args.feature_layers)
        print(f"{len(samples)} samples, {sum(len(seq) - n for seq, n in samples)} completion tokens; "
              f"features in {time.monotonic() - t0:.0f} s", flush=True)
        log = train(model, samples, feats, args)
        if args.save:
            torch.save(model.state_dict(), args.save)
    rows = [evaluate(model, target, draft, name, temp, args) for name in ("templates", "unseen") for temp in (0.0, 1.0)]
    print_table(rows, floatfmt=".3f")
    print_json_line({"bench": "feature_draft_probe", "args": vars(args), "machine": machine_note(), "train_log": log,
                     "rows": rows})


if __name__ == "__main__":
    main()
