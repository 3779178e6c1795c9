"""Probe (issue 15, part 2): one target decode / verify step of SmolLM2-135M compiled whole by
torch.compile (inductor's CPU backend) against today's eager step (`ModelRunner.extend`, oneDNN-packed
bf16 linears). The compiled step is the decoder's own layer code over a fixed-length KV cache (masked
explicit attention), with plain F.linear inside the graph (cpu_backend's eager forms do not trace).
Modes: "default" (inductor, weights as inputs), "freeze" (weights folded in as constants and
packed by inductor), "freeze+autotune" (and inductor's C++ GEMM templates, against ATen's by
autotuning), "freeze+autotune+cpp-only" (the C++ templates wherever they apply). Frozen weights do not
follow a weight update. Prints compile seconds, step ms and ms per step relative to eager, then one JSON line.

    .venv/bin/python bench/probe_compiled_step.py --threads 2 --rows 1 --tokens 1,5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_note, median, print_json_line, print_table, time_call  # noqa: E402


class WholeStep(nn.Module):
    """rows x t new tokens at `start` over a [layers] list of [rows, Hkv, L, D] caches; returns
    float32 logits at the last new token [rows, V]."""

    def __init__(self, model, rows: int, length: int):
        super().__init__()
        self.model = model
        cfg = model.cfg
        shape = (rows, cfg.num_kv_heads, length, cfg.head_dim)
        self.kc = [torch.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_layers)]
        self.vc = [torch.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_layers)]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from rollout_ssd.models.attention import explicit_attention
        from rollout_ssd.models.decoder import rms_norm

        model = self.model
        x = F.embedding(tokens, model.embed)
        cos, signed_sin = model.rope_tables(positions)
        pos = positions[0]
        for i, layer in enumerate(model.layers):
            kc, vc = self.kc[i], self.vc[i]

            def attend(q, k, v, kc=kc, vc=vc):
                kc.index_copy_(2, pos, k.transpose(1, 2))
                vc.index_copy_(2, pos, v.transpose(1, 2))
                return explicit_attention(q, kc, vc, mask, model.scale)

            x = layer(x, cos, signed_sin, attend)
        hidden = rms_norm(x, model.norm, model.cfg.rms_norm_eps)[:, -1]
        return model.head_logits(hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tokens", default="1,5")
    parser.add_argument("--length", type=int, default=256, help="KV cache length of the compiled step")
    parser.add_argument("--start", type=int, default=120)
    parser.add_argument("--modes", default="default,freeze,freeze+autotune")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from rollout_ssd.models import cpu_backend
    from rollout_ssd.models.loader import load_pretrained
    from rollout_ssd.runner import ModelRunner

    model = load_pretrained("smollm2-135m-instruct", dtype="auto", with_tokenizer=False).model
    cpu_backend.warm_packed(model)
    rows_out = []
    for t in [int(x) for x in args.tokens.split(",")]:
        runner = ModelRunner(model, args.rows, args.length + 16)
        slots = [runner.allocate() for _ in range(args.rows)]
        runner.prefill(slots, [[1] * args.start] * args.rows)

        def eager(runner=runner, slots=slots, t=t):
            runner.extend(slots, [[2] * t] * args.rows, last_only=True)
            for s in slots:
                runner.rollback(s, args.start)

        eager_ms = 1e3 * median(time_call(eager, args.repeats))
        rows_out.append({"mode": "eager (packed)", "t": t, "compile_s": 0.0, "step_ms": eager_ms, "vs_eager": 1.0})
        positions = (args.start + torch.arange(t)).expand(args.rows, t).contiguous()
        mask = (torch.arange(args.length)[None, :] <= positions[0][:, None])[None, None].expand(args.rows, 1, t, -1)
        tokens = torch.full((args.rows, t), 2, dtype=torch.long)
        for mode in args.modes.split(","):
            torch._dynamo.reset()
            from torch._inductor import config as ic

            ic.freezing = "freeze" in mode
            ic.max_autotune = "autotune" in mode
            ic.max_autotune_gemm_backends = "CPP" if mode.endswith("cpp-only") else "CPP,ATEN"
            step = WholeStep(model, args.rows, args.length).eval()
            compiled = torch.compile(step, dynamic=False, fullgraph=True)
            with torch.inference_mode():
                t0 = time.perf_counter()
                compiled(tokens, positions, mask)
                compile_s = time.perf_counter() - t0
                ms = 1e3 * median(time_call(lambda c=compiled, a=(tokens, positions, mask): c(*a), args.repeats))
                ref = step(tokens, positions, mask)
                err = (compiled(tokens, positions, mask) - ref).abs().max().item()
            rows_out.append({"mode": mode, "t": t, "compile_s": compile_s, "step_ms": ms, "vs_eager": ms / eager_ms,
                             "max_abs_logit_diff": err})
            print(rows_out[-1], flush=True)
    print_table(rows_out)
    print_json_line({"bench": "probe_compiled_step", "rows": rows_out, "threads": args.threads, **machine_note()})


if __name__ == "__main__":
    main()
