"""Prometheus metrics of the server, vLLM-compatible names under the `specdecode:` prefix.

Speculative decoding (counters, updated every engine step from per-request deltas):
    specdecode:spec_decode_num_drafts_total
    specdecode:spec_decode_num_draft_tokens_total
    specdecode:spec_decode_num_accepted_tokens_total
    specdecode:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
PromQL:
    mean acceptance length = 1 + rate(specdecode:spec_decode_num_accepted_tokens_total[1m])
                                 / rate(specdecode:spec_decode_num_drafts_total[1m])
    acceptance rate        = rate(..._num_accepted_tokens_total[1m]) / rate(..._num_draft_tokens_total[1m])
Requests: request_success_total{finished_reason} (stop, length), request_aborted_total (the
client went away, or the server stopped), request_failed_total (finished with an error),
prompt_tokens_total, generation_tokens_total, histograms time_to_first_token_seconds,
time_per_output_token_seconds, e2e_request_latency_seconds; gauges num_requests_running,
num_requests_waiting (updated after every step and after every batch of adds and aborts).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "specdecode:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
COUNTS = ("drafts", "draft_tokens", "accepted", "generated")  # cumulative per request, counted by deltas


def _totals(m) -> dict:
    """A request's cumulative figures so far (COUNTS and accepted tokens per draft position)."""
    return {"drafts": m.num_drafts, "draft_tokens": m.num_draft_tokens, "accepted": m.num_accepted_tokens,
            "generated": m.num_output_tokens, "per_pos": list(m.accepted_per_position)}


def _zero() -> dict:
    return {**dict.fromkeys(COUNTS, 0), "per_pos": []}


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()  # per server: no module-level state
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(P + name, doc, ["model_name", *extra], registry=r)

        self.num_drafts = counter("spec_decode_num_drafts", "Verification steps that carried drafts")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position",
                                        ("position",))
        self.request_success = counter("request_success", "Finished requests", ("finished_reason",))
        self.request_aborted = counter("request_aborted", "Requests aborted before they finished (client gone, "
                                       "server stopping)")
        self.request_failed = counter("request_failed", "Requests that finished with an error")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Time per output token after the first",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests in the running batch", ["model_name"], registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a KV slot", ["model_name"], registry=r)
        self.labels = labels
        for zero_until_counted in (self.request_aborted, self.request_failed):
            zero_until_counted.labels(**labels)
        self._counters = {"drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                          "accepted": self.num_accepted_tokens, "generated": self.generation_tokens}
        self._seen: dict[str, dict] = {}  # request_id -> cumulative figures already counted (_totals)
        self._interval = {"t": time.monotonic(), **_zero()}  # figures since the last log line

    def observe_step(self, llm, outputs) -> None:
        lab = self.labels
        for out in outputs:
            m = out.metrics
            now = _totals(m)
            prev = self._seen.get(out.request_id)
            if prev is None:
                prev = _zero()
                self.prompt_tokens.labels(**lab).inc(m.num_prompt_tokens)
                if m.time_to_first_token is not None:
                    self.ttft.labels(**lab).observe(m.time_to_first_token)
            delta = {key: now[key] - prev[key] for key in COUNTS}
            for key, counter in self._counters.items():
                counter.labels(**lab).inc(delta[key])
            per_pos_prev = prev["per_pos"] + [0] * (len(now["per_pos"]) - len(prev["per_pos"]))
            per_pos_delta = [a - b for a, b in zip(now["per_pos"], per_pos_prev)]
            for pos, d in enumerate(per_pos_delta):
                if d:
                    self.accepted_per_pos.labels(**lab, position=str(pos)).inc(d)
            iv = self._interval
            for key in COUNTS:
                iv[key] += delta[key]
            iv["per_pos"] += [0] * (len(per_pos_delta) - len(iv["per_pos"]))
            for pos, d in enumerate(per_pos_delta):
                iv["per_pos"][pos] += d
            if out.finished:
                self._seen.pop(out.request_id, None)
                if out.finish_reason == "error":
                    self.request_failed.labels(**lab).inc()
                else:
                    self.request_success.labels(**lab, finished_reason=out.finish_reason or "unknown").inc()
                if m.e2e_latency is not None:
                    self.e2e.labels(**lab).observe(m.e2e_latency)
                if m.time_to_first_token is not None and m.num_output_tokens > 1:
                    self.tpot.labels(**lab).observe((m.e2e_latency - m.time_to_first_token) / (m.num_output_tokens - 1))
            else:
                self._seen[out.request_id] = now
        self.observe_queue(llm)

    def observe_queue(self, llm) -> None:
        self.running.labels(**self.labels).set(len(llm.scheduler.running))
        self.waiting.labels(**self.labels).set(len(llm.scheduler.waiting))

    def aborted(self, request_id: str) -> None:
        """An aborted request produces no final output: count it, drop its bookkeeping."""
        self._seen.pop(request_id, None)
        self.request_aborted.labels(**self.labels).inc()

    def failed(self, request_id: str) -> None:
        """A request failed without a final output (the step it was in raised)."""
        self._seen.pop(request_id, None)
        self.request_failed.labels(**self.labels).inc()

    def log_line(self, llm) -> str:
        """vLLM-style periodic line; resets the interval."""
        iv = self._interval
        dt = max(1e-9, time.monotonic() - iv["t"])
        line = (f"generation throughput {iv['generated'] / dt:.1f} tok/s, running {len(llm.scheduler.running)}, "
                f"waiting {len(llm.scheduler.waiting)}")
        if iv["drafts"]:
            first = iv["drafts"]
            per_pos = []
            for count in iv["per_pos"]:
                per_pos.append(count / first if first else 0.0)
            line += (f"; SpecDecoding metrics: mean acceptance length {1 + iv['accepted'] / iv['drafts']:.2f}, "
                     f"accepted throughput {iv['accepted'] / dt:.1f} tok/s, drafted throughput "
                     f"{iv['draft_tokens'] / dt:.1f} tok/s, accepted {iv['accepted']}, drafted {iv['draft_tokens']}, "
                     f"per-position acceptance rate {', '.join(f'{x:.3f}' for x in per_pos)}, "
                     f"avg draft acceptance rate {iv['accepted'] / max(1, iv['draft_tokens']):.1%}")
        self._interval = {"t": time.monotonic(), **_zero()}
        return line

    def render(self) -> bytes:
        return generate_latest(self.registry)
