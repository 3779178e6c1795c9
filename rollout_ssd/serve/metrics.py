"""`GET /metrics`: the engine's counters in Prometheus text format (prometheus_client).

vLLM's names for speculation (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`) and requests
(`vllm:num_requests_running` / `_waiting`, `vllm:prompt_tokens`, `vllm:generation_tokens`), so existing
dashboards work, plus ours under `rollout_ssd:` (hit rate, strategy, weight version, acceptance).
Counters come from `engine.stats`: `engine.metrics(reset=True)` restarts them (a counter reset, which
Prometheus' rate() handles). A draft is one sequence's proposal in one round, as in vLLM.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from rollout_ssd import metric_names as names


class _EngineCollector:
    def __init__(self, engine, server):
        self.engine, self.server = engine, server

    def collect(self):
        stats, m = self.engine.stats, self.engine.metrics()
        counts = self.engine.scheduler.counts()

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            return c

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=value)

        yield counter("vllm:spec_decode_num_drafts", "Sequence-rounds that verified a proposal.", stats.spec_rounds)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.proposed)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.accepted)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position.", labels=["position"])
        for i, a in enumerate(stats.pos_accepted):
            per_pos.add_metric([str(i)], a)
        yield per_pos
        yield gauge("vllm:num_requests_running", "Sequences running now.", counts["running"])
        yield gauge("vllm:num_requests_waiting", "Sequences waiting for a KV slot.", counts["waiting"])
        served = self.server.counts
        yield counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", served["prompt_tokens"])
        yield counter("vllm:generation_tokens", "Tokens generated for finished requests.", served["generation_tokens"])
        requests = CounterMetricFamily("rollout_ssd:requests", "HTTP generation requests by outcome.", labels=["outcome"])
        for outcome in ("finished", "aborted", "rejected"):
            requests.add_metric([outcome], served[outcome])
        yield requests
        yield gauge("rollout_ssd:weight_version", "Target weight version served.", self.engine.weight_version)
        yield gauge("rollout_ssd:draft_version", "Draft weight version.", self.engine.draft_version)
        yield gauge("rollout_ssd:ssd_hit_rate", "SSD rounds served from the speculation cache / SSD rounds.",
                    m.get(names.SSD_HIT_RATE, 0.0))
        yield gauge("rollout_ssd:accept_rate", "Accepted / judged draft tokens (spec/accept_rate).",
                    m.get(names.SPEC_ACCEPT_RATE, 0.0))
        yield gauge("rollout_ssd:tokens_per_s", "Tokens per second while busy (rollout/tokens_per_s).",
                    m.get(names.ROLLOUT_TOKENS_PER_S, 0.0))
        yield gauge("rollout_ssd:paused", "1 while paused.", float(self.engine.scheduler.paused))
        rounds = CounterMetricFamily("rollout_ssd:ssd_strategy_rounds", "Batch rounds run under each SSD strategy.",
                                     labels=["strategy"])
        for strategy, count in sorted(stats.ssd_strategy_rounds.items()):
            rounds.add_metric([str(strategy)], count)
        yield rounds
        info = InfoMetricFamily("rollout_ssd:strategy", "Decoding method and the SSD rule's latest choice.")
        method = self.engine.spec.method
        info.add_metric([], {"method": method, "strategy": str(m.get(names.SSD_STRATEGY, method))})
        yield info


def prometheus_text(engine, server) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine, server))
    return generate_latest(registry)
