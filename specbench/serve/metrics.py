"""Prometheus metrics of `specbench serve`, named as vLLM names them, so a board built for vLLM reads them.

Names follow vLLM's v1 engine: `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos` (label `position`, 0-based), plus the
request histograms (`vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds`,
`vllm:e2e_request_latency_seconds`). Counters carry `_total` on the wire, as prometheus-client writes
them. Each server has its own registry (several run in one test process).
"""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specbench.types import StepRecord

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # vLLM's exposition has no *_created series; a board reads what it expects


class ServeMetrics:
    def __init__(self, model: str):
        self.registry = registry = CollectorRegistry()
        labels, self.model = ["model_name"], model
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Speculative steps that drafted", labels,
                              registry=registry)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens (or tree nodes) verified",
                                    labels, registry=registry)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels,
                                       registry=registry)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the accepted path",
                                        labels + ["position"], registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled", labels, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=registry)
        self.requests = Counter("vllm:request_success", "Finished requests", labels + ["finished_reason"],
                                registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests generating now", labels, registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", labels, registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first",
                              labels, buckets=TOKEN_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=registry)

    def observe(self, records: Sequence[StepRecord], prompt_tokens: int, completion_tokens: int,
                ttft_s: float, e2e_s: float, finish_reason: str) -> None:
        model = self.model
        for record in records:
            if record.drafted:
                self.drafts.labels(model).inc()
                self.draft_tokens.labels(model).inc(record.drafted)
                self.accepted_tokens.labels(model).inc(record.accepted)
                for position in range(record.accepted):
                    self.accepted_per_pos.labels(model, str(position)).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(completion_tokens)
        self.requests.labels(model, finish_reason).inc()
        self.e2e.labels(model).observe(e2e_s)
        if completion_tokens:
            self.ttft.labels(model).observe(ttft_s)
        if completion_tokens > 1:
            self.tpot.labels(model).observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
