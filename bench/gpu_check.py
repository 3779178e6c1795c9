"""The GPU check (issue 17): one call on a lent GPU machine, ending with one JSON line.

Parts (each timed and fenced: a failing part records its error and the next one runs):
  env        device, versions, copy bandwidth (the roofline the step times are divided by);
  tests      `pytest -m gpu` on the GPU-marked test files;
  equality   greedy tokens of AR / SD / SSD on a tiny random float32 pair: engine on the device (SDPA and
             Triton attention, eager and graphed) vs the engine on the CPU vs transformers' `generate`
             on the device;
  fused      the decoder's RMSNorm (fused float32 normalisation, HF's rounding order) against HF's
             written-out ops on the device, bf16 at Llama-3-8B's width: equal elements, time of each;
  attention  SDPA vs the Triton span kernel (EngineConfig.attention) at Llama-3-8B's attention shape
             (bf16): decode, verify (T=K+1) and a tree step over ragged contexts, each backend's max
             error against float64 (the kernel may err at most 2 x SDPA + eps/8) and its time;
  steps      eager vs static-graphed decode (T=1) and verify (T=K+1) step times at batch 1 / 16 / 64 on
             random Llama-3-8B- and 1B-shaped models (bf16), against each model's weight-read time,
             with SDPA and with the Triton backend;
  memory     the KV cache sized from free GPU memory (EngineConfig.gpu_memory_utilization): the slots an
             engine over the random 8B target gets, then a prefill and decode of its largest batch,
             and the peak memory against the utilization's share of the GPU;
  overlap    target verify and draft tree steps on two CUDA streams at once vs one after the other;
  predict    Theorem 7's SSD/SD and SSD/AR from the measured costs (docs/THEORY.md), for a draft
             accepting `--accept` per token with hit rate `--p-hit`.
`--cpu-smoke` runs the same logic on tiny shapes on the CPU (CI runs it), so the script is tested
before device time is spent on it: the Triton parts run there only under TRITON_INTERPRET=1 (the test
sets it), and `memory` reads a pretend device's free memory. No network and no checkpoints are needed: models are built from
configs with random weights (their acceptance is meaningless; they time the mechanics).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # name -> (hidden, intermediate, layers, heads, kv heads, vocab)
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "llama3-1b": (2048, 8192, 16, 32, 8, 128256),
    "tiny-target": (64, 128, 4, 4, 2, 512),
    "tiny-draft": (64, 128, 1, 4, 2, 512),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --cpu-smoke times only to check the script's logic and output (tiny shapes; in CI also with Triton
# interpreted, where every timed call runs the kernels in Python): one call after the warm-up
SMOKE_REPEATS = 1


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` calls after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def part_env(device: torch.device, smoke: bool) -> dict:
    out = {"torch": torch.__version__, "device": str(device), "cuda": torch.cuda.is_available()}
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
        out["free_gb"] = torch.cuda.mem_get_info(device)[0] / 2**30
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    n = (16 if smoke else 1024) * 2**20 // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device, 5)
    out["copy_gb_s"] = 2 * src.numel() * 2 / (ms / 1e3) / 1e9  # read + write
    return out


def part_tests(device: torch.device, smoke: bool) -> dict:
    files = ["tests/test_gpu_graphs.py", "tests/test_device_engine.py", "tests/test_tree_attention.py",
             "tests/test_attention_backends.py", "tests/test_weight_sync.py", "tests/test_ssd_thread_client.py"]
    # smoke: the same call on one CPU case (the GPU cases skip on a CPU)
    marks = ["-m", "not gpu", "-k", "bucket"] if smoke else ["-m", "gpu"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *marks, *files]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    failed = [line[:400] for line in lines if line.startswith(("FAILED", "ERROR"))]
    out = {"rc": proc.returncode, "summary": (lines[-1:] or [""])[0], "failed": failed}
    if failed:  # the first failure's report, for a session that cannot rerun on the device
        out["output_tail"] = proc.stdout[-6000:]
    return out


def tiny_pair(directory: Path) -> tuple[str, str]:
    """A tiny random Llama target and a noisy copy as its draft (real hits and misses), float32."""
    from transformers import LlamaForCausalLM

    from tests.support.models import hf_config, randomize

    torch.manual_seed(0)
    target = LlamaForCausalLM(hf_config("llama-gqa-untied", vocab_size=128, num_hidden_layers=2))
    randomize(target, seed=1, logit_scale=4.0)
    target.save_pretrained(directory / "target")
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.05 * p.std() * torch.randn_like(p))
    target.save_pretrained(directory / "draft")
    return str(directory / "target"), str(directory / "draft")


def triton_here(device: torch.device) -> bool:
    """Whether the Triton backend runs on `device`: a CUDA device with triton, or the CPU interpreter."""
    import importlib.util

    from rollout_ssd.models.attention import triton_interpreted

    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreted())


def part_equality(device: torch.device, smoke: bool) -> dict:
    from transformers import LlamaForCausalLM

    from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig

    prompts = [[1, 5, 9, 3], [7, 2], [4, 4, 8, 1, 6, 2]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12 if smoke else 24, ignore_eos=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = tiny_pair(Path(tmp))
        hf = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).to(device)
        want = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_new_tokens,
                              do_sample=False, pad_token_id=0)
            want.append(gen[0, len(p):].tolist())
        places = [("cpu", False, "sdpa"), ("cpu", True, "sdpa")]
        if triton_here(torch.device("cpu")):
            places.append(("cpu", False, "triton"))
        if device.type != "cpu":
            places += [(str(device), graphs, attention) for attention in ("sdpa", "triton")[:1 + triton_here(device)]
                       for graphs in (False, True)]
        for method in ("ar", "sd", "ssd"):
            row = {}
            for where, graphs, attention in places:
                label = f"{where}+{attention}{'+graphs' if graphs else ''}"
                try:
                    engine = RolloutEngine.from_pretrained(target, draft=None if method == "ar" else draft,
                                                           spec=SpecConfig(method=method, k=3, strategy_rule=False),
                                                           dtype="float32", device=where, max_batch_size=4,
                                                           max_model_len=64, cuda_graphs=graphs, attention=attention)
                    try:
                        got = [r.token_ids for r in engine.sample(prompts, params)]
                    finally:
                        engine.close()
                    row[label] = got == want
                except Exception as err:  # recorded: the first failure of a device path is the finding
                    row[label] = f"{type(err).__name__}: {err}"[:300]
            out[method] = row
    out["all_equal"] = all(v is True for row in out.values() if isinstance(row, dict) for v in row.values())
    return out


def random_decoder(shape: str, device: torch.device, dtype: torch.dtype):
    from rollout_ssd.models.config import ModelConfig
    from rollout_ssd.models.decoder import Decoder

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                      max_position_embeddings=4096, bos_token_id=None, eos_token_ids=())
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    with torch.device(device):
        model = Decoder(cfg, inv_freq, 1.0, dtype=dtype)
    # its own generator: independent of the default one's state (a failed capture elsewhere leaves the
    # default CUDA generator unusable) and of whatever drew from it before
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.normal_(0.0, 0.02, generator=gen)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not model.embed)
    return model, weight_bytes


def time_batch(model, b: int, k: int, context: int, device: torch.device, repeats: int) -> dict:
    """Eager (`ModelRunner.extend`) vs static-graphed step times of T = 1 and K+1 at batch b, with SDPA
    (eager_ms, graphed_ms) and, where it runs, the Triton backend (triton_eager_ms, triton_graphed_ms)."""
    from rollout_ssd.gpu.graphs import GraphedSteps
    from rollout_ssd.models.attention import SDPABackend, TritonBackend
    from rollout_ssd.runner import ModelRunner

    runner = ModelRunner(model, num_slots=b, max_len=context + 8 * (k + 1))
    slots = list(range(b))
    runner.prefill(slots, [[1] * context] * b)
    backends = [("", SDPABackend())] + ([("triton_", TritonBackend())] if triton_here(device) else [])
    rows = {}
    for prefix, backend in backends:
        model.backend = backend
        graphs = GraphedSteps(model, runner.cache, buckets=(b,))
        for t in (1, k + 1):
            feed = [[2] * t] * b

            def rewind():
                for s in slots:
                    runner.rollback(s, context)

            row = rows.setdefault(f"b{b}_t{t}", {})
            row[f"{prefix}eager_ms"] = timed_ms(lambda feed=feed: (runner.extend(slots, feed, last_only=True), rewind()),
                                                device, repeats)
            row[f"{prefix}graphed_ms"] = timed_ms(lambda feed=feed, graphs=graphs: (graphs.run(slots, feed), rewind()),
                                                  device, repeats)
    model.backend = SDPABackend()
    return rows


def part_steps(device: torch.device, smoke: bool, k: int, env: dict) -> dict:
    dtype = torch.float32 if smoke else torch.bfloat16
    shapes = ("tiny-target", "tiny-draft") if smoke else ("llama3-8b", "llama3-1b")
    out = {}
    for shape in shapes:
        model, weight_bytes = random_decoder(shape, device, dtype)
        # the weight-read time at the bandwidth a copy reaches (copy_gb_s counts its reads and writes)
        floor_ms = weight_bytes / (env["copy_gb_s"] * 1e9) * 1e3
        rows = {}
        for b in ((1, 4) if smoke else (1, 16, 64)):
            rows.update(time_batch(model, b, k, 32 if smoke else 512, device, SMOKE_REPEATS if smoke else 20))
        out[shape] = {"weight_gb": weight_bytes / 1e9, "floor_ms": floor_ms, "steps": rows,
                      "b1_graphed_over_floor": rows["b1_t1"]["graphed_ms"] / floor_ms}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def part_fused(device: torch.device, smoke: bool) -> dict:
    """The decoder's RMSNorm against HF's written-out ops, bf16 at Llama-3-8B's width (64 rows)."""
    from rollout_ssd.models.decoder import rms_norm

    def hf(x, w, eps):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    g = torch.Generator().manual_seed(0)
    hidden = 256 if smoke else 4096
    x = (3 * torch.randn(64, hidden, generator=g)).to(torch.bfloat16).to(device)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(device)
    ours, theirs = rms_norm(x, w, 1e-5), hf(x, w, 1e-5)
    differ = (ours != theirs)
    ulps = (ours.float() - theirs.float()).abs() / theirs.float().abs().clamp(min=1e-30) / 2 ** -8
    return {"bitwise_equal": not bool(differ.any()), "differing_fraction": differ.float().mean().item(),
            "max_diff_bf16_ulps": float(ulps[differ].max()) if bool(differ.any()) else 0.0,
            "ours_ms": timed_ms(lambda: rms_norm(x, w, 1e-5), device, 20),
            "hf_ops_ms": timed_ms(lambda: hf(x, w, 1e-5), device, 20)}


def attention_case(kind: str, b: int, k: int, context: int, heads: tuple, dtype, device, seed: int):
    """Random q and cache with ragged contexts, and the KeyLayout a forward of `kind` gives the backend:
    decode (T=1), verify (T=K+1) or a tree step (8 branches per row, step 2, step-major own tokens).
    Returns (q, k_cache, v_cache, layout, visible [B, T, L] bool)."""
    from rollout_ssd.models.attention import KeyLayout
    from rollout_ssd.ssd.tree import tree_spans

    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([context - (7 * i) % 32 for i in range(b)])
    t = {"decode": 1, "verify": k + 1, "tree": 8}[kind]
    max_len = context + 3 * t + 8
    cache = [torch.randn(b + 1, hkv, max_len, d, generator=g).to(dtype).to(device) for _ in range(2)]
    q = torch.randn(b, hq, t, d, generator=g).to(dtype).to(device)
    keys = torch.arange(max_len)
    spans = None
    if kind == "tree":
        step, counts = 2, torch.full((b,), t)
        visible_len = starts[:, None] - torch.arange(t)[None, :] % (k + 1)
        spans = tree_spans(visible_len, starts[:, None], counts, step, k)
        write_pos = starts[:, None] + step * t + torch.arange(t)[None, :]
        visible = ((keys >= spans[..., 0, None]) & (keys < spans[..., 1, None])).any(dim=2)
        spans = spans.to(device)
    else:
        write_pos = starts[:, None] + torch.arange(t)[None, :]
        visible = keys[None, None, :] <= write_pos[:, :, None]
    read_len = int(write_pos.max()) + 1
    layout = KeyLayout(list(range(b)), True, read_len, write_pos.to(device), None, None, spans, device)
    return q, cache[0], cache[1], layout, visible[:, :, :read_len]


def one_attention(backend, q, k_cache, v_cache, layout, scale):
    return backend(q, k_cache, v_cache, backend.prepare(layout), scale)


def part_attention(device: torch.device, smoke: bool, k: int) -> dict:
    """SDPA vs the Triton backend on one layer's attention: error against float64 and time per call."""
    from rollout_ssd.models.attention import SDPABackend, TritonBackend

    heads, dtype = ((4, 2, 16), torch.float32) if smoke else ((32, 8, 128), torch.bfloat16)
    context = 32 if smoke else 2048
    backends = {"sdpa": SDPABackend()}
    if triton_here(device):
        backends["triton"] = TritonBackend()
    out = {"dtype": str(dtype), "heads": heads, "context": context, "triton": "triton" in backends}
    for kind in ("decode", "verify", "tree"):
        for b in ((1, 4) if smoke else (1, 16, 64)):
            q, kc, vc, layout, visible = attention_case(kind, b, k, context, heads, dtype, device, seed=b)
            group = heads[0] // heads[1]
            kr = kc[:b, :, :layout.read_len].double().repeat_interleave(group, dim=1)
            vr = vc[:b, :, :layout.read_len].double().repeat_interleave(group, dim=1)
            scores = (q.double() @ kr.transpose(-1, -2)) * heads[2] ** -0.5
            scores = scores.masked_fill(~visible[:, None].to(device), float("-inf"))
            expected = torch.softmax(scores, dim=-1) @ vr  # [B, Hq, T, D] float64
            row = {}
            for name, backend in backends.items():
                run = functools.partial(one_attention, backend, q, kc, vc, layout, heads[2] ** -0.5)
                row[f"{name}_err"] = (run().double() - expected).abs().max().item()
                row[f"{name}_ms"] = timed_ms(run, device, SMOKE_REPEATS if smoke else 20)
            if "triton" in backends:
                row["triton_within_2x_sdpa"] = row["triton_err"] <= 2 * row["sdpa_err"] + torch.finfo(dtype).eps / 8
            out[f"{kind}_b{b}"] = row
    return out


def part_memory(device: torch.device, smoke: bool) -> dict:
    """An engine over the random 8B target sized from free memory (utilization 0.9), then a prefill and
    a few decode steps of its largest batch; peak memory against 0.9 x the GPU. On a CPU (smoke) the
    free memory is a pretend 1 GiB device's (a few hundred slots fit)."""
    from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
    from rollout_ssd.gpu import memory
    from rollout_ssd.models.loader import LoadedModel

    model, _ = random_decoder("tiny-target" if smoke else "llama3-8b", device, torch.float32 if smoke else torch.bfloat16)
    reading = memory.device_memory
    if device.type != "cuda":
        memory.device_memory = lambda dev: (int(0.7 * 2**30), 2**30)  # pretend: 0.7 GiB free of 1
    try:
        config = EngineConfig(max_batch_size=512, max_model_len=256 if smoke else 2048, gpu_memory_utilization=0.9)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        free, total = memory.device_memory(device)
        ours_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        engine = RolloutEngine(LoadedModel(model, None, None, "random"), SpecConfig(), config)
    finally:
        memory.device_memory = reading
    slots = engine.runner.cache.num_slots
    out = {"free_gb": free / 1e9, "total_gb": total / 1e9, "slots": slots, "max_model_len": config.max_model_len,
           "kv_gb": 2 * sum(t.numel() * t.element_size() for t in engine.runner.cache.keys) / 1e9}
    batch = min(slots, 8 if smoke else 128)
    prompts = [[1 + i % 7] * (32 if smoke else 512) for i in range(batch)]
    t0 = time.perf_counter()
    try:
        engine.sample(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
        out["ran"] = True
    except Exception as err:  # an out-of-memory here means the reserve is too small: the finding
        out["ran"] = f"{type(err).__name__}: {err}"[:300]
    finally:
        engine.close()
    out["batch"], out["seconds"] = batch, time.perf_counter() - t0
    if device.type == "cuda":  # in use at the peak: other processes' memory, and this process's allocator peak
        in_use = (total - free - ours_before) + torch.cuda.max_memory_reserved(device)
        out.update(peak_in_use_gb=in_use / 1e9, budget_gb=0.9 * total / 1e9, within_budget=in_use <= 0.9 * total)
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def part_overlap(device: torch.device, smoke: bool, k: int, steps: dict) -> dict:
    """Serial vs two-stream time of one target verify (T=K+1) and K+1 draft steps at batch 1."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA streams"}
    target_name, draft_name = list(steps)[:2]
    serial = steps[target_name]["steps"][f"b1_t{k + 1}"]["graphed_ms"] + \
        (k + 1) * steps[draft_name]["steps"]["b1_t1"]["graphed_ms"]
    from rollout_ssd.gpu.graphs import GraphedSteps
    from rollout_ssd.runner import ModelRunner

    models = [random_decoder(n, device, torch.bfloat16)[0] for n in (target_name, draft_name)]
    runners = [ModelRunner(m, num_slots=1, max_len=1024) for m in models]
    for r in runners:
        r.prefill([0], [[1] * 512])
    graphs = [GraphedSteps(m, r.cache, buckets=(1,)) for m, r in zip(models, runners)]
    streams = [torch.cuda.Stream(priority=-1), torch.cuda.Stream()]

    def both():
        with torch.cuda.stream(streams[0]):
            graphs[0].run([0], [[2] * (k + 1)])
            runners[0].rollback(0, 512)
        with torch.cuda.stream(streams[1]):
            for _ in range(k + 1):
                graphs[1].run([0], [[2]])
            runners[1].rollback(0, 512)

    concurrent = timed_ms(both, device, 20)
    verify = steps[target_name]["steps"][f"b1_t{k + 1}"]["graphed_ms"]
    hidden = max(0.0, min(1.0, (serial - concurrent) / max(serial - verify, 1e-9)))
    return {"serial_ms": serial, "concurrent_ms": concurrent, "hidden_fraction": hidden}


def part_predict(steps: dict, k: int, accept: float, p_hit: float) -> dict:
    """Theorem 7 with the measured graphed costs (verify = 1 time unit), batch 1."""
    target_name, draft_name = list(steps)[:2]
    verify = steps[target_name]["steps"][f"b1_t{k + 1}"]["graphed_ms"]
    decode = steps[target_name]["steps"]["b1_t1"]["graphed_ms"]
    draft = steps[draft_name]["steps"]["b1_t1"]["graphed_ms"]
    e = (1 - accept ** (k + 1)) / (1 - accept)
    t_sd = k * draft / verify
    t_p = (draft * (k + 1)) / verify  # glue + K tree steps, each about one draft step at batch 1
    sd = e / (1 + t_sd) * decode / verify
    ssd = e / (p_hit * max(1.0, t_p) + (1 - p_hit) * (1 + t_sd)) * decode / verify
    return {"E": e, "T_SD": t_sd, "T_p": t_p, "verify_over_decode": verify / decode,
            "SD_over_AR": sd, "SSD_over_AR": ssd, "SSD_over_SD": ssd / sd}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the script's own test)")
    parser.add_argument("--parts", default="env,tests,equality,fused,attention,steps,overlap,memory,predict")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--accept", type=float, default=0.8)
    parser.add_argument("--p-hit", type=float, default=0.8)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    parts = args.parts.split(",")
    result: dict = {"bench": "gpu_check", "cpu_smoke": smoke, "k": args.k}
    runs = {
        "env": lambda: part_env(device, smoke),
        "tests": lambda: part_tests(device, smoke),
        "equality": lambda: part_equality(device, smoke),
        "fused": lambda: part_fused(device, smoke),
        "attention": lambda: part_attention(device, smoke, args.k),
        "steps": lambda: part_steps(device, smoke, args.k, result["env"]),
        "memory": lambda: part_memory(device, smoke),
        "overlap": lambda: part_overlap(device, smoke, args.k, result["steps"]),
        "predict": lambda: part_predict(result["steps"], args.k, args.accept, args.p_hit),
    }
    if "steps" in parts and "env" not in parts:
        parts.insert(0, "env")
    out_dir = os.environ.get("OUT")
    for name in parts:
        t0 = time.perf_counter()
        try:
            if name in ("overlap", "predict") and "error" in result.get("steps", {"error": None}):
                raise RuntimeError("needs the steps part's measurements, which failed or did not run")
            result[name] = runs[name]()
        except Exception as err:  # one part's failure must not cost the others' measurements
            result[name] = {"error": f"{type(err).__name__}: {err}"[:400], "where": traceback.format_exc()[-800:]}
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 2)
        print(f"gpu_check: {name} done in {result['seconds'][name]} s", file=sys.stderr, flush=True)
        if out_dir:  # after every part: a run stopped at its time limit keeps what it measured
            Path(out_dir, "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, separators=(",", ":"), default=str))
    return result


if __name__ == "__main__":
    main()
