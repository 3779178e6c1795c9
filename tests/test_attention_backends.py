"""The attention backends (models/attention.py, issue 17 part B): SDPA with a dense mask, and the
span-based Triton kernel for decode, verify and SSD's tree steps.

In this process (no triton import): choosing a backend and its errors; the tree's key spans by hand;
SDPA given spans equal to SDPA given the same visibility as a mask, bit for bit.

In a child process with TRITON_INTERPRET=1 (it must be set before triton is first imported, and
setting it here would interpret every Triton kernel of the session; tests/test_tree_attention.py does
the same): a random decoder runs with the Triton backend while a recorder keeps its first layer's
queries, cache and output for each forward (decode with ragged and with equal lengths, verify with
padded rows, two tree steps, and a prefill that must go to SDPA). Every real query's output must lie
within tests/support/attention_bound.py's rounding-error bound of float64 attention over the keys that
query may see, derived here from what the forward was given (not from the backend's spans), in
float32 and bfloat16. Then tiny engines with attention="triton" must produce the same greedy tokens as
attention="sdpa" for AR (eager and static steps), SD and SSD, in float32: the backends differ by
float32 rounding (~1e-7 relative in the logits), which flips a greedy token only at a near-tie that
close; the cases are seeded, so the outcome is the same on every run, and logprobs agree within 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.models.attention import SDPABackend, auto_attention, select_backend
from rollout_ssd.runner import ModelRunner
from rollout_ssd.ssd.tree import tree_spans
from tests.support.attention_bound import attention_error_bound
from tests.support.ran import assert_ran

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3], list(range(4, 24)), [6, 7]]  # the 20-token prompt's prefill goes through SDPA
ENGINES = [  # name, method, SpecConfig extras, cuda_graphs
    ("ar", "ar", {}, False),
    ("ar-static-steps", "ar", {}, True),
    ("sd", "sd", {}, False),
    ("ssd", "ssd", {"worker": False, "strategy_rule": False}, False),
]


# ---------------------------------------------------------------- choosing a backend


def test_select_backend_and_its_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert isinstance(select_backend("sdpa", "cpu"), SDPABackend)
    assert isinstance(select_backend("auto", "cpu"), SDPABackend)
    assert isinstance(select_backend("auto", "cpu", static_steps=True), SDPABackend)
    assert isinstance(select_backend("auto", "meta"), SDPABackend)
    # auto on CUDA: the span kernel under captured steps (measured faster there on an H200), else SDPA
    # (asked of auto_attention: building the Triton backend would import triton in this process)
    assert auto_attention("cuda", static_steps=False) == "sdpa" and auto_attention("cpu", static_steps=True) == "sdpa"
    has_triton = importlib.util.find_spec("triton") is not None
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H200
    assert auto_attention("cuda:0", static_steps=True) == ("triton" if has_triton else "sdpa")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # no bf16 dots
    assert auto_attention("cuda:0", static_steps=True) == "sdpa"
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: not measured
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    assert auto_attention("cuda:0", static_steps=True) == "sdpa"
    with pytest.raises(ValueError, match="EngineConfig.attention='triton' on a CPU runs only under Triton's interpreter"):
        select_backend("triton", "cpu")
    with pytest.raises(ValueError, match="EngineConfig.attention must be one of"):
        select_backend("flash", "cpu")
    with pytest.raises(ValueError, match="EngineConfig.attention must be one of"):
        EngineConfig(attention="flash")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # triton not installed
    assert auto_attention("cuda", static_steps=True) == "sdpa"


def test_the_engine_asks_auto_for_captured_steps_for_the_target_alone(tmp_path, monkeypatch):
    """attention="auto" differs by whether a model's steps are captured: the engine says so for the
    target (cuda_graphs) and never for the draft, whose steps run eagerly."""
    from rollout_ssd import engine as engine_module
    from tests.support.models import tiny_pair

    # ran-check: which backend each model is asked for at construction only; no engine samples
    asked = []
    monkeypatch.setattr(engine_module, "select_backend",
                        lambda name, device, static_steps=False: asked.append((name, static_steps)) or SDPABackend())
    target, draft = tiny_pair(tmp_path, vocab=48)
    for graphs in (False, True):
        asked.clear()
        engine = RolloutEngine(target, SpecConfig(method="sd", k=3),
                               EngineConfig(max_batch_size=2, max_model_len=32, cuda_graphs=graphs), draft=draft)
        engine.close()
        assert asked == [("auto", graphs), ("auto", False)]  # the target, then the draft


def test_engine_sets_each_models_backend(tmp_path, monkeypatch):
    from tests.support.models import tiny_pair

    # ran-check: the backend set on each model at construction, and a refusal; no engine samples
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    target, draft = tiny_pair(tmp_path, vocab=48)
    engine = RolloutEngine(target, SpecConfig(method="sd", k=3), EngineConfig(max_batch_size=2, max_model_len=32,
                                                                              attention="sdpa"), draft=draft)
    assert isinstance(target.model.backend, SDPABackend) and isinstance(draft.model.backend, SDPABackend)
    engine.close()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        RolloutEngine(target, SpecConfig(), EngineConfig(max_batch_size=2, max_model_len=32, attention="triton"))


# ---------------------------------------------------------------- the tree's spans


def test_tree_spans_by_hand():
    """Two rows; glue ends at 7 and 9; row 0 has 3 branches of depths (0, 1, 1) over 5 committed tokens,
    row 1 has 2. At step 1 each branch sees its prefix and its own tokens, N_r apart (step-major)."""
    visible = torch.tensor([[5, 6, 6], [8, 9, 0]])  # n + j; row 1's third column is padding
    ends, counts = torch.tensor([[7], [9]]), torch.tensor([3, 2])
    spans = tree_spans(visible, ends, counts, step=1, k=3)
    assert spans.shape == (2, 3, 4, 2)
    keys = lambda r, c: sorted(k for lo, hi in spans[r, c].tolist() for k in range(lo, hi))  # noqa: E731
    assert keys(0, 0) == [0, 1, 2, 3, 4, 7, 10]  # own tokens at 7 + 0 and 7 + 3
    assert keys(0, 2) == [0, 1, 2, 3, 4, 5, 9, 12]
    assert keys(1, 1) == list(range(9)) + [10, 12]  # own tokens at 9 + 1 and 9 + 2 + 1
    assert spans[:, :, 3].abs().sum() == 0  # step 2's span: empty


def test_sdpa_given_spans_equals_sdpa_given_the_mask(tmp_path):
    """A tree step through `spans=` and through the equivalent dense `mask=`: the same bits."""
    from tests.support.models import tiny_pair

    target, _ = tiny_pair(tmp_path, vocab=48)
    outs = []
    for form in ("spans", "mask"):
        runner = ModelRunner(target.model, num_slots=3, max_len=32)
        runner.prefill([0, 2], [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]])
        visible = torch.tensor([[5, 6, 6], [8, 9, 0]])
        ends, counts = torch.tensor([[7], [9]]), torch.tensor([3, 2])
        feed = [[3, 4, 5], [6, 7]]
        for step in range(2):
            spans = tree_spans(visible, ends, counts, step, k=3)
            keys = torch.arange(32)
            mask = ((keys >= spans[..., 0, None]) & (keys < spans[..., 1, None])).any(dim=2)
            given = {"spans": spans} if form == "spans" else {"mask": mask}
            outs.append(runner.extend([0, 2], feed, positions=visible + step, **given))
    for a, b in zip(outs[:2], outs[2:]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1, :2], b[1, :2])  # padded column: garbage


# ---------------------------------------------------------------- the Triton backend, interpreted


def _random_decoder(dtype: torch.dtype):
    from rollout_ssd.models.config import ModelConfig
    from rollout_ssd.models.decoder import Decoder

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False, max_position_embeddings=128, bos_token_id=None,
                      eos_token_ids=())
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    model = Decoder(cfg, inv_freq, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if p.dim() < 2 else p.shape[-1] ** -0.5) + (p.dim() < 2))
    return model


def _backend_worker(out_path: str) -> None:
    """Child (TRITON_INTERPRET=1): a random decoder with a recording Triton backend; saves per forward
    what it was given and the first layer's q, cache and output."""
    from rollout_ssd.models.attention import SpanRead, TritonBackend

    class Recorder(TritonBackend):
        def __init__(self):
            super().__init__(block_n=16)
            self.first_layer, self.records = None, []

        def __call__(self, q, k_cache, v_cache, prepared, scale):
            out = super().__call__(q, k_cache, v_cache, prepared, scale)
            if k_cache is self.first_layer:
                self.records.append(dict(q=q.clone(), k=k_cache.clone(), v=v_cache.clone(), out=out.clone(),
                                         kernel=isinstance(prepared, SpanRead)))
            return out

    saved = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _random_decoder(dtype)
        model.backend = recorder = Recorder()
        runner = ModelRunner(model, num_slots=5, max_len=64)
        recorder.first_layer = runner.cache.keys[0]
        forwards = []

        def run(name, slots, tokens, spans=None, positions=None, runner=runner, forwards=forwards):
            forwards.append(dict(name=name, slots=slots, starts=[runner.length(s) for s in slots],
                                 num_new=[len(t) for t in tokens], spans=spans))
            runner.extend(slots, tokens, positions=positions, spans=spans)

        run("prefill", [0, 2, 3], [list(range(1, 21)), list(range(2, 9)), list(range(3, 15))])
        run("decode", [0, 2, 3], [[5], [6], [7]])                      # ragged ends 21, 8, 13
        run("prefill-short", [1, 4], [list(range(9)), list(range(10, 19))])  # 9 tokens per row: the kernel
        run("decode-equal", [1, 4], [[3], [4]])                        # every query sees every key
        run("verify", [0, 2, 3], [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13]])  # T = K+1, padded rows
        ends = torch.tensor([[runner.length(2)], [runner.length(3)]])
        visible, counts = ends - torch.tensor([[3, 2, 1], [4, 4, 0]]), torch.tensor([3, 2])
        for step in range(2):
            run(f"tree-step{step}", [2, 3], [[1, 2, 3], [4, 5]], spans=tree_spans(visible, ends, counts, step, k=3),
                positions=visible + step)
        saved[str(dtype)] = [dict(f, **r) for f, r in zip(forwards, recorder.records)]
    torch.save(saved, out_path)


def _sample_all(directory: Path, attention: str, device: str = "cpu") -> dict:
    """Greedy rollouts of every ENGINES case with `attention` on `device`: name -> [(token ids, logprobs)]."""
    from rollout_ssd.models.loader import load_pretrained

    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    out = {}
    for name, method, extras, graphs in ENGINES:
        target = load_pretrained(str(directory / "target"), dtype="float32")
        target.model.to(device)
        draft = None if method == "ar" else load_pretrained(str(directory / "draft"), dtype="float32")
        if draft is not None:
            draft.model.to(device)
        engine = RolloutEngine(target, SpecConfig(method=method, k=3, **extras),
                               EngineConfig(max_batch_size=4, max_model_len=64, cuda_graphs=graphs,
                                            attention=attention), draft=draft)
        try:
            assert type(target.model.backend).__name__ == ("TritonBackend" if attention == "triton" else "SDPABackend")
            out[name] = [(r.token_ids, r.logprobs) for r in engine.sample(PROMPTS, params)]
            if method != "ar":  # SD verified proposals; SSD ran its rounds (the rule is off)
                assert_ran(engine, {"sd": "spec", "ssd": "ssd"}[method])
        finally:
            engine.close()
    return out


def _engine_worker(directory: str, out_path: str) -> None:
    torch.save(_sample_all(Path(directory), "triton"), out_path)


def _run_child(*args: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _visible(forward: dict, b: int, i: int, max_len: int) -> torch.Tensor:
    """[L] bool: the keys query i of row b may see, from what the forward was given."""
    keys = torch.arange(max_len)
    if forward["spans"] is None:
        return keys < forward["starts"][b] + i + 1
    return ((keys >= forward["spans"][b, i, :, 0, None]) & (keys < forward["spans"][b, i, :, 1, None])).any(0)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """The backend child's records, per dtype (one child process for both dtypes)."""
    pytest.importorskip("triton", reason="triton is not installed")
    out = tmp_path_factory.mktemp("triton_backend") / "records.pt"
    _run_child("backend", str(out))
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_within_rounding_error_bound(recorded, dtype):
    forwards = recorded[str(dtype)]
    assert [f["kernel"] for f in forwards] == [False] + [True] * 6  # a prefill of 20 tokens: SDPA
    for f in forwards:
        if not f["kernel"]:
            continue
        rows = [(b, i) for b in range(len(f["slots"])) for i in range(f["num_new"][b])]
        q = torch.stack([f["q"][b, :, i] for b, i in rows])                 # [Nq, Hq, D]
        slot = torch.tensor([f["slots"][b] for b, _ in rows])
        visible = torch.stack([_visible(f, b, i, f["k"].shape[2]) for b, i in rows])
        expected, bound = attention_error_bound(q, f["k"], f["v"], slot, visible, dtype)
        got = torch.stack([f["out"][b, :, i] for b, i in rows])
        assert got.dtype == dtype
        error = (got.double() - expected).abs()
        assert bool((error <= bound).all()), (f["name"], (error / bound).max().item())


@pytest.mark.slow
def test_triton_engines_equal_sdpa_engines(tmp_path):
    pytest.importorskip("triton", reason="triton is not installed")
    from tests.support.models import tiny_pair

    tiny_pair(tmp_path, vocab=48)
    _run_child("engines", str(tmp_path), str(tmp_path / "triton.pt"))
    got, want = torch.load(tmp_path / "triton.pt"), _sample_all(tmp_path, "sdpa")
    for name, *_ in ENGINES:
        assert [t for t, _ in got[name]] == [t for t, _ in want[name]], name
        for (_, a), (_, b) in zip(got[name], want[name]):
            assert a == pytest.approx(b, abs=1e-5), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_triton_engines_equal_sdpa_engines_on_cuda(tmp_path):
    """The same equality with the compiled kernel, both engines on the GPU."""
    pytest.importorskip("triton", reason="triton is not installed")
    from tests.support.models import tiny_pair

    tiny_pair(tmp_path, vocab=48)
    got, want = _sample_all(tmp_path, "triton", "cuda"), _sample_all(tmp_path, "sdpa", "cuda")
    for name, *_ in ENGINES:
        assert [t for t, _ in got[name]] == [t for t, _ in want[name]], name


if __name__ == "__main__":
    if sys.argv[1] == "backend":
        _backend_worker(sys.argv[2])
    elif sys.argv[1] == "engines":
        _engine_worker(sys.argv[2], sys.argv[3])
