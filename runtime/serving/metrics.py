"""Prometheus metrics of one server, in a registry of its own (never prometheus-client's global one):
latencies as the server sees them (histograms), and the engine's counters read at each scrape."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..async_engine import AsyncEngine, StreamOutput
from .protocol import FINISH

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.registry = CollectorRegistry()
        self.refused = {"invalid": 0, "error": 0}  # requests the server answered with an error before the engine
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("dspark_inter_token_latency_seconds", "Between consecutive outputs of a request (one "
                             "step may commit several tokens)", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("dspark_e2e_request_latency_seconds", "From a request's arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def timed(self, outputs: AsyncIterator[StreamOutput], arrival: float) -> AsyncIterator[StreamOutput]:
        """`outputs`, observing the request's latencies on the way (arrival: time.perf_counter())."""
        last = None
        async with aclosing(outputs):
            async for out in outputs:
                now = time.perf_counter()
                if out.token_ids:
                    if last is None:
                        self.ttft.observe(now - arrival)
                    else:
                        self.itl.observe(now - last)
                    last = now
                if out.finish_reason is not None:
                    self.e2e.observe(now - arrival)
                yield out

    def collect(self):
        """The engine's counters, at scrape time (a prometheus-client custom collector)."""
        s = self.engine.state()
        requests = CounterMetricFamily("dspark_requests", "Requests by outcome: stop, length, abort (client gone or "
                                       "aborted), error (failed in the engine or the server), rejected (queue full: "
                                       "429), invalid (bad request: 4xx)", labels=["outcome"])
        outcomes = {"stop": 0, "length": 0, "abort": 0, "error": 0, "rejected": s.rejected, "invalid": 0}
        for reason, n in [*s.finished.items(), *self.refused.items()]:
            key = FINISH.get(reason, reason)
            outcomes[key] = outcomes.get(key, 0) + n
        for outcome, n in outcomes.items():
            requests.add_metric([outcome], n)
        yield requests
        yield GaugeMetricFamily("dspark_running_requests", "Requests in a slot", value=s.running)
        yield GaugeMetricFamily("dspark_waiting_requests", "Requests waiting for a slot (queue depth)", value=s.waiting)
        yield GaugeMetricFamily("dspark_slots", "Slots: requests served at once", value=s.slots)
        yield CounterMetricFamily("dspark_generation_tokens", "Tokens generated", value=s.generated_tokens)
        yield CounterMetricFamily("dspark_engine_steps", "Engine steps run", value=s.steps)
        # the speculation of the requests that ended, cumulative
        yield GaugeMetricFamily("dspark_tau", "Mean tokens per request cycle (accepted drafts + 1)",
                                value=s.emitted / s.cycles if s.cycles else 0.0)
        yield GaugeMetricFamily("dspark_mean_verified", "Mean drafts verified per request cycle (0 when the drafter "
                                "was skipped)", value=s.verified / s.cycles if s.cycles else 0.0)
        yield GaugeMetricFamily("dspark_drafter_skipped_share", "Share of request cycles without drafting",
                                value=1 - s.drafted_cycles / s.cycles if s.cycles else 0.0)
        acceptance = GaugeMetricFamily("dspark_acceptance_rate", "Per draft position: accepted / verified with every "
                                       "draft before it accepted", labels=["position"])
        for k, (n, a) in enumerate(zip(s.attempts, s.accepts), start=1):
            acceptance.add_metric([str(k)], a / n if n else 0.0)
        yield acceptance
