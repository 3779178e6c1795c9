"""The recipes' configuration: one YAML (or JSON) file -> typed, validated configs per component.

Every section maps onto a frozen dataclass that validates itself; an unknown key anywhere is a
ValueError naming its dotted path, raised before any model is loaded. `--set a.b=value` overrides are
parsed as YAML scalars. The `--tiny` preset swaps the model for `tiny.py`'s seeded pair and shrinks the
run so that it finishes in seconds (tests use it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rollout_ssd.config import EngineConfig, SpecConfig, require_positive_ints
from rollout_ssd.draft.follow import FollowConfig
from rollout_ssd.models.registry import INT4_DRAFT
from rollout_ssd.params import SamplingParams
from rollout_ssd.rl.learner import LearnerConfig
from rollout_ssd.rl.optim import OptimConfig


@dataclass(frozen=True)
class SyncConfig:
    """Weight sync from the learner: exact deltas allowed, their compression, bucket size, timeout (s)."""

    delta: bool = True
    compression: str = "zlib"
    bucket_bytes: int = 64 << 20
    timeout: float = 120.0

    def __post_init__(self):
        if self.compression not in ("zlib", "none"):
            raise ValueError(f"sync.compression must be 'zlib' or 'none', got {self.compression!r}")
        if self.bucket_bytes < 1 or self.timeout <= 0:
            raise ValueError("sync.bucket_bytes and sync.timeout must be positive")


@dataclass(frozen=True)
class RayConfig:
    """enabled: Ray actors (False: everything in this process, same code path minus Ray).
    address: an existing cluster ("auto" or host:port); None starts a local one bound to 127.0.0.1
    with token auth on. rollout_actors: engines that split each batch. *_cpus: Ray CPU requests.
    rollout_gpus / learner_gpus: Ray GPU requests per actor (Ray hides every GPU from an actor that
    asks for none, so an engine on `device="cuda"` needs rollout_gpus >= 1; two for SSD with its draft
    on a GPU of its own). sync_host: the address the learner's weight-sync group listens on (default
    127.0.0.1; on a cluster, the learner node's IP). threads: torch threads of each actor; None gives the
    learner every core of the machine and each rollout actor an even share of them, because the phases of
    a step run one after another (a thread count of 1 left a core idle in every phase)."""

    enabled: bool = True
    address: Optional[str] = None
    rollout_actors: int = 1
    rollout_cpus: float = 1.0
    learner_cpus: float = 1.0
    rollout_gpus: float = 0.0
    learner_gpus: float = 0.0
    num_cpus: Optional[int] = None
    sync_host: str = "127.0.0.1"
    threads: Optional[int] = None

    def __post_init__(self):
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"ray.threads must be an integer >= 1 or null, got {self.threads!r}")
        if not isinstance(self.rollout_actors, int) or self.rollout_actors < 1:
            raise ValueError(f"ray.rollout_actors must be an integer >= 1, got {self.rollout_actors!r}")
        for name in ("rollout_cpus", "learner_cpus", "rollout_gpus", "learner_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"ray.{name} must be a number >= 0, got {value!r}")

    def actor_threads(self, cores: int) -> tuple[int, int]:
        """(rollout actor, learner) torch threads on a machine of `cores` cores."""
        if self.threads is not None:
            return self.threads, self.threads
        return max(1, cores // self.rollout_actors), max(1, cores)


@dataclass(frozen=True)
class TrackingConfig:
    """out_dir: metrics.jsonl, versions.jsonl, config.json and wandb's files. wandb_mode: offline
    (default, never touches the network) | online | disabled."""

    out_dir: str = "runs/rl"
    wandb_mode: str = "offline"
    project: str = "rollout_ssd"
    run_name: Optional[str] = None
    group: Optional[str] = None

    def __post_init__(self):
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"tracking.wandb_mode must be offline, online or disabled, got {self.wandb_mode!r}")


@dataclass(frozen=True)
class RLConfig:
    """A whole run. prompts_per_step prompts x sampling.n samples per step; steps policy updates.
    drift_every: measure drift/kl_target_draft every N steps (0: never); drift_max_rollouts: on at most
    this many of the step's rollouts, drawn at random by (seed, step) (0: all of them). The defaults keep
    the diagnostic a small share of a step (bench/bench_learner.py measures it; bench/RESULTS.md,
    "Learner and diagnostics"). checkpoint_steps: save the policy and draft after these steps (0: before
    the first update) under out_dir/checkpoints (rl/checkpoints.py).
    device / draft_device: where the rollout engine runs its target and its draft
    (`RolloutEngine.from_pretrained`); the learner trains on the CPU."""

    algorithm: str = "grpo"
    model: str = "smollm2-135m-instruct"
    draft: Optional[str] = "default"
    dtype: str = "auto"
    device: str = "cpu"
    draft_device: Optional[str] = None
    task: str = "arithmetic"
    task_options: dict = field(default_factory=dict)  # keyword arguments of the task's dataset builder
    dataset_size: int = 512
    prompts_per_step: int = 4
    steps: int = 30
    seed: int = 0
    drift_every: int = 4
    drift_max_rollouts: int = 2
    checkpoint_steps: tuple = ()
    tiny: bool = False
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(n=4, temperature=1.0, max_new_tokens=64))
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(method="ssd"))
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_batch_size=16, max_model_len=512))
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    follow: FollowConfig = field(default_factory=FollowConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self):
        require_positive_ints(self, ("dataset_size", "prompts_per_step", "steps"), label="config")
        for name in ("drift_every", "drift_max_rollouts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        steps = self.checkpoint_steps
        if isinstance(steps, list):
            object.__setattr__(self, "checkpoint_steps", steps := tuple(steps))
        if not isinstance(steps, tuple) or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= self.steps
                                               for s in steps):
            raise ValueError(f"checkpoint_steps must be a list of integers in 0..steps ({self.steps}), got {steps!r}")
        if not isinstance(self.task_options, dict):
            raise ValueError(f"task_options must be a mapping, got {type(self.task_options).__name__}")
        from rollout_ssd.rl.tasks import get_task

        builder, _ = get_task(self.task)  # an unknown task fails here, before any work
        import inspect

        accepted = set(inspect.signature(builder).parameters) - {"num", "seed"}
        unknown = sorted(set(self.task_options) - accepted)
        if unknown:
            raise ValueError(f"task_options {unknown} are not options of task {self.task!r}; known: {sorted(accepted)}")
        for name in ("device", "draft_device"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value.split(":")[0] not in ("cpu", "cuda")):
                raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        on_gpu = any(str(d).startswith("cuda") for d in (self.device, self.draft_device) if d is not None)
        if on_gpu and self.ray.enabled and self.ray.rollout_gpus <= 0:
            raise ValueError(f"device={self.device!r} with Ray needs ray.rollout_gpus >= 1 (Ray hides GPUs from "
                             "an actor that requests none)")
        if self.draft == INT4_DRAFT and self.follow.mode != "frozen":
            raise ValueError("follow.mode must be 'frozen' with draft='target-int4': that draft is the policy's own "
                             f"weights in int4 and takes every policy update as it is, got {self.follow.mode!r}")
        if self.learner.algorithm != self.algorithm:
            raise ValueError(f"learner.algorithm {self.learner.algorithm!r} differs from algorithm {self.algorithm!r}")

    def to_dict(self) -> dict:
        from rollout_ssd.rl.tracking import jsonable_config

        return jsonable_config(self)


SECTIONS = {"sampling": SamplingParams, "spec": SpecConfig, "engine": EngineConfig, "follow": FollowConfig,
            "sync": SyncConfig, "ray": RayConfig, "tracking": TrackingConfig}
TUPLE_FIELDS = {("sampling", "stop_token_ids"), ("spec", "fanout"), ("optim", "betas")}

TINY = {
    "dataset_size": 64, "prompts_per_step": 2, "steps": 3, "drift_every": 1,
    "sampling": {"n": 4, "temperature": 1.0, "max_new_tokens": 12},
    "spec": {"method": "ssd", "k": 3},
    "engine": {"max_batch_size": 8, "max_model_len": 192},
    "learner": {"micro_batch": 8, "optim": {"lr": 1e-3}},
    "follow": {"steps": 2, "batch_tokens": 256, "lr": 1e-3, "top_k": 16},
    "ray": {"rollout_cpus": 0, "learner_cpus": 0},
}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _build(cls, options: Any, path: str):
    if not isinstance(options, dict):
        raise ValueError(f"config section {path!r} must be a mapping, got {type(options).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"config: unknown key(s) {[f'{path}.{k}' for k in unknown]}; known in {path}: {sorted(known)}")
    section = path.rsplit(".", 1)[-1]
    kwargs = {k: tuple(v) if (section, k) in TUPLE_FIELDS and isinstance(v, list) else v for k, v in options.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config section {path!r}: {err}") from None


def build_config(options: dict) -> RLConfig:
    """A validated RLConfig from a plain mapping (file contents after overrides)."""
    if not isinstance(options, dict):
        raise ValueError("the config must be a mapping at its top level")
    options = dict(options)
    if options.get("tiny"):
        options = _merge(TINY, options)
    known = {f.name for f in dataclasses.fields(RLConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown}; known: {sorted(known)}")
    kwargs = {k: v for k, v in options.items() if k not in SECTIONS and k != "learner"}
    for name, cls in SECTIONS.items():
        if name in options:
            kwargs[name] = _build(cls, options[name], name)
    learner = dict(options.get("learner") or {})
    learner.setdefault("algorithm", options.get("algorithm", "grpo"))
    if "optim" in learner:
        learner["optim"] = _build(OptimConfig, learner["optim"], "learner.optim")
    kwargs["learner"] = _build(LearnerConfig, learner, "learner")
    try:
        return RLConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config: {err}") from None


def yaml_load(text: str):
    """yaml.safe_load, except that 1e-6 is a float (YAML 1.1 reads exponents without a dot as strings)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?[0-9][0-9_]*\.[0-9_]*$"),
        list("-+0123456789."))
    return yaml.load(text, Loader=Loader)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {text!r} has an empty key")
    return key.split("."), yaml_load(raw)


def load_config(path: Optional[str | Path], overrides: list[str] = (), tiny: bool = False, **defaults) -> RLConfig:
    """The recipe's config: file (YAML/JSON) <- `defaults` (e.g. algorithm) <- --tiny <- --set overrides."""
    import yaml

    options: dict = dict(defaults)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        try:
            text = path.read_text()
            loaded = json.loads(text) if path.suffix == ".json" else yaml_load(text)
        except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as err:
            raise ValueError(f"config file {str(path)!r} is unreadable: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping")
        options = _merge(options, loaded or {})
    if tiny:
        options["tiny"] = True
    for text in overrides:
        keys, value = parse_override(text)
        node = options
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {text!r}: {k!r} is not a section")
        node[keys[-1]] = value
    return build_config(options)
