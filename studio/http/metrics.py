"""Prometheus metrics of the studio: ``GET /metrics`` in the text exposition format.

Each figure is counted where that is cheapest:

- Requests by listener, route and status, and their durations: ``RequestMetrics``, pure ASGI
  and outermost; it looks at each response's start message and at nothing else.
- Time to first token, tokens generated and tokens/s, by listener, model and route: a relayed
  stream keeps the time of its first chunk and its last two chunks (two assignments a chunk);
  once it ends, ``generation_counts`` reads llama-server's own counts from those few bytes. No
  chunk of a stream is parsed for it, Ollama's reshaped ones included (their upstream bytes are
  llama-server's). The GUI's chat, parsed anyway, gives its counts as it has them: each of its
  model calls counts (``studio.http.gui.gui_chat``). The listener is what ``RequestMetrics`` put in the
  request's scope (``listener_of``): the GUI's ``/api/chat`` and Ollama's are two routes.
- The phases of each generating request (queued, waiting for a load, prefill, decode), by model and
  route: from its activity record (``studio.activity``), once it ends.
- Loads, evictions, crashes, restarts and the durations of loads and evictions: the model
  manager's ``listeners`` (``ResidencyEvent``); busy models held back for a load that waits for their
  memory: its ``admission_listeners`` (``AdmissionEvent``).
- What is true now (resident models, requests in flight per model and waiting, predicted and
  actual memory per model and device): read at scrape time from the figures ``/api/status``
  shows (``studio.views.residency.status_json``; ``StatusCollector``).
- Speculative decoding: each resident llama-server's own ``/metrics`` (it runs with
  ``--metrics``), read at scrape time and re-exported per model.

Every app has its own ``CollectorRegistry``, not prometheus_client's global one, so several
apps in one process (the tests) do not collide.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import httpx
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from studio.http.wire.upstream import Upstream
from studio.residency.lifecycle import ResidentState
from studio.residency.manager import AdmissionEvent, ModelManager, ResidencyEvent
from studio.views.residency import status_json

log = structlog.get_logger(__name__)

Listener = Literal["studio", "ollama"]

#: The scope key under which ``RequestMetrics`` names the listener a request came to.
LISTENER = "gguf_studio.listener"

#: Seconds a scrape waits for a llama-server's own /metrics.
UPSTREAM_SCRAPE_TIMEOUT = 2.0

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
_LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STOP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: llama-server's speculative counters, and the names they are re-exported under (without ``_total``).
_SPECULATIVE = {
    "llamacpp:spec_decode_num_draft_tokens": ("ggstudio_speculative_draft_tokens", "Draft tokens proposed"),
    "llamacpp:spec_decode_num_accepted_tokens": (
        "ggstudio_speculative_accepted_tokens",
        "Draft tokens the model accepted",
    ),
    "llamacpp:spec_decode_num_drafts": ("ggstudio_speculative_drafts", "Speculative verification steps"),
}

#: Where llama-server's answers say how many tokens they generated, most telling first: ``timings``
#: (chat, completions, responses, infill), Anthropic's and Responses' ``usage.output_tokens``,
#: OpenAI's ``usage.completion_tokens``, the native ``tokens_predicted``.
_TOKEN_KEYS = (b'"predicted_n":', b'"output_tokens":', b'"completion_tokens":', b'"tokens_predicted":')
_RATE_KEY = b'"predicted_per_second":'


def generation_counts(tail: bytes) -> tuple[int | None, float | None]:
    """Tokens generated and llama-server's tokens/s, from the last bytes of an answer (``None``: not there)."""
    rate = _number_after(tail, _RATE_KEY)
    for key in _TOKEN_KEYS:
        n = _number_after(tail, key)
        if n is not None:
            return int(n), rate
    return None, rate


def _number_after(data: bytes, key: bytes) -> float | None:
    """The JSON number after the last ``key`` in ``data``."""
    at = data.rfind(key)
    if at < 0:
        return None
    start = at + len(key)
    end = start
    while end < len(data) and data[end] in b" 0123456789.eE+-":
        end += 1
    try:
        return float(data[start:end])
    except ValueError:
        return None


class StudioMetrics:
    """The studio's instruments in one registry; the app, the relay and the manager feed it."""

    def __init__(self, manager: ModelManager) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter(
            "ggstudio_http_requests",
            "HTTP requests answered, by listener, route and status",
            ["listener", "route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "ggstudio_http_request_duration_seconds",
            "Seconds from a request's arrival to the end of its answer",
            ["listener", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token_seconds = Histogram(
            "ggstudio_time_to_first_token_seconds",
            "Seconds from a streamed request's arrival (a model load included) to its first generated chunk",
            ["listener", "model", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "ggstudio_generated_tokens",
            "Tokens generated, by listener, model and route",
            ["listener", "model", "route"],
            registry=r,
        )
        self.tokens_per_second = Histogram(
            "ggstudio_generation_tokens_per_second",
            "Generation speed of each answer (llama-server's own figure where given)",
            ["model"],
            buckets=_RATE_BUCKETS,
            registry=r,
        )
        self.loads = Counter(
            "ggstudio_model_loads", "Model loads, by outcome (ok, error, cancelled)", ["model", "outcome"], registry=r
        )
        self.load_seconds = Histogram(
            "ggstudio_model_load_duration_seconds",
            "Seconds from starting llama-server to the model serving",
            ["model"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "ggstudio_model_evictions",
            "Serving models stopped, by reason (evicted: room for another model; unload; ttl; "
            "restart: new settings; shutdown)",
            ["model", "reason"],
            registry=r,
        )
        self.eviction_seconds = Histogram(
            "ggstudio_model_eviction_duration_seconds",
            "Seconds to stop a model's llama-server",
            ["model"],
            buckets=_STOP_BUCKETS,
            registry=r,
        )
        self.crashes = Counter(
            "ggstudio_llama_server_crashes",
            "Times a model's llama-server died or hung after it was ready",
            ["model"],
            registry=r,
        )
        self.restarts = Counter(
            "ggstudio_llama_server_restarts", "Automatic restarts after a crash", ["model"], registry=r
        )
        self.phases = PhaseHistograms()
        r.register(self.phases)
        self.status = StatusCollector(manager)
        r.register(self.status)
        self.holds = Counter(
            "ggstudio_admission_holds",
            "Times a busy model stopped taking new requests for a load waiting for its memory "
            "(grouping: after a group of a few more; paused_for_load: at once)",
            ["model", "admission"],
            registry=r,
        )
        manager.listeners.append(self.on_residency)
        manager.admission_listeners.append(self.on_admission)

    def on_residency(self, event: ResidencyEvent) -> None:
        """Count a load, an eviction, a crash or a restart the manager reports."""
        if event.kind == "loaded":
            self.loads.labels(event.model, "ok").inc()
            self.load_seconds.labels(event.model).observe(event.seconds)
        elif event.kind == "load_failed":
            self.loads.labels(event.model, event.reason or "error").inc()
        elif event.kind == "evicted":
            self.evictions.labels(event.model, event.reason).inc()
            self.eviction_seconds.labels(event.model).observe(event.seconds)
        elif event.kind == "crashed":
            self.crashes.labels(event.model).inc()
        else:
            self.restarts.labels(event.model).inc()

    def on_admission(self, event: AdmissionEvent) -> None:
        """Count a model held back for a load (a move to ``accepting`` ends a hold: nothing to count)."""
        if event.new != "accepting":
            self.holds.labels(event.model, event.new).inc()

    def observe_generation(
        self,
        listener: Listener,
        route: str,
        model: str,
        *,
        began: float,
        first_at: float | None,
        tail: bytes,
        ended: float | None = None,
    ) -> None:
        """Count one finished answer from its timing and its last bytes (``perf_counter`` times)."""
        tokens, rate = generation_counts(tail)
        ended = time.perf_counter() if ended is None else ended
        if rate is None and tokens and first_at is not None and ended > first_at:
            rate = tokens / (ended - first_at)
        self.observe_counts(
            listener,
            route,
            model,
            first_token_s=None if first_at is None else first_at - began,
            tokens=tokens,
            rate=rate,
        )

    def observe_counts(
        self,
        listener: Listener,
        route: str,
        model: str,
        *,
        first_token_s: float | None,
        tokens: int | None,
        rate: float | None,
    ) -> None:
        """Count one answer whose figures the caller already has (the streams that are parsed anyway)."""
        if first_token_s is not None:
            self.child(self.first_token_seconds, listener, model, route).observe(first_token_s)
        if tokens:
            self.child(self.tokens, listener, model, route).inc(tokens)
        if rate:
            self.child(self.tokens_per_second, model).observe(rate)

    def observe_phases(self, model: str, route: str, phases: Mapping[str, float]) -> None:
        """Count a finished generating request's phases (``studio.activity``'s record); a phase it skipped is not."""
        self.phases.observe(model, route, phases)

    def child(self, metric: MetricWrapperBase, *values: str) -> Any:
        """``metric.labels(*values)``, kept by its values: ``labels`` checks the values and takes a lock on every
        call, five times a forwarded request (~2 % of its CPU, ``scripts/bench_proxy.py``)."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    async def render(self, upstream: Upstream) -> bytes:
        """The text exposition, with the resident llama-servers' speculative counters read just now."""
        await self.status.refresh_speculative(upstream)
        return generate_latest(self.registry)


class PhaseHistograms(Collector):
    """``ggstudio_request_phase_seconds{phase, model, route}``: each generating request's phases, as histograms.

    Counted in plain lists, one ``bisect`` an observation, and turned into histogram families at scrape time:
    ``Histogram.observe`` takes a lock and walks the buckets in Python, and four of them a request were most of
    what its activity record cost (``scripts/bench_proxy.py``'s CPU per request).
    """

    def __init__(self) -> None:
        # per (model, route), then per phase: bucket counts, then the sum (one look-up of the pair a request)
        self._counts: dict[tuple[str, str], dict[str, list[float]]] = {}

    def observe(self, model: str, route: str, phases: Mapping[str, float]) -> None:
        per = self._counts.get((model, route))
        if per is None:
            per = self._counts[(model, route)] = {}
        for phase, seconds in phases.items():
            if seconds <= 0:
                continue
            found = per.get(phase)
            if found is None:
                found = per[phase] = [0.0] * (len(_LATENCY_BUCKETS) + 2)
            found[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
            found[-1] += seconds

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(
            "ggstudio_request_phase_seconds",
            "Seconds a generating request spent in each phase (queued: behind other clients, for the model or a slot; "
            "load_wait: waiting for its model's load, "
            "prefill: to the first byte, decode: from it to the end), by model and route",
            labels=["phase", "model", "route"],
        )
        for (model, route), per in list(self._counts.items()):
            for phase, found in list(per.items()):
                family.add_metric([phase, model, route], _buckets(found), found[-1])
        yield family


def _buckets(found: list[float]) -> list[tuple[str, float]]:
    """The cumulative buckets of a phase's counts (the last item, the sum, is left out)."""
    running, buckets = 0.0, []
    for bound, n in zip((*_LATENCY_BUCKETS, float("inf")), found[:-1], strict=True):
        running += n
        buckets.append((str(bound) if bound != float("inf") else "+Inf", running))
    return buckets


class StatusCollector(Collector):
    """Gauges of what is true at scrape time: the figures of ``/api/status`` (``status_json``)."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager
        self._speculative: dict[str, dict[str, float]] = {}  # model -> llama-server's spec counters

    async def refresh_speculative(self, upstream: Upstream) -> None:
        """Read each ready model's own ``/metrics``; a server that does not answer keeps no figures this time."""
        found: dict[str, dict[str, float]] = {}
        for r in self.manager.residents:
            loaded = r.loaded
            if r.state is not ResidentState.READY or loaded is None:
                continue
            try:
                text = (
                    await upstream.get(loaded.url + "/metrics", loaded.auth_headers, timeout=UPSTREAM_SCRAPE_TIMEOUT)
                ).decode()
                found[r.name] = {
                    f.name: f.samples[0].value
                    for f in text_string_to_metric_families(text)
                    if f.name in _SPECULATIVE and f.samples
                }
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("llama-server /metrics unreadable", model=r.name, error=str(exc))
        self._speculative = found

    def collect(self) -> Iterable[Metric]:
        status = status_json(self.manager)
        resident = GaugeMetricFamily("ggstudio_model_resident", "1 for each model serving requests", labels=["model"])
        in_flight = GaugeMetricFamily(
            "ggstudio_requests_in_flight", "Requests a model is answering now", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "ggstudio_requests_waiting",
            "Requests queued for a model to be placed and started (one queue for all models)",
        )
        memory = GaugeMetricFamily(
            "ggstudio_model_memory_bytes",
            "Memory per model and device: the plan's bill (predicted) and what llama-server "
            "reported allocating (actual), as /api/status's by_device",
            labels=["model", "device", "kind"],
        )
        waiting.add_metric([], status.get("waiting", 0))
        for model in status["models"]:
            name = model["model"]
            in_flight.add_metric([name], model.get("in_flight", 0))
            if model["state"] == ResidentState.READY.value:
                resident.add_metric([name], 1)
            for kind in ("predicted", "actual"):
                bill = (model.get("memory") or {}).get(kind) or {}
                for device, total in (bill.get("by_device") or {}).items():
                    memory.add_metric([name, device, kind], total)
        yield from (resident, in_flight, waiting, memory)
        yield from self._speculative_families()

    def _speculative_families(self) -> Iterator[Metric]:
        families = {
            source: CounterMetricFamily(name, help, labels=["model"]) for source, (name, help) in _SPECULATIVE.items()
        }
        ratio = GaugeMetricFamily(
            "ggstudio_speculative_acceptance_ratio",
            "Accepted over proposed draft tokens since the model's llama-server started",
            labels=["model"],
        )
        for model, values in self._speculative.items():
            for source, value in values.items():
                families[source].add_metric([model], value)
            drafted = values.get("llamacpp:spec_decode_num_draft_tokens", 0)
            if drafted:
                ratio.add_metric([model], values.get("llamacpp:spec_decode_num_accepted_tokens", 0) / drafted)
        yield from families.values()
        yield ratio


def listener_of(scope: Scope) -> Listener:
    """The listener a request came to, as ``RequestMetrics`` noted it (the studio's, for an app without it)."""
    return scope.get(LISTENER, "studio")


class RequestMetrics:
    """Pure ASGI middleware: count each HTTP request by route and status, and time it to its last byte.

    The route is the matched route's template (``/api/models/{name:path}``), a path in ``known``
    (routes served ahead of the router), or ``other``, so unknown paths cannot grow the label set.
    It names its listener in the request's scope (``LISTENER``) for the generation counts.
    """

    def __init__(self, app: ASGIApp, metrics: StudioMetrics, listener: Listener, known: Iterable[str] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.listener = listener
        self.known = frozenset(known)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500  # what the client gets when the app raises before it answers
        scope[LISTENER] = self.listener

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            path = scope["path"]
            label = getattr(route, "path", None) or (path if path in self.known else "other")
            metrics = self.metrics
            metrics.child(metrics.requests, self.listener, label, str(status)).inc()
            metrics.child(metrics.request_seconds, self.listener, label).observe(time.perf_counter() - began)
