"""Prometheus metrics, one registry per app (tests run several apps in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "exl3tools"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated",
                                         registry=r)
        self.cancelled = Counter(f"{PREFIX}_sequences_cancelled",
                                 "Sequences aborted because their client went away", registry=r)
        self.preempted = Counter(f"{PREFIX}_sequences_preempted",
                                 "Sequences that gave their KV cache back to recompute later",
                                 registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Request received to first sampled token, per sequence", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between consecutive tokens of a sequence", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds", "Request received to last token",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "Sequences waiting for admission",
                                 registry=r)
        self.running = Gauge(f"{PREFIX}_running_sequences", "Sequences in the decode batch",
                             registry=r)
        self.cache_used = Gauge(f"{PREFIX}_kv_cache_tokens_used", "KV-cache tokens in use",
                                registry=r)
        self.cache_usage = Gauge(f"{PREFIX}_kv_cache_usage_ratio", "KV-cache tokens used / budget",
                                 registry=r)
        self.prefix_queries = Gauge(f"{PREFIX}_prefix_cache_queries_tokens",
                                    "Prompt tokens looked up in the prefix cache (cumulative)", registry=r)
        self.prefix_hits = Gauge(f"{PREFIX}_prefix_cache_hits_tokens",
                                 "Prompt tokens found in the prefix cache, not recomputed (cumulative)", registry=r)
        self.spec_drafted = Gauge(f"{PREFIX}_spec_draft_tokens", "MTP draft tokens proposed (speculative decoding)",
                                  registry=r)
        self.spec_accepted = Gauge(f"{PREFIX}_spec_accepted_tokens", "MTP draft tokens the model accepted",
                                   registry=r)
        self.spec_rate = Gauge(f"{PREFIX}_spec_acceptance_ratio", "Accepted / proposed MTP draft tokens",
                               registry=r)
        # serving-expectations.md §8: bytes from the checkpoint headers, experts by uniform routing
        self.decode_bytes = Gauge(
            f"{PREFIX}_decode_weight_read_bytes",
            "Weight bytes the last decode-only step read on rank 0 (estimate: non-expert tensors once plus "
            "E*(1-(1-k/E)^B) routed experts per MoE layer at B sequences, uniform routing; no KV cache, "
            "embedding or MTP layers)", registry=r)
        self.decode_gbps = Gauge(
            f"{PREFIX}_decode_weight_read_gbps",
            "Achieved weight-read GB/s of decode-only steps: the uniform-routing byte estimate over the "
            "step's time, median of the last 64 (KV-cache reads not included)", registry=r)
        self.ready = Gauge(f"{PREFIX}_model_ready", "1 once the model answered its first step",
                           ["model"], registry=r)
        self._ready_child = self.ready.labels(model=model_name)

    def bind(self, engine: Any) -> None:
        """Gauges read the engine at scrape time, so they are never stale."""
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.running.set_function(lambda: engine.running)
        self.cache_used.set_function(engine.cache_tokens_used)
        self.cache_usage.set_function(
            lambda: engine.cache_tokens_used() / engine.cache_budget if engine.cache_budget else 0.0)
        self.prefix_queries.set_function(lambda: engine.prefix_stats()[0])
        self.prefix_hits.set_function(lambda: engine.prefix_stats()[1])
        self.spec_drafted.set_function(lambda: engine.spec_drafted)
        self.spec_accepted.set_function(lambda: engine.spec_accepted)
        self.spec_rate.set_function(lambda: engine.spec_accepted / engine.spec_drafted if engine.spec_drafted else 0.0)
        self.decode_bytes.set_function(lambda: engine.decode_bytes)
        self.decode_gbps.set_function(engine.decode_gbps)
        self._ready_child.set_function(lambda: 1.0 if engine.state == "ready" else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
