"""The server's counters, gauges and latency histograms, kept by prometheus_client in a registry of
each `Metrics` object's own (so two engines in one process keep apart), served at /metrics."""

from __future__ import annotations

import threading
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


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # each XLA program made, from the cache too
_compilations = [0]  # in this process, since the first `Metrics` was made
_compilations_lock = threading.Lock()
_listening: list[bool] = []


def _count_compilation(event: str, seconds: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        with _compilations_lock:
            _compilations[0] += 1


def compilations() -> int:
    """XLA programs compiled (or read from the compilation cache) in this process since the first
    `Metrics` was made: every jit of every thread, not only the engine's."""
    return _compilations[0]


def _listen_for_compilations() -> None:
    import jax

    with _compilations_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_count_compilation)
            _listening.append(True)


class _Compilations:
    """A prometheus_client collector of `compilations()` as the counter hfjax_compilations_total."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "hfjax_compilations", "XLA programs compiled or read from the compilation cache in this process."
        )
        family.add_metric([], compilations())
        yield family


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
      queue_depth, running: gauges, set by assignment (`running` also sets the batch occupancy).
      compilations: XLA programs made in this process so far (`compilations()`), hfjax_compilations_total.
      prefix_hit_tokens: a counter; `metrics.prefix_hit_tokens += n` adds n.
      time_to_first_token, inter_token_latency: histograms with `observe(seconds, times=1)`.
      prompt_tokens_read, tokens_generated: plain counts of the tokens the engine has read from prompts
        (less the prefixes a slot held) and generated, so far.
      adapters_loaded: a gauge of the LoRA adapters the model holds, set by assignment.
      speculative_tokens: k, the tokens a speculative decode drafts per row and round (0: none); with
        it, vLLM's spec-decode counters (`count_drafts`) and the drafts so far (`drafts`, `draft_tokens`,
        `accepted_tokens`).
    """

    def __init__(self, slots: int, speculative_tokens: int = 0):
        prometheus = _prometheus()
        self.slots = slots
        self.speculative_tokens = speculative_tokens
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
        self._programs_held = gauge("hfjax_programs_held", "Programs the engine compiled before it started.")
        self._programs_memory = gauge(
            "hfjax_programs_memory_bytes",
            "Memory those programs hold beside their arguments and results (scratch and generated code).",
        )
        self._model_requests = counter(
            "hfjax_lora_requests",
            "Chat and completion requests, by the model name they asked for: the base's or a LoRA adapter's.",
            ("model",),
        )
        self._adapters = gauge(
            "hfjax_lora_adapters_loaded", "LoRA adapters the model holds (an unloaded one until its requests end)."
        )
        if speculative_tokens:  # vLLM's, which it registers where a speculative decode is configured
            self._drafts = counter("hfjax_spec_decode_num_drafts", "Drafts verified: rows in rounds that drafted.")
            self._draft_tokens = counter("hfjax_spec_decode_num_draft_tokens", "Drafted tokens verified.")
            self._accepted_tokens = counter("hfjax_spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
            self._accepted_per_position = counter(
                "hfjax_spec_decode_num_accepted_tokens_per_pos",
                "Drafted tokens accepted, by their index in the draft (0: the first).",
                ("position",),
            )
            for position in range(speculative_tokens):  # every position shows, from 0
                self._accepted_per_position.labels(position=str(position))
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        _listen_for_compilations()
        self.registry.register(_Compilations())
        self.time_to_first_token = histogram("hfjax_time_to_first_token_seconds", "Time from arrival to first token.")
        self.inter_token_latency = histogram("hfjax_inter_token_latency_seconds", "Time between tokens of a request.")
        # Tokens read from prompts and generated, counted as the engine goes (the stats line's rates;
        # the engine thread alone writes them).
        self.prompt_tokens_read = 0
        self.tokens_generated = 0

    def count_request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint=endpoint, code=str(status)).inc()

    def count_model_request(self, model: str) -> None:
        self._model_requests.labels(model=model).inc()

    @property
    def adapters_loaded(self) -> int:
        return int(self.registry.get_sample_value("hfjax_lora_adapters_loaded"))

    @adapters_loaded.setter
    def adapters_loaded(self, count: int) -> None:
        self._adapters.set(count)

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
    def compilations(self) -> int:
        return compilations()

    def hold_programs(self, count: int, memory: int) -> None:
        """Reports the engine's programs: how many, and the bytes they hold (hfjax_programs_held,
        hfjax_programs_memory_bytes)."""
        self._programs_held.set(count)
        self._programs_memory.set(memory)

    @property
    def prefix_hit_tokens(self) -> int:
        return int(self.registry.get_sample_value("hfjax_prefix_cache_hit_tokens_total"))

    @prefix_hit_tokens.setter
    def prefix_hit_tokens(self, total: int) -> None:
        self._prefix_hits.inc(total - self.prefix_hit_tokens)  # a counter only grows: inc raises on less

    def count_drafts(self, drafts: int, draft_tokens: int, accepted_at) -> None:
        """Counts a speculative decode chunk's drafts: the rows' rounds that drafted, the tokens drafted,
        and those accepted at each draft index (`accepted_at` [k])."""
        drafts, draft_tokens, accepted = int(drafts), int(draft_tokens), int(sum(accepted_at))
        self._drafts.inc(drafts)
        self._draft_tokens.inc(draft_tokens)
        self._accepted_tokens.inc(accepted)
        for position, count in enumerate(accepted_at):
            self._accepted_per_position.labels(position=str(position)).inc(int(count))
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (`content_type` names its version)."""
        return _prometheus().generate_latest(self.registry)


class StatsLine:
    """vLLM's periodic stats line from a `Metrics`: the prompt and generation tokens/s since the last
    line, the requests running and waiting, the slots in use and the share of prompt tokens whose keys
    a slot held; with a speculative decode, as vLLM's spec-decode line, the share of drafted tokens
    accepted and the mean acceptance length (the tokens a draft's round made: 1 + accepted / drafts)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._last = self._sample()

    def _sample(self) -> tuple:
        m = self.metrics
        drafts = (m.drafts, m.draft_tokens, m.accepted_tokens)
        return time.monotonic(), m.prompt_tokens_read, m.tokens_generated, m.prefix_hit_tokens, drafts

    def next(self) -> str | None:
        """The line for the time since the last call, or None where nothing ran, waited or was read."""
        now, read, generated, hits, drafted = sample = self._sample()
        then, read_before, generated_before, hits_before, drafted_before = self._last
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
            + (_acceptance(*(a - b for a, b in zip(drafted, drafted_before))) if m.speculative_tokens else "")
        )


def _acceptance(drafts: int, draft_tokens: int, accepted: int) -> str:
    """The stats line's speculative part: the drafted tokens accepted, and the mean acceptance length."""
    return (
        f", Draft acceptance rate: {accepted / draft_tokens if draft_tokens else 0.0:.1%}, "
        f"Mean acceptance length: {1 + accepted / drafts if drafts else 1.0:.2f}"
    )
