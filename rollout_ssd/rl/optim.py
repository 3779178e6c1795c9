"""The learner's optimizer: plain torch AdamW, or DeepSpeed ZeRO stage 0-2 on CPU, behind one interface.

A `Trainer` owns the update of a list of parameters: the learner runs its forwards (with `trainer.module`
or its own model), calls `backward(loss)` once per micro-batch (gradients add up, as in torch) and
`step()` once per update. `step()` clips to `grad_clip`, applies AdamW and clears the gradients.

    TorchTrainer      torch.optim.AdamW + torch.nn.utils.clip_grad_norm_
    DeepSpeedTrainer  deepspeed.initialize with DeepSpeed's own AdamW section and `gradient_clipping`

Both run the same AdamW arithmetic (DeepSpeed is told `torch_adam`, so it builds torch.optim.AdamW; no
C++ op is compiled), so a DeepSpeed run equals the torch run bit for bit whenever clipping is inactive.
When it clips, DeepSpeed's factor is an ulp from torch's (its norm is the root of summed squared
per-tensor norms, and ZeRO scales by 1/((norm + 1e-6)/clip) where torch scales by clip/(norm + 1e-6)).

DeepSpeed in a learner that shares torch.distributed with bystanders. In our Ray learner the default
world may already include rollout actors that only receive weight broadcasts. A collective issued on
the world (or a `new_group` that every rank must join) would wait for them forever. So DeepSpeed gets
its data-parallel group through an `mpu` ("model parallelism unit", the object Megatron passes): its
data-parallel group is the learner's group (default: this rank alone, built with
`new_group(use_local_synchronization=True)`, which only the members join), its model-parallel group a
group of this rank alone. With an mpu, DeepSpeed takes every group it reduces over (gradients, norms,
ZeRO partitions, the initial parameter broadcast) from it and never clones the world group (the tests
record every collective DeepSpeed issues beside a bystander rank).

DeepSpeed on a CPU-only machine (0.19.8), what this wrapper does about it:
- Accelerator: DeepSpeed picks "cpu" when it finds no GPU; we set DS_ACCELERATOR=cpu if absent before
  importing it, so a CPU learner stays on CPU on a GPU host too. The CPU accelerator needs neither
  intel_extension_for_pytorch nor oneccl: without oneccl_bindings_for_pytorch it talks gloo.
- The shared-memory all-reduce op: DeepSpeed's torch comm backend JIT-compiles `deepspeed_shm_comm` the
  first time it starts (about 80 s on 2 cores, then cached in ~/.cache/torch_extensions), and when
  LOCAL_SIZE equals the world size its initializer spins until every world rank maps its segment,
  bystanders included. It only serves `inference_all_reduce`, never training, so we mark it
  incompatible in `deepspeed.ops.__compatible_ops__` (a module-level dict; DeepSpeed keeps edits to it)
  before the backend starts.
- LOCAL_RANK must be set (the engine reads it): "0" if absent.
- No process group yet: we start a single-rank gloo world on an in-memory HashStore (no port, no
  MASTER_* variables). fp16/bf16 stay off (fp32 on CPU).
- Gradient accumulation is the caller's: `managed_gradient_accumulation: false`, so backward() only
  accumulates and step() is the boundary (reduce, clip, update), however many backward calls came before.
  ZeRO stage 2 still reduces each backward into its partitions, which its zero_grad() does not clear,
  so on stage 2 zero_grad() between backward() and step() raises instead of silently keeping them.
- DeepSpeed owns exactly `params`: they are handed to the engine in a small holder module (the engine
  clips, zeroes and broadcasts its module's parameters), whose forward calls the real module.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

# Top-level DeepSpeed keys a user may set, and those the wrapper fills in from OptimConfig.
DEEPSPEED_KEYS = ("zero_optimization", "steps_per_print")
DEEPSPEED_OWNED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "optimizer", "scheduler", "gradient_clipping", "fp16", "bf16",
)
ZERO_KEYS = ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
             "reduce_scatter", "allgather_partitions", "round_robin_gradients")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW hyperparameters, clipping (grad_clip: max global L2 norm, 0 = off) and the backend.

    deepspeed: None trains with torch AdamW; a DeepSpeed config dict trains with DeepSpeed, whose only
    settable keys are `DEEPSPEED_KEYS` (zero_optimization.stage 0, 1 or 2 and the ZeRO bucket knobs in
    `ZERO_KEYS`); batch sizes, optimizer, clipping and precision are filled in from this config.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    deepspeed: Optional[dict] = None

    def __post_init__(self):
        for name in ("lr", "weight_decay", "eps", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"OptimConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.lr <= 0 or self.eps <= 0:
            raise ValueError(f"OptimConfig.lr and eps must be > 0, got lr={self.lr!r}, eps={self.eps!r}")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else None
        if betas is None or len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"OptimConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        if self.deepspeed is not None:
            _check_deepspeed(self.deepspeed)
            object.__setattr__(self, "deepspeed", copy.deepcopy(self.deepspeed))  # immune to later edits

    @property
    def zero_stage(self) -> Optional[int]:
        """The ZeRO stage (0-2) on the DeepSpeed path, None on the torch path."""
        if self.deepspeed is None:
            return None
        return self.deepspeed.get("zero_optimization", {}).get("stage", 0)


def _check_deepspeed(config: Any) -> None:
    if not isinstance(config, dict):
        raise ValueError(f"OptimConfig.deepspeed must be a dict (a DeepSpeed config) or None, got {type(config).__name__}")
    owned = sorted(set(config) & set(DEEPSPEED_OWNED_KEYS))
    if owned:
        raise ValueError(f"OptimConfig.deepspeed: {owned} are set by the wrapper (from lr, betas, eps, weight_decay, "
                         f"grad_clip; fp32, one micro-batch per backward); remove them")
    unknown = sorted(set(config) - set(DEEPSPEED_KEYS))
    if unknown:
        raise ValueError(f"OptimConfig.deepspeed: unsupported key(s) {unknown}; supported: {list(DEEPSPEED_KEYS)}")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"OptimConfig.deepspeed.zero_optimization must be a dict, got {type(zero).__name__}")
    unknown = sorted(set(zero) - set(ZERO_KEYS))
    if unknown:
        raise ValueError(f"OptimConfig.deepspeed.zero_optimization: unsupported key(s) {unknown}; "
                         f"supported: {list(ZERO_KEYS)}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2):
        raise ValueError(f"OptimConfig.deepspeed.zero_optimization.stage must be 0, 1 or 2 (stage 3 partitions "
                         f"the parameters, which this learner does not support), got {stage!r}")
    if zero.get("overlap_comm") and stage != 2:
        raise ValueError("OptimConfig.deepspeed.zero_optimization.overlap_comm needs stage 2 (DeepSpeed supports it "
                         "only there when the caller owns gradient accumulation)")
    steps = config.get("steps_per_print", 10)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"OptimConfig.deepspeed.steps_per_print must be an integer >= 1, got {steps!r}")


class Trainer(ABC):
    """Owns the update of one list of parameters. `module`: what to run forwards with."""

    module: nn.Module

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients (step() already does after updating). ZeRO stage 2 cannot: it
        reduces each backward into its gradient partitions, so there this raises if backward ran since step()."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate d(loss)/d(params); call once per micro-batch."""

    @abstractmethod
    def step(self) -> dict[str, float]:
        """Clip, apply AdamW, clear gradients. Returns learner/grad_norm (before clipping) and learner/lr."""


def make_trainer(module: nn.Module, params: list[nn.Parameter], cfg: OptimConfig,
                 group: Optional[dist.ProcessGroup] = None) -> Trainer:
    """The trainer `cfg` asks for. group (DeepSpeed only): the learner ranks' process group, when the
    learner has several; default: this rank alone (see the module docstring)."""
    params = list(params)
    if not params:
        raise ValueError("make_trainer: no parameters to train")
    if cfg.deepspeed is None:
        if group is not None:
            raise ValueError("make_trainer: a process group only applies to the DeepSpeed path")
        return TorchTrainer(module, params, cfg)
    return DeepSpeedTrainer(module, params, cfg, group)


class TorchTrainer(Trainer):
    def __init__(self, module: nn.Module, params: list[nn.Parameter], cfg: OptimConfig):
        self.module = module
        self.params = params
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        if self.cfg.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        else:
            norm = grad_norm(self.params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"learner/grad_norm": norm, "learner/lr": float(self.optimizer.param_groups[0]["lr"])}


def grad_norm(params: list[nn.Parameter]) -> float:
    """Global L2 norm of the gradients, computed as clip_grad_norm_ does (the norm of per-tensor norms)."""
    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


class DeepSpeedTrainer(Trainer):
    """DeepSpeed ZeRO stage 0-2 on CPU in fp32; `module` is the engine (its forward calls the module)."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], cfg: OptimConfig,
                 group: Optional[dist.ProcessGroup] = None):
        for p in params:
            if not isinstance(p, nn.Parameter) or p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"the DeepSpeed path trains float32 CPU nn.Parameters, got a {type(p).__name__} "
                                 f"of {p.dtype} on {p.device}")
        deepspeed = _import_deepspeed()
        self.cfg = cfg
        self.params = params
        self.stage = cfg.zero_stage
        ranks = LearnerRanks(_learner_group(group))
        config = {
            **cfg.deepspeed,
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "optimizer": {"type": "AdamW", "params": {
                "lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
                "torch_adam": True,
            }},
            "gradient_clipping": cfg.grad_clip,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
        }
        self.engine, _, _, _ = deepspeed.initialize(model=_Holder(module, params), model_parameters=params,
                                                    config=config, mpu=ranks, dist_init_required=False)
        self.module = self.engine
        self.pending_backwards = 0  # since the last step()

    def zero_grad(self) -> None:
        if self.stage == 2 and self.pending_backwards:
            raise RuntimeError("ZeRO stage 2 has already reduced this step's gradients into its partitions and cannot "
                               "drop them; call zero_grad() only right after step()")
        self.engine.optimizer.zero_grad()  # torch AdamW (stage 0) or ZeRO's: clears .grad and ZeRO's grad_accum
        self.pending_backwards = 0

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.pending_backwards += 1

    def step(self) -> dict[str, float]:
        # ZeRO 1/2 hold the gradients in their partitions and report the norm; stage 0 does not report it,
        # so it is taken here, before step() reduces: with several learner ranks, this rank's gradient.
        norm = grad_norm(self.params) if self.stage == 0 else None
        self.engine.step()
        self.pending_backwards = 0
        if norm is None:
            norm = float(self.engine.get_global_grad_norm())
        return {"learner/grad_norm": norm, "learner/lr": float(self.engine.get_lr()[0])}


class _Holder(nn.Module):
    """Gives DeepSpeed exactly `params` as its module's parameters; forward runs `module`."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter]):
        super().__init__()
        self.params = nn.ParameterList(params)
        object.__setattr__(self, "target", module)  # not a submodule: its other parameters stay out

    def forward(self, *args, **kwargs):
        return self.target(*args, **kwargs)


class LearnerRanks:
    """DeepSpeed's mpu: data parallelism over the learner's group, no model parallelism."""

    def __init__(self, data_group: dist.ProcessGroup):
        self.data_group = data_group
        solo = dist.get_world_size(data_group) == 1
        self.solo_group = data_group if solo else dist.new_group([dist.get_rank()], use_local_synchronization=True)

    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.data_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.data_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.data_group)

    def get_model_parallel_group(self):
        return self.solo_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


def _learner_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    if not dist.is_initialized():
        if group is not None:
            raise ValueError("make_trainer: a process group was given but torch.distributed is not initialized")
        logger.info("torch.distributed is not initialized: starting a single-rank gloo world for DeepSpeed")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return dist.group.WORLD
    if group is not None:
        if dist.get_rank(group) < 0:
            raise ValueError(f"make_trainer: rank {dist.get_rank()} is not in the given learner group")
        return group
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def _import_deepspeed():
    """deepspeed, on the CPU accelerator, without its shared-memory op (see the module docstring)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", "0")
    try:
        import deepspeed
        import deepspeed.comm
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:
        raise ImportError("OptimConfig.deepspeed needs the `deepspeed` package (pip install deepspeed)") from err
    name = get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(f"DeepSpeed already runs on the {name!r} accelerator; the DeepSpeed path trains on CPU "
                           f"(set DS_ACCELERATOR=cpu before deepspeed is first imported)")
    if deepspeed.comm.comm.cdb is None:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed
