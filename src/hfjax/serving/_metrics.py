"""The server's counters, gauges and histograms, rendered in Prometheus' text format."""

from __future__ import annotations

import bisect
import threading

# Seconds: time to first token and inter-token latency span ~1 ms (a decode step) to minutes (a queue).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Observations counted into cumulative buckets (Prometheus' `le` buckets), with their sum."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times


class Metrics:
    """What /metrics reports; the engine and the server update it from their threads."""

    def __init__(self, slots: int):
        self.lock = threading.Lock()
        self.slots = slots
        self.requests = {}  # {(endpoint, status code): count}
        self.finished = {}  # {finish reason: count}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_hit_tokens = 0
        self.queue_depth = 0
        self.running = 0
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def count_finished(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens

    def render(self) -> str:
        """The metrics in Prometheus' text exposition format (version 0.0.4)."""
        with self.lock:
            lines = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} {kind}")
                lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

            metric(
                "hfjax_http_requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
                [(f'{{endpoint="{e}",code="{c}"}}', n) for (e, c), n in sorted(self.requests.items())],
            )  # fmt: skip
            metric(
                "hfjax_request_success_total", "counter", "Generation requests finished, by finish reason.",
                [(f'{{finished_reason="{r}"}}', n) for r, n in sorted(self.finished.items())],
            )  # fmt: skip
            metric(
                "hfjax_prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
                [("", self.prompt_tokens)],
            )
            metric(
                "hfjax_generation_tokens_total", "counter", "Tokens generated for finished requests.",
                [("", self.generation_tokens)],
            )  # fmt: skip
            metric(
                "hfjax_prefix_cache_hit_tokens_total", "counter", "Prompt tokens whose keys a slot held already.",
                [("", self.prefix_hit_tokens)],
            )  # fmt: skip
            metric("hfjax_num_requests_waiting", "gauge", "Requests queued for a slot.", [("", self.queue_depth)])
            metric("hfjax_num_requests_running", "gauge", "Requests holding a slot.", [("", self.running)])
            metric(
                "hfjax_batch_occupancy", "gauge", "Fraction of the sequence slots in use.",
                [("", self.running / self.slots if self.slots else 0.0)],
            )  # fmt: skip
            for name, histogram, help_ in (
                ("hfjax_time_to_first_token_seconds", self.time_to_first_token, "Time from arrival to first token."),
                ("hfjax_inter_token_latency_seconds", self.inter_token_latency, "Time between tokens of a request."),
            ):
                cumulative, samples = 0, []
                for bound, count in zip((*histogram.buckets, "+Inf"), histogram.counts):
                    cumulative += count
                    samples.append((f'_bucket{{le="{bound}"}}', cumulative))
                samples += [("_sum", histogram.sum), ("_count", histogram.count)]
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} histogram")
                lines.extend(f"{name}{suffix} {_number(value)}" for suffix, value in samples)
            return "\n".join(lines) + "\n"


def _number(value) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))
