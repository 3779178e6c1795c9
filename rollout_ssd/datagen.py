"""Offline dataset generation: prompts in, a Hugging Face `datasets` dataset of rollouts out, in shards
that survive a kill -9.

Output layout (DIR = `GenerateConfig.output`):
```
DIR/manifest.json                          the job (every argument that changes a row) + completed shards
DIR/data/train-00000-of-00012.parquet      one shard = `shard_size` consecutive prompts x n samples
...
```
The shard names follow the Hub's convention, so the finished dataset loads with
`datasets.load_dataset(DIR, split="train")` or `load_dataset("parquet", data_files=f"{DIR}/data/*.parquet")`,
or without the HF cache with `load_generated(DIR)`; no second merged copy is written.

Crash safety: a shard is written to a hidden tmp file, fsynced and `os.replace`d into place; only then is
it recorded in the manifest (also tmp + fsync + `os.replace`). A restart reads the manifest and regenerates
every shard it does not list, under the same file name, so a kill at any point loses nothing and
duplicates nothing. A restart with different arguments (or different prompts) is refused.

Seeding: each shard is one `sample` call that passes its prompts' global indices, so sample j of
prompt i is seeded by (seed, i, j) exactly as in one uninterrupted call: rows do not depend on the
shard size, and no two rows share a random stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from rollout_ssd import metric_names as names
from rollout_ssd.config import METHODS
from rollout_ssd.prompt_files import Prompt, load_prompts

log = logging.getLogger(__name__)
FORMAT = "rollout_ssd.datagen/1"
MANIFEST = "manifest.json"
DATA_DIR = "data"
SEED_SCHEME = "seed, global prompt index"


@dataclass(frozen=True)
class GenerateConfig:
    """One generation job. `shard_size` counts prompts (a shard holds shard_size * n rows)."""

    input: str
    output: str
    prompt_column: str = "prompt"
    split: Optional[str] = None  # for an input DatasetDict with several splits
    model: str = "smollm2-135m-instruct"
    method: str = "ar"
    draft: Optional[str] = "default"  # ignored for method "ar"
    k: int = 4
    dtype: str = "auto"
    device: str = "cpu"
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0
    shard_size: int = 64
    chat: bool = False
    progress: bool = True
    compile: bool = False  # EngineConfig.compile: the target's and SD's draft's steps compiled (fixed weights)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"GenerateConfig.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.shard_size, int) or isinstance(self.shard_size, bool) or self.shard_size < 1:
            raise ValueError(f"GenerateConfig.shard_size must be an integer >= 1, got {self.shard_size!r}")
        if not self.prompt_column:
            raise ValueError("GenerateConfig.prompt_column must be a column name")
        if self.method == "ar" or self.draft in ("", "none", "None"):
            object.__setattr__(self, "draft", None)
        self.sampling_params()  # SamplingParams validates n, temperature, top_p, top_k, max_new_tokens, seed

    def sampling_params(self, seed: Optional[int] = None):
        from rollout_ssd.params import SamplingParams

        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, seed=self.seed if seed is None else seed,
                              chat=self.chat)

    def job(self, prompts: list[Prompt]) -> dict:
        """Everything a row depends on (the manifest's identity). The input path, output path, device,
        compile and progress flags are not part of it: moving the prompt file or resuming on another device
        is allowed."""
        keys = ("prompt_column", "split", "model", "method", "draft", "k", "dtype", "n", "temperature", "top_p",
                "top_k", "max_new_tokens", "seed", "shard_size", "chat")
        job = {key: getattr(self, key) for key in keys}
        job["temperature"], job["top_p"] = float(self.temperature), float(self.top_p)
        job.update(num_prompts=len(prompts), prompts_sha256=_sha256_json(prompts), seed_scheme=SEED_SCHEME)
        return job


@dataclass(frozen=True)
class GenerateResult:
    output: Path
    num_rows: int
    shards_written: int
    shards_skipped: int


# ---------------------------------------------------------------------------------------------- output
def _shard_name(shard: int, num_shards: int) -> str:
    return f"{DATA_DIR}/train-{shard:05d}-of-{num_shards:05d}.parquet"


def _sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) then fsync and rename over `path`: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_manifest(output: Path) -> Optional[dict]:
    path = Path(output) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"output {str(output)!r}: {MANIFEST} is unreadable: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"output {str(output)!r}: {MANIFEST} is not a {FORMAT} manifest")
    return manifest


def _check_output(output: Path, job: dict) -> Optional[dict]:
    """The existing manifest of this same job (None for a fresh output); ValueError for anything else."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"output {str(output)!r} exists and is not a directory")
    manifest = read_manifest(output) if output.is_dir() else None
    if manifest is None:
        if output.is_dir() and not _only_our_layout(output):
            raise ValueError(f"output {str(output)!r} is a non-empty directory without a {MANIFEST}; "
                             f"refusing to write into it")
        return None
    if manifest.get("job") != job:
        old = manifest.get("job") or {}
        diff = [f"{key}: {old.get(key)!r} -> {job.get(key)!r}" for key in sorted(set(old) | set(job))
                if old.get(key) != job.get(key)]
        raise ValueError(f"output {str(output)!r} holds a different job's manifest; differences: {'; '.join(diff)}")
    for shard, entry in list(manifest["shards"].items()):
        if not (output / entry["file"]).is_file():
            log.warning("output %s: shard %s (%s) is missing; it will be generated again", output, shard, entry["file"])
            del manifest["shards"][shard]
            manifest["complete"] = False
    return manifest


def _only_our_layout(output: Path) -> bool:
    """True for an empty directory, or one a run killed before its first manifest left (a lock, an empty data/)."""
    for entry in output.iterdir():
        if entry.name == ".lock" and entry.is_file():
            continue
        if entry.name == DATA_DIR and entry.is_dir() and not any(entry.iterdir()):
            continue
        return False
    return True


def _rows_table(rollouts, prompts: list[Prompt], first_prompt: int, config: GenerateConfig):
    import pyarrow as pa

    n = config.n
    if len(rollouts) != len(prompts) * n:
        raise RuntimeError(f"engine returned {len(rollouts)} rollouts for {len(prompts)} prompts x n={n}")
    for pos, r in enumerate(rollouts):
        if (r.prompt_index, r.sample_index) != (first_prompt + pos // n, pos % n):
            raise RuntimeError(f"engine rollouts out of order at {pos}: ({r.prompt_index}, {r.sample_index})")
    columns = {
        "prompt_index": pa.array([r.prompt_index for r in rollouts], pa.int64()),
        "sample_index": pa.array([r.sample_index for r in rollouts], pa.int32()),
        "prompt": pa.array([_text_or_none(prompts[r.prompt_index - first_prompt]) for r in rollouts], pa.string()),
        "prompt_token_ids": pa.array([r.prompt_token_ids for r in rollouts], pa.list_(pa.int32())),
        "completion": pa.array([r.text for r in rollouts], pa.string()),
        "token_ids": pa.array([r.token_ids for r in rollouts], pa.list_(pa.int32())),
        "logprobs": pa.array([r.logprobs for r in rollouts], pa.list_(pa.float32())),
        "finish_reason": pa.array([r.finish_reason for r in rollouts], pa.string()),
        "weight_version": pa.array([r.weight_version for r in rollouts], pa.int64()),
        "method": pa.array([config.method] * len(rollouts), pa.string()),
        "seed": pa.array([config.seed] * len(rollouts), pa.int64()),
    }
    return pa.table(columns)


def _text_or_none(prompt: Prompt) -> Optional[str]:
    return prompt if isinstance(prompt, str) else None


def load_generated(output: str, allow_partial: bool = False):
    """The generated rows as a `datasets.Dataset`, read straight from the manifest's shards (in memory, no
    HF cache), ordered by (prompt_index, sample_index). A partial job raises unless allow_partial."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    output = Path(output)
    manifest = read_manifest(output)
    if manifest is None:
        raise ValueError(f"output {str(output)!r} has no {MANIFEST}")
    if not manifest["complete"] and not allow_partial:
        raise ValueError(f"output {str(output)!r} is incomplete ({len(manifest['shards'])} of "
                         f"{manifest['num_shards']} shards); resume the job or pass allow_partial=True")
    shards = sorted(manifest["shards"].values(), key=lambda s: s["first_prompt"])
    tables = [pq.read_table(output / s["file"]) for s in shards]
    table = pa.concat_tables(tables) if tables else None
    return datasets.Dataset(table) if table is not None else datasets.Dataset.from_dict({})


# ---------------------------------------------------------------------------------------------- the job
def generate_dataset(config: GenerateConfig,
                     on_shard_done: Optional[Callable[[int, dict], None]] = None) -> GenerateResult:
    """Run (or resume) a generation job. Input, output and model problems raise ValueError before anything
    is written. `on_shard_done(shard, manifest)` runs after each shard's manifest entry is durable."""
    prompts = load_prompts(config.input, config.prompt_column, config.split)
    if config.chat and any(not isinstance(p, str) for p in prompts):
        bad = next(i for i, p in enumerate(prompts) if not isinstance(p, str))
        raise ValueError(f"prompt {bad}: chat=True needs text prompts, got token ids")
    job = config.job(prompts)
    output = Path(config.output)
    manifest = _check_output(output, job)
    num_shards = math.ceil(len(prompts) / config.shard_size)
    if manifest is not None and manifest["complete"]:
        return GenerateResult(output, len(prompts) * config.n, 0, num_shards)

    engine = _load_engine(config)
    try:
        # Tokenize (and chat-template) every prompt now: a bad one is named by its global index before anything
        # is written, and the shards then pass token ids (chat already applied).
        token_ids = engine.tokenize(prompts, config.sampling_params())
        with _locked(output):
            manifest = _check_output(output, job) or {"format": FORMAT, "job": job, "input": str(config.input),
                                                      "num_shards": num_shards, "shards": {}, "complete": False}
            return _run_shards(config, engine, prompts, token_ids, output, manifest, on_shard_done)
    finally:
        engine.close()


def _load_engine(config: GenerateConfig):
    from rollout_ssd.config import SpecConfig
    from rollout_ssd.engine import RolloutEngine

    spec = SpecConfig(method=config.method, k=config.k)
    return RolloutEngine.from_pretrained(config.model, draft=config.draft, spec=spec, dtype=config.dtype,
                                         device=config.device, compile=config.compile)


@contextlib.contextmanager
def _locked(output: Path):
    """Create the output layout and hold an exclusive lock on it (the OS releases it on kill -9); then delete
    the tmp files of a killed run (torn writes, never listed in the manifest)."""
    (output / DATA_DIR).mkdir(parents=True, exist_ok=True)
    with open(output / ".lock", "w") as lock:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                raise ValueError(f"output {str(output)!r} is being written by another job") from err
        for stale in list(output.glob(".*.tmp")) + list((output / DATA_DIR).glob(".*.tmp")):
            stale.unlink()
        yield


def _run_shards(config: GenerateConfig, engine, prompts: list[Prompt], token_ids: list[list[int]], output: Path,
                manifest: dict, on_shard_done) -> GenerateResult:
    import pyarrow.parquet as pq

    num_shards, n = manifest["num_shards"], config.n
    todo = [s for s in range(num_shards) if str(s) not in manifest["shards"]]
    done_rows = sum(entry["rows"] for entry in manifest["shards"].values())
    _atomic_write(output / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
    bar = _progress_bar(config, total=len(prompts) * n, initial=done_rows)
    try:
        for shard in todo:
            first = shard * config.shard_size
            chunk = prompts[first:first + config.shard_size]
            params = dataclasses.replace(config.sampling_params(), chat=False)
            rollouts = engine.sample(token_ids[first:first + config.shard_size], params,
                                     prompt_indices=range(first, first + len(chunk)))
            table = _rows_table(rollouts, chunk, first, config)
            table = table.replace_schema_metadata({"rollout_ssd.datagen": json.dumps(manifest["job"])})
            name = _shard_name(shard, num_shards)
            _atomic_write(output / name, lambda tmp, table=table: pq.write_table(table, tmp))
            manifest["shards"][str(shard)] = {"file": name, "first_prompt": first, "num_prompts": len(chunk),
                                              "rows": table.num_rows,
                                              "tokens": sum(len(r.token_ids) for r in rollouts)}
            manifest["complete"] = len(manifest["shards"]) == num_shards
            _atomic_write(output / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
            log.info("shard %d/%d written (%d rows)", shard + 1, num_shards, table.num_rows)
            if bar is not None:
                bar.update(table.num_rows)
                bar.set_postfix(_postfix(engine.metrics()), refresh=False)
            if on_shard_done is not None:
                on_shard_done(shard, manifest)
    finally:
        if bar is not None:
            bar.close()
    return GenerateResult(output, len(prompts) * n, len(todo), num_shards - len(todo))


def _progress_bar(config: GenerateConfig, total: int, initial: int):
    if not config.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=f"generate [{config.method}]", unit="row")


def _postfix(metrics: dict) -> dict:
    out = {"tok/s": f"{metrics.get(names.ROLLOUT_TOKENS_PER_S, 0.0):.0f}"}
    if names.SSD_HIT_RATE in metrics:
        out["hit"] = f"{metrics[names.SSD_HIT_RATE]:.2f}"
    if names.SPEC_ACCEPT_RATE in metrics:
        out["accept"] = f"{metrics[names.SPEC_ACCEPT_RATE]:.2f}"
    return out


def config_from_args(args) -> GenerateConfig:
    """A GenerateConfig from the CLI's argparse namespace (every GenerateConfig field by its own name)."""
    fields = {f.name for f in dataclasses.fields(GenerateConfig)}
    return GenerateConfig(**{key: value for key, value in vars(args).items() if key in fields})
