"""The metric names users see: `engine.metrics()` keys, wandb keys, the server's /metrics sources.

Defined once here so the counters (metrics.py), the draft's update counters (draft_sync.py), the
server's Prometheus export (serve/metrics.py) and run tracking (rl/tracking.py) spell them the same way.
docs/DESIGN.md lists the names and their meanings; a name here never changes once released (dashboards and
JSONL records key on it). A family (`spec/accept_rate_pos_{i}`, `ssd/{name}`) is a function.
"""

from __future__ import annotations

# rollout: time and tokens of sample() calls (prefill included)
ROLLOUT_TOKENS = "rollout/tokens"
ROLLOUT_SECONDS = "rollout/seconds"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
ROLLOUT_TOKENS_PER_ROUND = "rollout/tokens_per_round"
ROLLOUT_PREFILL_SECONDS = "rollout/prefill_seconds"
ROLLOUT_DECODE_TOKENS_PER_S = "rollout/decode_tokens_per_s"

# rollout by live batch (metrics.py's `end_round`): where a call's time went, the large batch of its head
# against the small one of its tail; `bucket` is metrics.batch_bucket_label's "1", "2-3", "4-7", ...
SECONDS_BY_BATCH = "rollout/seconds_by_batch/"
TOKENS_BY_BATCH = "rollout/tokens_by_batch/"
ROUNDS_BY_BATCH = "rollout/rounds_by_batch/"


def rollout_seconds_by_batch(bucket: str) -> str:
    """`rollout/seconds_by_batch/{bucket}`: seconds of the rounds run at that live batch (they sum to
    `rollout/seconds`)."""
    return SECONDS_BY_BATCH + bucket


def rollout_tokens_by_batch(bucket: str) -> str:
    """`rollout/tokens_by_batch/{bucket}`: tokens those rounds emitted (they sum to `rollout/tokens`)."""
    return TOKENS_BY_BATCH + bucket


def rollout_rounds_by_batch(bucket: str, plan: str) -> str:
    """`rollout/rounds_by_batch/{bucket}/{plan}`: rounds at that live batch that ran `plan` (an SSD
    `Plan` label such as "ssd+neural", else "ar", "sd", or "prefill" for a round that only prefilled)."""
    return f"{ROUNDS_BY_BATCH}{bucket}/{plan}"

# spec: acceptance of speculated tokens (SD and SSD)
SPEC_ACCEPT_RATE = "spec/accept_rate"
SPEC_ACCEPTED_PER_PROPOSED = "spec/accepted_per_proposed"
SPEC_ACCEPT_LENGTH = "spec/accept_length"
SPEC_PROPOSED_PER_ROUND = "spec/proposed_per_round"
SPEC_DRAFT_SECONDS = "spec/draft_seconds"
SPEC_VERIFY_SECONDS = "spec/verify_seconds"
SPEC_DRAFT_TIME_SHARE = "spec/draft_time_share"


def spec_accept_rate_pos(position: int) -> str:
    """`spec/accept_rate_pos_{i}`: acceptance at draft position i (1-based)."""
    return f"spec/accept_rate_pos_{position}"


# ssd: the speculation cache and the strategy rule
SSD_HIT_RATE = "ssd/hit_rate"
SSD_HIT_RATE_WARM = "ssd/hit_rate_warm"
SSD_ROUNDS = "ssd/rounds"
SSD_HITS = "ssd/hits"
SSD_COLD_ROUNDS = "ssd/cold_rounds"
SSD_WORKER_FAILURES = "ssd/worker_failures"
SSD_STRATEGY_ROUNDS = "ssd/strategy_rounds"
SSD_STRATEGY = "ssd/strategy"


def ssd_state(name: str) -> str:
    """`ssd/{name}`: the latest value of an SSD estimate (fanout, T_p, T_b, b_star, predicted_speedup, ...)."""
    return f"ssd/{name}"


# sync: weight updates of the target and of the draft
SYNC_VERSION = "sync/version"
SYNC_REJECTED = "sync/rejected"
SYNC_BYTES = "sync/bytes"
SYNC_SECONDS = "sync/seconds"
SYNC_COUNT = "sync/count"
SYNC_DRAFT_VERSION = "sync/draft_version"
SYNC_DRAFT_REJECTED = "sync/draft_rejected"
SYNC_DRAFT_COUNT = "sync/draft_count"
SYNC_DRAFT_BYTES = "sync/draft_bytes"
SYNC_DRAFT_SECONDS = "sync/draft_seconds"

# drift: how far the draft is from the policy
DRIFT_KL_TARGET_DRAFT = "drift/kl_target_draft"
DRIFT_VERSIONS = "drift/versions"
DRIFT_ROLLOUTS = "drift/rollouts"

# the RL step (rl/trainer.py, rl/learner.py): per-phase seconds and the learner's diagnostics
TIME_ROLLOUT_S = "time/rollout_s"
TIME_LEARN_S = "time/learn_s"
TIME_SYNC_S = "time/sync_s"
TIME_FOLLOW_S = "time/follow_s"
TIME_DRIFT_S = "time/drift_s"
TIME_STEP_S = "time/step_s"
TIME_DRIFT_SHARE = "time/drift_share"
TIME_KL_INITIAL_S = "time/kl_initial_s"
STEP_PHASES = (TIME_ROLLOUT_S, TIME_LEARN_S, TIME_SYNC_S, TIME_FOLLOW_S, TIME_DRIFT_S)  # they sum to time/step_s
LEARNER_KL_INITIAL = "learner/kl_initial"
LEARNER_AUTOCAST = "learner/autocast"
