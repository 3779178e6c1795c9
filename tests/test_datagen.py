"""Offline dataset generation (rollout_ssd/datagen.py): rows and columns, resume after kill -9 with no lost
and no duplicated rows (rows equal an uninterrupted run's, same seeds), torn writes, and bad input refused
before anything is written. A tiny random Llama with a WordLevel tokenizer; sampling at temperature 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

datasets = pytest.importorskip("datasets")

from rollout_ssd.cli import main as cli_main  # noqa: E402
from rollout_ssd.datagen import (  # noqa: E402
    GenerateConfig,
    _postfix,
    generate_dataset,
    load_generated,
    read_manifest,
)
from rollout_ssd.prompt_files import load_prompts  # noqa: E402
from tests.support.models import build_tiny  # noqa: E402
from tests.support.toolchain import needs_cxx  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("datagen")
    prompts = tmp / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(NUM_PROMPTS):
            ids = [3 + i, 5 + (i % 7), 7] + [9] * (i % 3)
            f.write(json.dumps({"prompt": " ".join(f"w{t}" for t in ids), "prompt_token_ids": ids}) + "\n")
    for name, tokenizer in (("tiny", "words"), ("bare", None)):  # V = 48; "tiny" with a word-level tokenizer
        build_tiny(tmp / name, init="transformers", tokenizer=tokenizer, vocab_size=48, intermediate_size=64)
    return {"model": str(tmp / "tiny"), "bare": str(tmp / "bare"),
            "prompts": str(prompts), "tmp": tmp}


def _config(setup, output, **overrides) -> GenerateConfig:
    kwargs = dict(input=setup["prompts"], output=str(output), model=setup["model"], method="ar", n=2,
                  temperature=1.0, max_new_tokens=6, seed=3, shard_size=4, dtype="float32", progress=False)
    kwargs.update(overrides)
    return GenerateConfig(**kwargs)


@pytest.fixture(scope="module")
def reference(setup):
    """An uninterrupted run (the kill tests' expected rows): token-id prompts, 6 shards of 2 prompts."""
    out = setup["tmp"] / "reference"
    generate_dataset(_config(setup, out, prompt_column="prompt_token_ids", shard_size=2, max_new_tokens=12))
    return out


def _rows(output) -> list[dict]:
    return load_generated(str(output)).to_list()


def _assert_each_row_once(rows, n):
    keys = [(r["prompt_index"], r["sample_index"]) for r in rows]
    assert keys == [(i, j) for i in range(NUM_PROMPTS) for j in range(n)]


def test_text_prompts_columns_and_loaders(setup, tmp_path):
    out = tmp_path / "out"
    result = generate_dataset(_config(setup, out, chat=True))
    assert (result.num_rows, result.shards_written, result.shards_skipped) == (NUM_PROMPTS * 2, 3, 0)
    rows = _rows(out)
    _assert_each_row_once(rows, 2)
    texts = [json.loads(line)["prompt"] for line in open(setup["prompts"])]
    for r in rows:
        assert r["prompt"] == texts[r["prompt_index"]]
        words = texts[r["prompt_index"]].split()
        assert r["prompt_token_ids"] == [1] + [int(w[1:]) for w in words] + [2]  # the chat template was applied
        assert len(r["token_ids"]) == len(r["logprobs"]) == 6 and r["finish_reason"] == "length"
        assert r["completion"] == " ".join(f"w{t}" for t in r["token_ids"] if t != 0)
        assert all(lp <= 0 for lp in r["logprobs"])
        assert (r["method"], r["seed"], r["weight_version"]) == ("ar", 3, 0)
    # the Hub layout: datasets finds the train split by itself
    hub = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert hub.to_list() == rows
    manifest = read_manifest(out)
    assert manifest["complete"] and sorted(manifest["shards"]) == ["0", "1", "2"]
    # rerunning a finished job writes nothing
    assert generate_dataset(_config(setup, out, chat=True)).shards_written == 0


def test_token_id_prompts_keep_global_indices(setup, reference):
    rows = _rows(reference)
    _assert_each_row_once(rows, 2)
    ids = [json.loads(line)["prompt_token_ids"] for line in open(setup["prompts"])]
    for r in rows:
        assert r["prompt"] is None
        assert r["prompt_token_ids"] == ids[r["prompt_index"]]
    # samples differ across prompts of different shards, even at the same local index (distinct seeds)
    firsts = {tuple(r["token_ids"]) for r in rows if r["sample_index"] == 0}
    assert len(firsts) == NUM_PROMPTS


def test_rows_do_not_depend_on_the_shard_size(setup, reference, tmp_path):
    """Shards pass global prompt indices, so rows equal one engine call over all prompts."""
    out = tmp_path / "shard5"
    generate_dataset(_config(setup, out, prompt_column="prompt_token_ids", shard_size=5, max_new_tokens=12))
    rows, ref = _rows(out), _rows(reference)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "logprobs"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(ref)
    # logprobs come from forwards over differently shaped batches: equal up to float32 rounding
    assert max(abs(a - b) for r, q in zip(rows, ref) for a, b in zip(r["logprobs"], q["logprobs"])) < 1e-5


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_rows(setup, reference, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "rollout_ssd.cli", "generate", "--input", setup["prompts"],
           "--prompt-column", "prompt_token_ids", "--output", str(out), "--model", setup["model"], "--n", "2",
           "--temperature", "1.0", "--max-new-tokens", "12", "--seed", "3", "--shard-size", "2",
           "--dtype", "float32", "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 45
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            manifest = read_manifest(out) if (out / "manifest.json").is_file() else None
            if manifest and manifest["shards"]:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    manifest = read_manifest(out)
    done = len(manifest["shards"])
    assert 1 <= done < 6 and not manifest["complete"]
    result = generate_dataset(_config(setup, out, prompt_column="prompt_token_ids", shard_size=2, max_new_tokens=12))
    assert result.shards_skipped == done and result.shards_written == 6 - done
    assert _rows(out) == _rows(reference)
    assert not list(out.rglob(".*.tmp"))


def test_crash_and_torn_writes_resume_exactly(setup, reference, tmp_path):
    """A crash right after a shard's manifest entry, then the states a kill can leave between the two renames:
    a shard file the manifest does not list, and a half-written tmp file."""
    out = tmp_path / "crashed"
    config = _config(setup, out, prompt_column="prompt_token_ids", shard_size=2, max_new_tokens=12)

    def crash_after_two(shard, manifest):
        if len(manifest["shards"]) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_dataset(config, on_shard_done=crash_after_two)
    # fake a run killed after writing shard 2 but before recording it, and in the middle of shard 3
    (out / "data" / "train-00002-of-00006.parquet").write_bytes(b"stale bytes from an older, killed attempt")
    (out / "data" / ".train-00003-of-00006.parquet.tmp").write_bytes(b"torn")
    (out / ".manifest.json.tmp").write_text("{")
    result = generate_dataset(config)
    assert (result.shards_skipped, result.shards_written) == (2, 4)
    assert _rows(out) == _rows(reference)
    assert not list(out.rglob(".*.tmp"))
    # a listed shard whose file went missing is generated again, even in a finished job
    (out / "data" / "train-00001-of-00006.parquet").unlink()
    result = generate_dataset(config)
    assert (result.shards_skipped, result.shards_written) == (5, 1)
    assert _rows(out) == _rows(reference)


def test_sd_greedy_rows_equal_ar(setup, tmp_path):
    """Greedy SD with the target as its own draft emits AR's tokens (float32): the method changes no row."""
    common = dict(prompt_column="prompt_token_ids", temperature=0.0, n=1, max_new_tokens=5, shard_size=6)
    generate_dataset(_config(setup, tmp_path / "ar", **common))
    generate_dataset(_config(setup, tmp_path / "sd", method="sd", draft=setup["model"], k=2, **common))
    ar, sd = _rows(tmp_path / "ar"), _rows(tmp_path / "sd")
    assert [r["token_ids"] for r in ar] == [r["token_ids"] for r in sd]
    assert {r["method"] for r in sd} == {"sd"}


@needs_cxx
def test_compile_reaches_the_engine_and_changes_no_row(setup, tmp_path, monkeypatch):
    """`rollout-ssd generate --compile` (GenerateConfig.compile) builds the engine with
    EngineConfig.compile: its steps are compiled, the rows are the eager job's (greedy, float32), and the
    flag is not part of the job's identity (a compiled run may resume an eager one's output)."""
    from rollout_ssd.engine import RolloutEngine

    made = []
    original = RolloutEngine.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        made.append(original(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(RolloutEngine, "from_pretrained", classmethod(recording))
    common = dict(prompt_column="prompt_token_ids", temperature=0.0, n=1, max_new_tokens=5, shard_size=6)
    generate_dataset(_config(setup, tmp_path / "eager", **common))
    assert cli_main(["generate", "--input", setup["prompts"], "--prompt-column", "prompt_token_ids", "--output",
                     str(tmp_path / "compiled"), "--model", setup["model"], "--n", "1", "--temperature", "0",
                     "--max-new-tokens", "5", "--shard-size", "6", "--seed", "3", "--dtype", "float32",
                     "--no-progress", "--compile"]) == 0
    assert made[0].runner.static is None and made[1].runner.static.compiled
    assert any(step.compiled is not None for step in made[1].runner.static.steps.values())
    eager, compiled = _rows(tmp_path / "eager"), _rows(tmp_path / "compiled")
    assert [r["token_ids"] for r in eager] == [r["token_ids"] for r in compiled]
    assert read_manifest(tmp_path / "eager")["job"] == read_manifest(tmp_path / "compiled")["job"]


def test_progress_postfix_reports_tokens_per_s_and_hit_rate():
    assert _postfix({"rollout/tokens_per_s": 12.4}) == {"tok/s": "12"}
    assert _postfix({"rollout/tokens_per_s": 1.0, "ssd/hit_rate": 0.756, "spec/accept_rate": 0.5}) == {
        "tok/s": "1", "hit": "0.76", "accept": "0.50"}


def test_input_formats(tmp_path):
    ds = datasets.Dataset.from_dict({"q": ["w1 w2", "w3"], "ids": [[1, 2], [3]]})
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    pq.write_table(pa.table({"q": ["w1 w2", "w3"], "ids": [[1, 2], [3]]}), tmp_path / "p.parquet")
    (tmp_path / "list.json").write_text(json.dumps([{"q": "w1 w2"}, {"q": "w3"}]))
    for path in ("saved", "p.parquet"):
        assert load_prompts(str(tmp_path / path), "q") == ["w1 w2", "w3"]
        assert load_prompts(str(tmp_path / path), "ids") == [[1, 2], [3]]
    assert load_prompts(str(tmp_path / "list.json"), "q") == ["w1 w2", "w3"]
    assert load_prompts(str(tmp_path / "dict"), "q", split="test") == ["w1 w2"]
    with pytest.raises(ValueError, match="splits"):
        load_prompts(str(tmp_path / "dict"), "q")
    with pytest.raises(ValueError, match="no column 'prompt'"):
        load_prompts(str(tmp_path / "saved"), "prompt")


def _bad_inputs(tmp: Path) -> dict:
    (tmp / "empty.jsonl").write_text("")
    (tmp / "nocol.jsonl").write_text(json.dumps({"text": "w1"}) + "\n")
    (tmp / "broken.jsonl").write_text('{"prompt": "w1"}\n{"prompt": \n')
    (tmp / "number.jsonl").write_text(json.dumps({"prompt": 5}) + "\n")
    (tmp / "blank.jsonl").write_text(json.dumps({"prompt": ""}) + "\n")
    (tmp / "prompts.csv").write_text("prompt\nw1\n")
    (tmp / "corrupt.parquet").write_bytes(b"PAR1 not really")
    pq.write_table(pa.table({"text": ["w1"]}), tmp / "nocol.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp / "empty.parquet")
    (tmp / "notadataset").mkdir()
    return {
        "empty.jsonl": "no prompts", "nocol.jsonl": "no column 'prompt'", "broken.jsonl": "not valid JSON",
        "number.jsonl": "prompt 0", "blank.jsonl": "prompt 0.*empty", "prompts.csv": "unknown format",
        "corrupt.parquet": "unreadable", "nocol.parquet": "no column 'prompt'", "empty.parquet": "no prompts",
        "notadataset": "not a dataset directory", "missing.jsonl": "does not exist",
    }


def test_bad_input_is_refused_before_anything_is_written(setup, tmp_path):
    bad = _bad_inputs(tmp_path)
    for name, message in bad.items():
        out = tmp_path / f"out-{name}"
        with pytest.raises(ValueError, match=message):
            generate_dataset(_config(setup, out, input=str(tmp_path / name)))
        assert not out.exists(), name
    far = tmp_path / "far.jsonl"
    far.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in ([1, 2], [3], [4, 99])))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt_token_ids": [1] * 200}) + "\n")
    cases = [
        (dict(chat=True, prompt_column="prompt_token_ids"), "chat=True needs text"),
        (dict(input=str(far), prompt_column="prompt_token_ids"), r"prompts\[2\] has token ids outside"),
        (dict(input=str(long), prompt_column="prompt_token_ids"), r"prompts\[0\] has 200 tokens"),
        (dict(model=setup["bare"]), "no tokenizer"),
        (dict(model=str(tmp_path / "nomodel")), "neither a built-in name"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            generate_dataset(_config(setup, tmp_path / "out-model", **overrides))
        assert not (tmp_path / "out-model").exists()
    with pytest.raises(ValueError, match="shard_size"):
        _config(setup, tmp_path / "x", shard_size=0)
    with pytest.raises(ValueError, match="method"):
        _config(setup, tmp_path / "x", method="beam")
    with pytest.raises(ValueError, match="temperature"):
        _config(setup, tmp_path / "x", temperature=-1.0)


def test_output_of_another_job_is_refused(setup, reference, tmp_path):
    before = {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()}
    base = dict(prompt_column="prompt_token_ids", shard_size=2, max_new_tokens=12)
    for change in (dict(temperature=0.5), dict(seed=4), dict(n=3), dict(shard_size=3), dict(method="sd"),
                   dict(input=setup["prompts"], prompt_column="prompt")):
        with pytest.raises(ValueError, match="different job's manifest"):
            generate_dataset(_config(setup, reference, **{**base, **change}))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="prompts_sha256"):
        generate_dataset(_config(setup, reference, **{**base, "input": str(other)}))
    assert {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()} == before
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="without a manifest.json"):
        generate_dataset(_config(setup, stranger))


def test_a_second_writer_is_refused(setup, tmp_path):
    import fcntl

    out = tmp_path / "busy"
    out.mkdir()
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="another job"):
            generate_dataset(_config(setup, out))
    assert not (out / "manifest.json").exists()


def test_cli_reports_bad_input(setup, tmp_path, capsys):
    rc = cli_main(["generate", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o"),
                   "--model", setup["model"], "--no-progress"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
