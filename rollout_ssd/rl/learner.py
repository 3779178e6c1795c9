"""The policy learner: per-token logprobs of rollouts under the policy, and GRPO / PPO updates.

The learner trains our own Decoder with float32 master weights (its parameters carry the HF names the
engine and weight sync use, so `named_tensors()` goes straight to `LearnerSync`); its forwards run under
bf16 autocast where the machine has bf16 matmul units (`LearnerConfig.autocast`, precision.py). One
`step(batch)` is one policy version.

`learner/kl_initial`: KL(pi_theta || pi_initial) before the step's update, estimated (k3, losses.kl_penalty)
on the step's tokens (sampled from the policy): the learner's own logprobs against a frozen copy of the
initial policy's. The copy is the KL reference too (kl_coef > 0), whose logprobs then come for free;
otherwise it scores `kl_initial_rollouts` of the step's rollouts, evenly spaced (0: not estimated), and
`time/kl_initial_s` is what that pass cost.

GRPO: advantages are group-normalised rewards (n samples per prompt), broadcast over each completion's
tokens; the loss is the clipped surrogate with ratio = pi_theta / pi_old.
PPO: a value head on the policy's final hidden states, GAE over each completion (terminal reward on the
last token, plus the optional KL-to-reference penalty per token), whitened advantages, clipped
surrogate + clipped value loss. Departure from textbook PPO: the value head reads the hidden states
*detached* (a linear critic on the policy's features) rather than a separate critic model, which would
double the learner's cost on a CPU; the policy gradient is therefore exactly the surrogate's.

pi_old (`old_logprobs`): "rollout" uses the engine's logprobs (the behaviour policy's own numbers, so
the ratio also corrects rollout-vs-learner mismatch); "learner" recomputes them with the learner's
weights before the update (verl's default), so the update is a function of the tokens and rewards
alone; "auto" takes "rollout" for sampled rollouts and "learner" for greedy ones (a greedy rollout's
behaviour law is a point mass, which its softmax logprobs do not describe).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn as nn

from rollout_ssd import metric_names as names
from rollout_ssd.config import require_positive_ints
from rollout_ssd.draft.drift import token_mult_prob_error
from rollout_ssd.models.decoder import Decoder
from rollout_ssd.rl import losses, precision
from rollout_ssd.rl.optim import OptimConfig, make_trainer

ALGORITHMS = ("grpo", "ppo")
OLD_LOGPROBS = ("auto", "rollout", "learner")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LearnerConfig:
    """algorithm: "grpo" | "ppo". clip_low / clip_high: the ratio's clip range. aggregation: how token
    losses become the batch loss (losses.policy_loss). old_logprobs: see the module docstring.
    kl_coef: weight of a k3 KL-to-reference term (GRPO: in the loss; PPO: in the token rewards; 0 keeps
    no reference copy). scale_rewards: GRPO divides by the group's std (False: Dr.GRPO). epochs /
    minibatches: passes over the step's rollouts and optimizer steps per pass. micro_batch: rows per
    forward. gamma / lam / value_clip / vf_coef: PPO. autocast: "auto" | "bf16" | "off" (precision.py).
    kl_initial_rollouts: rollouts per step `learner/kl_initial` is estimated on (module docstring; 0: off)."""

    algorithm: str = "grpo"
    optim: OptimConfig = field(default_factory=OptimConfig)
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "token-mean"
    old_logprobs: str = "auto"
    kl_coef: float = 0.0
    scale_rewards: bool = True
    epochs: int = 1
    minibatches: int = 1
    micro_batch: int = 8
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    vf_coef: float = 0.5
    autocast: str = "auto"
    kl_initial_rollouts: int = 8

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"LearnerConfig.algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"LearnerConfig.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LearnerConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        require_positive_ints(self, ("epochs", "minibatches", "micro_batch"))
        if self.autocast not in precision.AUTOCAST_MODES:
            raise ValueError(f"LearnerConfig.autocast must be one of {precision.AUTOCAST_MODES}, got {self.autocast!r}")
        if isinstance(self.kl_initial_rollouts, bool) or not isinstance(self.kl_initial_rollouts, int) \
                or self.kl_initial_rollouts < 0:
            raise ValueError(f"LearnerConfig.kl_initial_rollouts must be an integer >= 0, got {self.kl_initial_rollouts!r}")
        for name in ("clip_low", "clip_high", "kl_coef", "value_clip", "vf_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"LearnerConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("LearnerConfig.gamma and lam must be in [0, 1]")
        if not isinstance(self.optim, OptimConfig):
            raise ValueError("LearnerConfig.optim must be an OptimConfig")


@dataclass
class RolloutBatch:
    """One step's rollouts, ordered by (prompt, sample), groups of `group_size` consecutive rows."""

    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]  # the engine's, per completion token
    rewards: list[float]
    group_size: int
    temperature: float = 1.0  # the rollouts' sampling temperature (0: greedy)

    def __post_init__(self):
        n = len(self.prompts)
        if not (len(self.completions) == len(self.logprobs) == len(self.rewards) == n):
            raise ValueError("RolloutBatch: prompts, completions, logprobs and rewards differ in length")
        if n == 0 or self.group_size < 1 or n % self.group_size:
            raise ValueError(f"RolloutBatch: {n} rows is not a positive multiple of group_size={self.group_size}")
        for i, (c, lp) in enumerate(zip(self.completions, self.logprobs)):
            if len(c) != len(lp):
                raise ValueError(f"RolloutBatch: row {i} has {len(c)} tokens but {len(lp)} logprobs")

    @classmethod
    def from_rollouts(cls, rollouts: Sequence, rewards: Sequence[float], group_size: int,
                      temperature: float) -> "RolloutBatch":
        return cls([list(r.prompt_token_ids) for r in rollouts], [list(r.token_ids) for r in rollouts],
                   [list(r.logprobs) for r in rollouts], [float(x) for x in rewards], group_size, temperature)


def _padded(rows: Sequence[Sequence[float]], width: int, fill: float = 0.0) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(list(r), dtype=torch.float32)
    return out


class Learner:
    """model: a float32 Decoder (trained in place; engines get its weights through weight sync)."""

    def __init__(self, model: Decoder, config: LearnerConfig = LearnerConfig()):
        if model.dtype != torch.float32:
            raise ValueError(f"the learner keeps float32 master weights, got a {model.dtype} model")
        self.model = model
        self.config = config
        self.autocast_dtype = precision.resolve_autocast(config.autocast, model.embed.device)
        self.version = 0
        params = list(dict.fromkeys(p for p in model.parameters()))
        with torch.no_grad():
            for p in params:
                # row-major storage: the inference layout (column-major float32 weights, decoder.weight)
                # buys nothing at training batch sizes, and DeepSpeed flattens parameters as bytes
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
                p.requires_grad_(True)
        self.value_head: Optional[nn.Linear] = None
        if config.algorithm == "ppo":
            self.value_head = nn.Linear(model.cfg.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
            params += list(self.value_head.parameters())
        self.reference: Optional[Decoder] = None  # the initial policy, frozen (KL reference, kl_initial)
        if config.kl_coef > 0 or config.kl_initial_rollouts > 0:
            self.reference = copy.deepcopy(model).requires_grad_(False)
        self._params = params
        self._trainer = None

    @property
    def trainer(self):
        """Built on first use: in a Ray learner actor, after the weight-sync world exists (DeepSpeed
        then takes the learner's own ranks from it instead of making a world of its own)."""
        if self._trainer is None:
            self._trainer = make_trainer(self.model, self._params, self.config.optim)
        return self._trainer

    # ------------------------------------------------------------------ forwards
    def _forward(self, model: Decoder, prompts, completions, temperature: float, values: bool = False):
        """Per-token logprobs [B, T] of the completions (and values [B, T] when asked), right-padded."""
        inputs = [list(p) + list(c)[:-1] for p, c in zip(prompts, completions)]
        width = max(len(x) for x in inputs)
        tokens = torch.zeros(len(inputs), width, dtype=torch.long)
        for b, x in enumerate(inputs):
            tokens[b, :len(x)] = torch.tensor(x)
        with precision.autocast(self.autocast_dtype, model.embed.device):
            hidden = model.forward_train(tokens)  # [B, L, H]; causal, so padding never reaches a real row
            picked = [hidden[b, len(p) - 1:len(p) - 1 + len(c)] for b, (p, c) in enumerate(zip(prompts, completions))]
            flat = torch.cat(picked)  # [N, H]
            logits = model.logits(flat).float() / (temperature if temperature > 0 else 1.0)
        t_max = max(len(c) for c in completions)
        target = torch.tensor([t for c in completions for t in c], dtype=torch.long)
        flat_logp = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]  # [N]
        logp = logits.new_zeros(len(completions), t_max)  # float32, as the logits
        value = logits.new_zeros(len(completions), t_max) if values else None
        flat_value = self.value_head(flat.detach().float())[:, 0] if values else None
        start = 0
        for b, c in enumerate(completions):
            logp[b, :len(c)] = flat_logp[start:start + len(c)]
            if values:
                value[b, :len(c)] = flat_value[start:start + len(c)]
            start += len(c)
        return logp, value

    def _chunks(self, rows: Sequence[int]):
        mb = self.config.micro_batch
        return [list(rows[i:i + mb]) for i in range(0, len(rows), mb)]

    def logprobs(self, batch: RolloutBatch, model: Optional[Decoder] = None) -> torch.Tensor:
        """[B, T] per-token logprobs under `model` (default: the policy), no gradient."""
        return self._score(batch, model or self.model)[0]

    @torch.no_grad()
    def _score(self, batch: RolloutBatch, model: Decoder, values: bool = False, only: Optional[list] = None):
        """One no-grad pass: per-token logprobs [B, T] and, when asked, the value head's values [B, T]
        (else None); T = the longest completion (at least 1), zeros past each row's end and in the rows
        not in `only` (default: every row)."""
        shape = (len(batch.completions), max(1, max(len(c) for c in batch.completions)))
        logp, value = torch.zeros(shape), torch.zeros(shape) if values else None
        scored = range(len(batch.completions)) if only is None else only
        for rows in self._chunks([i for i in scored if batch.completions[i]]):
            lp, v = self._forward(model, [batch.prompts[i] for i in rows], [batch.completions[i] for i in rows],
                                  batch.temperature, values=values)
            logp[rows, :lp.shape[1]] = lp
            if values:
                value[rows, :v.shape[1]] = v
        return logp, value

    # ------------------------------------------------------------------ the update
    def step(self, batch: RolloutBatch) -> dict:
        """One policy update on the step's rollouts; returns learner/* metrics. Advances `version`."""
        cfg = self.config
        width = max(1, max(len(c) for c in batch.completions))
        mask = _padded([[1.0] * len(c) for c in batch.completions], width)
        rollout_logp = _padded(batch.logprobs, width)
        # PPO's old values come from the same no-grad pass as the learner's logprobs
        learner_logp, old_values = self._score(batch, self.model, values=cfg.algorithm == "ppo")
        use_rollout = cfg.old_logprobs == "rollout" or (cfg.old_logprobs == "auto" and batch.temperature > 0)
        old_logp = rollout_logp if use_rollout else learner_logp
        rewards = torch.tensor(batch.rewards, dtype=torch.float32)
        ref_logp = self.logprobs(batch, self.reference) if cfg.kl_coef > 0 else None
        kl_initial = self._kl_initial(batch, learner_logp, ref_logp, mask)
        returns = None
        if cfg.algorithm == "grpo":
            adv = losses.group_advantages(rewards, batch.group_size, scale=cfg.scale_rewards)[:, None] * mask
        else:
            token_rewards = torch.zeros_like(mask)
            for b, c in enumerate(batch.completions):
                if c:
                    token_rewards[b, len(c) - 1] = rewards[b]
            if ref_logp is not None:
                token_rewards = token_rewards - cfg.kl_coef * (old_logp - ref_logp) * mask
            adv, returns = losses.gae(token_rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
            adv = losses.masked_whiten(adv, mask)
        live = [i for i, c in enumerate(batch.completions) if c]
        stats: dict[str, list[float]] = {}
        for _ in range(cfg.epochs):
            order = live
            per = -(-len(order) // cfg.minibatches)
            for start in range(0, len(order), per):
                rows = order[start:start + per]
                self._update(batch, rows, mask, old_logp, adv, ref_logp, old_values, returns, stats)
        self.version += 1
        valid = mask.bool()
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out.update({
            "learner/version": self.version,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
            "rollout/response_length": float(mask.sum(1).mean()),
            "learner/old_logprobs_from_rollout": float(use_rollout),
            names.LEARNER_AUTOCAST: precision.label(self.autocast_dtype),
        })
        out.update(kl_initial)
        if valid.any():
            out["mismatch/token_mult_prob_error"] = token_mult_prob_error(
                [learner_logp[b, :len(c)].tolist() for b, c in enumerate(batch.completions) if c],
                [batch.logprobs[b] for b, c in enumerate(batch.completions) if c])
        return out

    def _kl_initial(self, batch: RolloutBatch, learner_logp, ref_logp, mask) -> dict:
        """`learner/kl_initial` and `time/kl_initial_s` (module docstring); {} when not estimated."""
        live = [i for i, c in enumerate(batch.completions) if c]
        k = self.config.kl_initial_rollouts
        if self.reference is None or not live or (ref_logp is None and k == 0):
            return {}
        t0 = time.perf_counter()
        rows = live if ref_logp is not None or k >= len(live) else [live[j * len(live) // k] for j in range(k)]
        if ref_logp is None:
            ref_logp = self._score(batch, self.reference, only=rows)[0]
        kl = losses.masked_mean(losses.kl_penalty(learner_logp[rows], ref_logp[rows], kind="k3"), mask[rows])
        return {names.LEARNER_KL_INITIAL: float(kl), names.TIME_KL_INITIAL_S: time.perf_counter() - t0}

    def _update(self, batch, rows, mask, old_logp, adv, ref_logp, old_values, returns, stats) -> None:
        cfg = self.config
        self.trainer.zero_grad()
        total_tokens = float(mask[rows].sum())
        max_len = mask.shape[1]
        for chunk in self._chunks(rows):
            ppo = cfg.algorithm == "ppo"
            logp, values = self._forward(self.model, [batch.prompts[i] for i in chunk],
                                         [batch.completions[i] for i in chunk], batch.temperature, values=ppo)
            t = logp.shape[1]
            m = mask[chunk, :t]
            loss, pg = losses.policy_loss(logp, old_logp[chunk, :t], adv[chunk, :t], m, clip_low=cfg.clip_low,
                                          clip_high=cfg.clip_high, aggregation=cfg.aggregation, max_len=max_len)
            if cfg.algorithm == "grpo" and ref_logp is not None:
                kl = losses.masked_mean(losses.kl_penalty(logp, ref_logp[chunk, :t], kind="k3"), m)
                loss = loss + cfg.kl_coef * kl
                pg["kl_ref"] = float(kl.detach())
            if ppo:
                vloss, vs = losses.value_loss(values, old_values[chunk, :t], returns[chunk, :t], m, clip=cfg.value_clip)
                loss = loss + cfg.vf_coef * vloss
                pg.update(vs, value_loss=float(vloss.detach()))
            # weight each micro-batch by its share of what the aggregation averages over
            share = float(m.sum()) / total_tokens if cfg.aggregation == "token-mean" else len(chunk) / len(rows)
            self.trainer.backward(loss * share)
            pg["loss"] = float(loss.detach())
            for k, v in pg.items():
                stats.setdefault(f"learner/{k}", []).append(float(v))
        for k, v in self.trainer.step().items():
            stats.setdefault(k, []).append(float(v))

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The policy's weights under HF names (what LearnerSync sends)."""
        return self.model.hf_parameters()
