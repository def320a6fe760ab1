"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, slots):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("cflow_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("cflow_prompt_tokens", "prompt tokens processed", registry=r)
        self.completion_tokens = Counter("cflow_completion_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("cflow_prompt_cached_tokens", "prompt tokens found in a slot's KV cache (not recomputed)",
                                     registry=r)
        self.cancelled = Counter("cflow_generations_cancelled", "generations stopped by a client leaving", registry=r)
        self.decode_tok_s = Gauge("cflow_last_decode_tokens_per_second", "decode speed of the last finished generation", registry=r)
        self.decode_hist = Histogram("cflow_decode_tokens_per_second", "decode speed of finished generations",
                                     buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.latency = Histogram("cflow_request_seconds", "time from request to last byte of a generation",
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        Gauge("cflow_queue_length", "requests waiting for a sequence slot", registry=r).set_function(lambda: slots.queued)
        Gauge("cflow_active_generations", "sequences running now (prefilling or decoding)", registry=r).set_function(lambda: slots.active)
        Gauge("cflow_batcher_steps", "engine steps run by the batcher", registry=r).set_function(lambda: slots.steps)
        Gauge("cflow_batcher_forward_seconds", "seconds the batcher spent in the engine's forwards", registry=r
              ).set_function(lambda: slots.forward_seconds)
        Gauge("cflow_batcher_step_seconds", "seconds of whole batcher steps: the forward, then sampling and handing out",
              registry=r).set_function(lambda: slots.step_seconds)
        Gauge("cflow_batcher_decode_rows", "decode tokens the batcher's steps carried", registry=r
              ).set_function(lambda: slots.decode_rows)
        Gauge("cflow_batcher_prompt_rows", "prompt tokens the batcher's steps carried", registry=r
              ).set_function(lambda: slots.prompt_rows)
        Gauge("cflow_slots", "sequences decoded together (--parallel)", registry=r).set_function(lambda: slots.n)
        cache = slots.cache
        Gauge("cflow_prompt_cache_entries", "histories kept in the prompt cache (--cache-ram)", registry=r
              ).set_function(lambda: len(cache))
        Gauge("cflow_prompt_cache_bytes", "KV memory the prompt cache's histories hold", registry=r
              ).set_function(lambda: cache.bytes)
        Gauge("cflow_prompt_cache_hits", "prompts that started from a history in the prompt cache", registry=r
              ).set_function(lambda: cache.hits)

    def finished(self, usage, timings) -> None:
        """Count one completed generation."""
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.completion_tokens.inc(usage.completion_tokens)
            self.cached_tokens.inc(usage.cached_tokens)
        if timings is not None and timings.decode_tok_s:
            self.decode_tok_s.set(timings.decode_tok_s)
            self.decode_hist.observe(timings.decode_tok_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
