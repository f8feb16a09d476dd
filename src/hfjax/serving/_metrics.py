"""The server's counters, gauges and latency histograms, kept by prometheus_client in a registry of
each `Metrics` object's own (so two engines in one process keep apart), served at /metrics."""

from __future__ import annotations

import time

# Seconds: time to first token and inter-token latency span ~1 ms (a decode step) to minutes (a queue).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _prometheus():
    try:
        import prometheus_client
    except ImportError as error:
        raise ImportError(
            "hfjax.serving's metrics need prometheus_client, part of the serve extra: pip install 'hfjax[serve]'"
        ) from error
    return prometheus_client


class Histogram:
    """A prometheus_client histogram that takes one value observed several times (a decode chunk's
    tokens share one inter-token latency)."""

    def __init__(self, histogram):
        self.histogram = histogram

    def observe(self, value: float, times: int = 1) -> None:
        for _ in range(times):
            self.histogram.observe(value)


class Metrics:
    """What /metrics reports; the engine and the server update it from their threads (prometheus_client's
    metrics are thread-safe).

    Attributes:
      registry: the prometheus_client `CollectorRegistry` holding them all; `render()` writes it in
        the text format named by `content_type`.
      queue_depth, running, programs_pending: gauges, set by assignment (`running` also sets the batch
        occupancy).
      prefix_hit_tokens: a counter; `metrics.prefix_hit_tokens += n` adds n.
      time_to_first_token, inter_token_latency: histograms with `observe(seconds, times=1)`.
      prompt_tokens_read, tokens_generated: plain counts of the tokens the engine has read from prompts
        (less the prefixes a slot held) and generated, so far.
    """

    def __init__(self, slots: int):
        prometheus = _prometheus()
        self.slots = slots
        self.registry = prometheus.CollectorRegistry()
        self.content_type = prometheus.CONTENT_TYPE_LATEST

        def counter(name: str, help_: str, labels=()):
            return prometheus.Counter(name, help_, labels, registry=self.registry)

        def gauge(name: str, help_: str):
            return prometheus.Gauge(name, help_, registry=self.registry)

        def histogram(name: str, help_: str):
            return Histogram(prometheus.Histogram(name, help_, buckets=LATENCY_BUCKETS, registry=self.registry))

        self._requests = counter(
            "hfjax_http_requests", "HTTP requests answered, by endpoint and status code.", ("endpoint", "code")
        )
        self._finished = counter(
            "hfjax_request_success", "Generation requests finished, by finish reason.", ("finished_reason",)
        )
        self._prompt_tokens = counter("hfjax_prompt_tokens", "Prompt tokens of finished requests.")
        self._generation_tokens = counter("hfjax_generation_tokens", "Tokens generated for finished requests.")
        self._prefix_hits = counter("hfjax_prefix_cache_hit_tokens", "Prompt tokens whose keys a slot held already.")
        self._waiting = gauge("hfjax_num_requests_waiting", "Requests queued for a slot.")
        self._running = gauge("hfjax_num_requests_running", "Requests holding a slot.")
        self._occupancy = gauge("hfjax_batch_occupancy", "Fraction of the sequence slots in use.")
        self._pending = gauge("hfjax_programs_pending", "Programs the engine has still to compile (in the background).")
        self.time_to_first_token = histogram("hfjax_time_to_first_token_seconds", "Time from arrival to first token.")
        self.inter_token_latency = histogram("hfjax_inter_token_latency_seconds", "Time between tokens of a request.")
        # Tokens read from prompts and generated, counted as the engine goes (the stats line's rates;
        # the engine thread alone writes them).
        self.prompt_tokens_read = 0
        self.tokens_generated = 0

    def count_request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint=endpoint, code=str(status)).inc()

    def count_finished(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        self._finished.labels(finished_reason=reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)

    @property
    def queue_depth(self) -> int:
        return int(self.registry.get_sample_value("hfjax_num_requests_waiting"))

    @queue_depth.setter
    def queue_depth(self, waiting: int) -> None:
        self._waiting.set(waiting)

    @property
    def running(self) -> int:
        return int(self.registry.get_sample_value("hfjax_num_requests_running"))

    @running.setter
    def running(self, running: int) -> None:
        self._running.set(running)
        self._occupancy.set(running / self.slots if self.slots else 0.0)

    @property
    def programs_pending(self) -> int:
        return int(self.registry.get_sample_value("hfjax_programs_pending"))

    @programs_pending.setter
    def programs_pending(self, pending: int) -> None:
        self._pending.set(pending)

    @property
    def prefix_hit_tokens(self) -> int:
        return int(self.registry.get_sample_value("hfjax_prefix_cache_hit_tokens_total"))

    @prefix_hit_tokens.setter
    def prefix_hit_tokens(self, total: int) -> None:
        self._prefix_hits.inc(total - self.prefix_hit_tokens)  # a counter only grows: inc raises on less

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (`content_type` names its version)."""
        return _prometheus().generate_latest(self.registry)


class StatsLine:
    """vLLM's periodic stats line from a `Metrics`: the prompt and generation tokens/s since the last
    line, the requests running and waiting, the slots in use and the share of prompt tokens whose keys
    a slot held."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int, int]:
        m = self.metrics
        return time.monotonic(), m.prompt_tokens_read, m.tokens_generated, m.prefix_hit_tokens

    def next(self) -> str | None:
        """The line for the time since the last call, or None where nothing ran, waited or was read."""
        now, read, generated, hits = sample = self._sample()
        then, read_before, generated_before, hits_before = self._last
        self._last = sample
        m = self.metrics
        read, generated, hits = read - read_before, generated - generated_before, hits - hits_before
        if not (read or generated or m.running or m.queue_depth):
            return None
        seconds = max(now - then, 1e-9)
        prompt_total = read + hits
        return (
            f"Avg prompt throughput: {read / seconds:.1f} tokens/s, Avg generation throughput: "
            f"{generated / seconds:.1f} tokens/s, Running: {m.running} reqs, Waiting: {m.queue_depth} reqs, "
            f"Slots in use: {m.running / max(m.slots, 1):.1%}, "
            f"Prefix cache hit rate: {hits / prompt_total if prompt_total else 0.0:.1%}"
        )
