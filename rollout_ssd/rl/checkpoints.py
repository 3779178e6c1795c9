"""The run's checkpoints: the policy (and the draft it ran with) at chosen steps, loadable by the engine.

A run saves at `RLConfig.checkpoint_steps` (step 0 is the policy before any update) into
`<out_dir>/checkpoints/step_NNNN/`:

    policy/   config.json, model.safetensors (the learner's float32 weights), the tokenizer files
    draft/    config.json, model.safetensors (the follower's draft in float32; no embedding where the
              draft shares its target's), only when the run keeps a draft copy
    meta.json step, the policy version, the draft version and the follow mode

`RolloutEngine.from_pretrained(ckpt / "policy", draft=str(ckpt / "draft"))` serves that step's pair, which
is how `bench/bench_rl_steps.py` and `bench/rl_drift.py` replay a run's workload on its own checkpoints.
Weights go through safetensors only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rollout_ssd.models.decoder import Decoder

POLICY, DRAFT, META = "policy", "draft", "meta.json"


def step_dir(out_dir, step: int) -> Path:
    """Where the checkpoint of `step` lives under a run's out_dir."""
    return Path(out_dir) / "checkpoints" / f"step_{step:04d}"


def list_checkpoints(out_dir) -> dict[int, Path]:
    """step -> checkpoint directory, for every complete checkpoint (one with meta.json) of a run."""
    root = Path(out_dir) / "checkpoints"
    found = {}
    for d in sorted(root.glob("step_*")) if root.is_dir() else []:
        if (d / META).is_file():
            found[int(json.loads((d / META).read_text())["step"])] = d
    return dict(sorted(found.items()))


def save_policy(model: Decoder, hf_config, tokenizer, path) -> None:
    """An HF checkpoint directory of `model` (float32 weights as they are, HF tensor names)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().clone().contiguous() for name, t in model.hf_parameters().items()}  # a tied head is not listed
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config.to_json_file(str(path / "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def save_draft(draft: Decoder, hf_config, path) -> None:
    """config.json + model.safetensors of a draft as it is (float32); the embedding left out when the
    draft shares its target's (it is the policy's, saved beside it)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().clone().contiguous() for name, t in draft.hf_parameters().items()}
    if draft.cfg.shares_target_embedding:
        state.pop("model.embed_tokens.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config.to_json_file(str(path / "config.json"))


def save_checkpoint(out_dir, step: int, policy: Decoder, hf_config, tokenizer, *, policy_version: int,
                    draft: Optional[Decoder] = None, draft_config=None, draft_version: int = 0,
                    follow_mode: str = "frozen") -> Path:
    """Write the checkpoint of `step`: meta.json removed first and written last, so a checkpoint being
    (over)written is never listed. `draft_config`: the draft's HF config (as loaded)."""
    where = step_dir(out_dir, step)
    (where / META).unlink(missing_ok=True)
    save_policy(policy, hf_config, tokenizer, where / POLICY)
    if draft is not None:
        if draft_config is None:
            raise ValueError("saving a draft needs its HF config")
        save_draft(draft, draft_config, where / DRAFT)
    meta = {"step": step, "policy_version": policy_version, "draft_version": draft_version,
            "follow_mode": follow_mode, "has_draft": draft is not None}
    (where / META).write_text(json.dumps(meta, indent=2) + "\n")
    return where
