"""A `RolloutEngine` as the `rollout_func` of TRL's `GRPOTrainer` (trl >= 1.16), so TRL's unchanged
trainer gets AR, SD or SSD rollouts without vLLM:

    engine = RolloutEngine.from_pretrained(model_dir, draft=draft_dir, spec=SpecConfig(method="ssd"),
                                           dtype="float32")
    trainer = GRPOTrainer(model=model, args=GRPOConfig(..., use_vllm=False), reward_funcs=...,
                          train_dataset=dataset, rollout_func=make_rollout_func(engine))

TRL calls the function with the process's slice of the generation batch, in which its RepeatSampler
has already repeated each prompt num_generations times, and the trainer itself. One call:

1. Weight sync. Whenever `trainer.state.global_step` differs from the step last synced, the first
   call included (nothing proves the engine was loaded from exactly the trainer's weights; TRL's own
   vLLM path syncs at step 0 too), the unwrapped trainer model's `named_parameters()` go to
   `engine.update_weights` as version `engine.weight_version + 1`. With the same dtype on both sides
   the copy is bitwise. A tied LM head is sent once, as the embedding, when the engine ties it too,
   and as both names when only the engine keeps a separate head. PEFT models and sharded parameters
   (DeepSpeed ZeRO-3, FSDP) are refused with a ValueError: merging an adapter in and out again does
   not restore the base weights bitwise, and gathering shards is not implemented here.
2. Tokenization exactly as `GRPOTrainer._tokenize_prompts` in trl 1.16: text prompts through
   `processing_class(text=...)`, conversational ones through `apply_chat_template` with the
   trainer's tools, chat template and `chat_template_kwargs` (per example under environments). The
   engine gets token ids, so the returned `prompt_ids` are what the trainer trains on. Images and
   vision-language models are refused (the engine is text only).
3. Grouping. Runs of identical consecutive prompts (the RepeatSampler's groups) become one prompt
   with `n = run length`, so SD/SSD see the siblings of a group together; runs of equal length share
   one `engine.sample` call. Every run gets a fresh prompt index, `(counter + run) * num_processes +
   process_index` with the counter advanced by the number of runs after each call, so the seed
   triple (seed, index, sample) never repeats within a run of the trainer or across processes. A
   run resumed from a checkpoint restarts the counter: pass a different `seed` to draw new samples.
4. Sampling. `SamplingParams` comes from the trainer: temperature, top_p, top_k (0 or -1 = off),
   `max_new_tokens = max_completion_length`, `seed = args.seed`, and the stop set of TRL's own
   generation (`trainer.eos_token_ids`, with `ignore_eos=True` so the engine adds none of its own).
   `sampling_overrides` replace single fields (not `n`, set by the grouping, nor `chat`, since the
   adapter renders chat itself). Options the engine cannot honour (min_p, repetition_penalty != 1,
   generation_kwargs) raise a ValueError naming the GRPOConfig field.
5. Result, in input order, one completion per element: `prompt_ids`, `completion_ids` (a stop token
   included, as TRL expects), `logprobs` (log softmax(logits / T) over the full vocabulary at each
   sampled token, i.e. before top-k/top-p truncation; this is what TRL recomputes for its loss, and
   with `use_vllm=False` TRL reads them only for `off_policy_mask_threshold`), and the extra fields
   `weight_version` and `finish_reason` ("stop" | "length"), which TRL passes to the reward
   functions.

With tools, only the first turn comes from the engine: TRL's tool loop generates the turns after a
tool call with its own generator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from rollout_ssd.config import reject_unknown
from rollout_ssd.params import SamplingParams

# SamplingParams fields the adapter sets itself, with the reason an override is refused.
_FIXED = {
    "n": "n is set per group from the repeated prompts TRL passes (num_generations)",
    "chat": "the adapter renders chat prompts itself, with the trainer's chat template, and passes token ids",
}
_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


def make_rollout_func(engine, **sampling_overrides) -> TRLRolloutFunc:
    """A `rollout_func` for `trl.GRPOTrainer` backed by `engine` (see the module docstring).

    sampling_overrides: `SamplingParams` fields that replace the values derived from the trainer
    (e.g. `seed=7`); unknown names and `n`/`chat` raise ValueError here, before training starts."""
    return TRLRolloutFunc(engine, **sampling_overrides)


class TRLRolloutFunc:
    """The callable `make_rollout_func` returns. State: `last_synced_step` (the global step whose
    weights the engine holds, None before the first call), `next_group` (the prompt-index counter)
    and `syncs` (weight syncs done)."""

    def __init__(self, engine, **sampling_overrides):
        reject_unknown(SamplingParams, sampling_overrides)
        for name, why in _FIXED.items():
            if name in sampling_overrides:
                raise ValueError(f"make_rollout_func: SamplingParams.{name} cannot be overridden: {why}")
        SamplingParams(**sampling_overrides)  # bad values fail now, naming the field
        self.engine = engine
        self.overrides = dict(sampling_overrides)
        self.last_synced_step = None
        self.next_group = 0
        self.syncs = 0

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        params = sampling_params(trainer, self.overrides)  # refusals come before any work
        prompt_ids = tokenize_prompts(prompts, trainer)
        step = trainer.state.global_step
        if step != self.last_synced_step:
            sync_weights(self.engine, trainer)
            self.last_synced_step = step
            self.syncs += 1
        runs = group_runs(prompt_ids)
        indices = self._fresh_indices(len(runs), trainer.accelerator.process_index, trainer.accelerator.num_processes)
        rollouts = sample_runs(self.engine, prompt_ids, runs, indices, params)
        return {
            "prompt_ids": [list(ids) for ids in prompt_ids],
            "completion_ids": [list(r.token_ids) for r in rollouts],
            "logprobs": [list(r.logprobs) for r in rollouts],
            "weight_version": [r.weight_version for r in rollouts],
            "finish_reason": [r.finish_reason for r in rollouts],
        }

    def _fresh_indices(self, num_runs: int, process_index: int, num_processes: int) -> list[int]:
        base = self.next_group
        self.next_group += num_runs
        return [(base + g) * num_processes + process_index for g in range(num_runs)]


# ---------------------------------------------------------------------------------------------- pieces


def group_runs(prompt_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(start, length) of each run of identical consecutive prompts, in order."""
    runs: list[tuple[int, int]] = []
    for i, ids in enumerate(prompt_ids):
        if runs and list(prompt_ids[runs[-1][0]]) == list(ids):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def sample_runs(engine, prompt_ids, runs, indices, params: SamplingParams) -> list:
    """One rollout per element of `prompt_ids`, in order: run g is prompt `indices[g]` sampled
    `length` times; runs of the same length share one `engine.sample` call."""
    by_length: dict[int, list[int]] = {}
    for g, (_, length) in enumerate(runs):
        by_length.setdefault(length, []).append(g)
    out: list = [None] * len(prompt_ids)
    for length, groups in by_length.items():
        rollouts = engine.sample([prompt_ids[runs[g][0]] for g in groups], dataclasses.replace(params, n=length),
                                 prompt_indices=[indices[g] for g in groups])
        if len(rollouts) != len(groups) * length:
            raise RuntimeError(f"engine.sample returned {len(rollouts)} rollouts for {len(groups)} prompts x n={length}")
        for k, g in enumerate(groups):
            start = runs[g][0]
            for j in range(length):
                r = rollouts[k * length + j]
                if (r.prompt_index, r.sample_index) != (indices[g], j):
                    raise RuntimeError("engine.sample returned rollouts out of (prompt, sample) order")
                out[start + j] = r
    return out


def sampling_params(trainer, overrides: dict[str, Any]) -> SamplingParams:
    """The SamplingParams (n=1; the grouping sets n) for the trainer's generation settings."""
    min_p = getattr(trainer, "min_p", None)
    if min_p not in (None, 0, 0.0):
        raise ValueError(f"GRPOConfig.min_p={min_p!r} is not supported by rollout_ssd (it samples by temperature, "
                         f"top-k and top-p only); set min_p=None")
    penalty = getattr(trainer, "repetition_penalty", 1.0)
    if penalty not in (None, 1, 1.0):
        raise ValueError(f"GRPOConfig.repetition_penalty={penalty!r} is not supported by rollout_ssd; set it to 1.0")
    extra = getattr(trainer.args, "generation_kwargs", None)
    if extra:
        raise ValueError(f"GRPOConfig.generation_kwargs={extra!r} is not supported by rollout_ssd (they are "
                         f"transformers/vLLM generation options); leave it empty")
    values: dict[str, Any] = {}
    if "temperature" not in overrides:
        temperature = trainer.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"GRPOConfig.temperature must be > 0 (TRL divides the logits by it), got {temperature!r}")
        values["temperature"] = float(temperature)
    if "top_p" not in overrides:
        values["top_p"] = 1.0 if trainer.top_p is None else float(trainer.top_p)
    if "top_k" not in overrides:
        top_k = trainer.top_k
        if top_k is None or top_k in (0, -1):
            top_k = 0
        elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"GRPOConfig.top_k must be an integer >= 0 (0 or -1 = off), got {top_k!r}")
        values["top_k"] = int(top_k)
    if "max_new_tokens" not in overrides:
        if trainer.max_completion_length is None:
            raise ValueError("GRPOConfig.max_completion_length must be set (or pass max_new_tokens=... to "
                             "make_rollout_func)")
        values["max_new_tokens"] = int(trainer.max_completion_length)
    if "seed" not in overrides:
        values["seed"] = int(trainer.args.seed)
    if "stop_token_ids" not in overrides:
        values["stop_token_ids"] = tuple(int(t) for t in trainer.eos_token_ids if t is not None)
    if "ignore_eos" not in overrides:
        values["ignore_eos"] = True  # the stop set is TRL's alone; ignore_eos=False adds the engine's eos
    return SamplingParams(**{**values, **overrides})


def tokenize_prompts(prompts: list, trainer) -> list[list[int]]:
    """Token ids of `prompts` exactly as trl 1.16's `GRPOTrainer._tokenize_prompts` computes them."""
    from trl.data_utils import is_conversational

    if not prompts:
        return []
    if getattr(trainer, "_is_vlm", False):
        raise ValueError("make_rollout_func: vision-language models are not supported (the engine is text only)")
    processing_class = trainer.processing_class
    if not is_conversational({"prompt": prompts[0]}):
        return _as_lists(processing_class(text=prompts)["input_ids"])
    for i, prompt in enumerate(prompts):
        for message in prompt:
            content = message.get("content")
            if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") == "image"
                                                 for part in content):
                raise ValueError(f"make_rollout_func: prompts[{i}] holds an image; the engine is text only")
    template = dict(chat_template=trainer.chat_template, add_generation_prompt=True, tokenize=True, return_dict=True)
    kwargs = trainer.chat_template_kwargs or {}
    if getattr(trainer, "environment_factories", None) is not None:
        # as TRL does: tools differ per example across environments, so each prompt renders alone
        ids = []
        for prompt, name in zip(prompts, trainer._batch_environments, strict=True):
            encoded = processing_class.apply_chat_template(conversation=[prompt], tools=trainer._env_tools[name] or None,
                                                           **template, **kwargs)
            ids.append(encoded["input_ids"][0])
        return _as_lists(ids)
    # TRL pads (then unpads) on transformers 5.3.x, whose processors crash on ragged batches
    needs_padding = _transformers_5_3()
    encoded = processing_class.apply_chat_template(conversation=prompts, tools=trainer.tools or None, **template,
                                                   **({"padding": True} if needs_padding else {}), **kwargs)
    if needs_padding:
        return [[int(t) for t, m in zip(row, mask, strict=True) if m]
                for row, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)]
    return _as_lists(encoded["input_ids"])


def sync_weights(engine, trainer) -> int:
    """Push the trainer's current weights into the engine as version `engine.weight_version + 1`;
    returns that version. Raises ValueError (engine unchanged) for PEFT models, sharded parameters,
    or a model whose parameter names or shapes do not match the engine's."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    _refuse_unsyncable(model, trainer)
    version = engine.weight_version + 1
    engine.update_weights(named_weights(engine, model), version=version)
    return version


def named_weights(engine, model) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every engine weight, read from the model's `named_parameters()`, with a
    tied LM head reconciled between the two (see the module docstring)."""
    engine_names = set(engine.target.model.hf_parameters())
    sent: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        _refuse_sharded(name, param)
        sent[name] = param.detach()
    if _HEAD in sent and _HEAD not in engine_names and _EMBED in engine_names:
        raise ValueError("the trainer's model has its own lm_head.weight but the engine ties the LM head to the "
                         "embedding (tie_word_embeddings): load the engine from a checkpoint with the same tying")
    if _HEAD in engine_names and _HEAD not in sent and _EMBED in sent:
        out_embed, in_embed = model.get_output_embeddings(), model.get_input_embeddings()
        if out_embed is not None and in_embed is not None and out_embed.weight is in_embed.weight:
            sent[_HEAD] = sent[_EMBED]  # tied in the trainer, separate in the engine
    missing = sorted(engine_names - set(sent) - {"lm_head.token_ids"})
    if missing:
        raise ValueError(f"the trainer's model has no parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"that the engine holds: load the engine from the trainer's architecture")
    return list(sent.items())


# ---------------------------------------------------------------------------------------------- checks


def _refuse_unsyncable(model, trainer) -> None:
    if getattr(model, "peft_config", None) is not None or getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError("make_rollout_func does not support PEFT models: merging an adapter in and out again does "
                         "not restore the base weights bitwise. Train the full model, or merge the adapter "
                         "(merge_and_unload) before training")
    state = trainer.accelerator.state
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
        raise ValueError("make_rollout_func does not support DeepSpeed ZeRO-3 (sharded parameters are not gathered "
                         "here); use ZeRO stage 0-2")
    if getattr(state, "fsdp_plugin", None) is not None:
        raise ValueError("make_rollout_func does not support FSDP (sharded parameters are not gathered here); use "
                         "DDP or DeepSpeed ZeRO stage 0-2")


def _refuse_sharded(name: str, param: torch.Tensor) -> None:
    if hasattr(param, "ds_id"):
        raise ValueError(f"parameter {name!r} is a DeepSpeed ZeRO-3 shard; make_rollout_func needs full parameters")
    if _is_dtensor(param) or "_fsdp_wrapped_module" in name or "_flat_param" in name:
        raise ValueError(f"parameter {name!r} is sharded (FSDP/DTensor); make_rollout_func needs full parameters")


def _is_dtensor(param: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support has no sharded tensors
        return False
    return isinstance(param, DTensor)


def _as_lists(rows) -> list[list[int]]:
    return [[int(t) for t in row] for row in rows]


def _transformers_5_3() -> bool:
    import transformers
    from packaging.version import Version

    return Version("5.3.0") <= Version(transformers.__version__) < Version("5.4.0")
