"""Prometheus metrics for one daemon: calls, latency, errors by type, pool state, per backend.

Counters and histograms are updated as calls end; gauges of the pool, the
dispatcher and the idempotency store are read from their ``statistics()``
at scrape time, so nothing here runs in the background. Every daemon has its
own registry (several can live in one process, as in tests).

Label values are bounded: a tool name the registry does not know is counted
as ``(unknown)``, so a caller cannot grow the label space. This module must
never block a call on a scrape.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent_backend.dispatch import Backend, Dispatcher, ToolResult

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
_UNKNOWN = "(unknown)"
# Aggregates some pool statistics offer as properties rather than fields.
_POOL_PROPERTIES = ("leases_active", "leases_queued", "connections_open", "connections_idle")


def _numeric(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


class _StateCollector(Collector):
    """Gauges read at scrape time from the dispatcher, its pool and the daemon."""

    def __init__(self, dispatcher: Dispatcher, extra: Callable[[], dict[str, float]]) -> None:
        self.dispatcher = dispatcher
        self.extra = extra

    def collect(self) -> Iterator[GaugeMetricFamily]:
        backend = self.dispatcher.pool.kind
        stats = self.dispatcher.statistics()
        for name, help_text, value in (
            ("agent_backend_calls_in_flight", "Tool calls running now.", stats.calls_in_flight),
            ("agent_backend_sessions_open", "Sessions with a workspace now.", stats.sessions_open),
            (
                "agent_backend_sessions_reaped",
                "Sessions closed by the idle reaper since start.",
                stats.sessions_reaped,
            ),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["backend"])
            family.add_metric([backend], float(value))
            yield family
        families: dict[str, GaugeMetricFamily] = {}  # one family per name, a sample per pool
        for name, pool in self.dispatcher.pools.items():
            self._pool(name, pool, families)
        yield from families.values()
        for extra_name, extra_value in self.extra().items():
            extra = GaugeMetricFamily(f"agent_backend_{extra_name}", extra_name.replace("_", " "))
            extra.add_metric([], extra_value)
            yield extra

    def _pool(self, name: str, pool: Backend, families: dict[str, GaugeMetricFamily]) -> None:
        """One pool's gauges, labelled with its kind and its name in the daemon's set of pools."""
        labels = [pool.kind, name]

        def add(metric: str, help_text: str, value: float, host: str | None = None) -> None:
            family = families.get(metric)
            if family is None:
                names = ["backend", "pool"] if host is None else ["backend", "pool", "host"]
                family = families[metric] = GaugeMetricFamily(metric, help_text, labels=names)
            family.add_metric(labels if host is None else [*labels, host], value)

        add(
            "agent_backend_pool_hosts_up",
            "Hosts of the pool that are up (for a Ray pool: live actors).",
            float(pool.capacity()[0]),
        )
        stats: Any = pool.statistics()
        if not dataclasses.is_dataclass(stats):
            return
        values: dict[str, float] = {}
        hosts: list[Any] = []
        for field in dataclasses.fields(stats):
            value = getattr(stats, field.name)
            number = _numeric(value)
            if number is not None:
                values[field.name] = number
            elif isinstance(value, tuple) and all(dataclasses.is_dataclass(v) for v in value):
                hosts.extend(value)
        for prop in _POOL_PROPERTIES:
            number = _numeric(getattr(stats, prop, None))
            if number is not None:
                values.setdefault(prop, number)
        for field_name, number in values.items():
            add(
                f"agent_backend_pool_{field_name}",
                f"The pool's {field_name.replace('_', ' ')}.",
                number,
            )
        for host in hosts:
            label = str(getattr(host, "host", getattr(host, "name", "?")))
            for field in dataclasses.fields(host):
                number = _numeric(getattr(host, field.name))
                if number is not None:
                    add(
                        f"agent_backend_pool_host_{field.name}",
                        f"One host's {field.name.replace('_', ' ')}.",
                        number,
                        host=label,
                    )


class Metrics:
    """The daemon's Prometheus registry and the updates the routes make."""

    def __init__(
        self, dispatcher: Dispatcher, *, extra: Callable[[], dict[str, float]] | None = None
    ) -> None:
        self.dispatcher = dispatcher
        self.backend = dispatcher.pool.kind
        # No `*_created` series: they double the exposition and say nothing useful here.
        # (A process-wide prometheus_client setting.)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        self.calls = Counter(
            "agent_backend_calls",
            "Tool calls that ended, by tool and outcome (ok, error: a failed result, raised: "
            "an infrastructure error).",
            ["backend", "tool", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "agent_backend_call_duration_seconds",
            "Seconds from the start of dispatch to the result, by tool.",
            ["backend", "tool"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "agent_backend_call_errors",
            "Calls that failed, by error type (a result's error_type, or the raised class).",
            ["backend", "type"],
            registry=self.registry,
        )
        self.registry.register(_StateCollector(dispatcher, extra or dict))
        # The labelled series of each (tool, ok) pair: ``labels()`` takes a lock and
        # builds a key on every call, and every call ends here. Bounded by the tools.
        self._series: dict[tuple[str, bool], tuple[Any, Any]] = {}

    def _tool(self, name: str) -> str:
        registry = self.dispatcher.registry
        return name if name in registry else _UNKNOWN

    def observe(self, result: ToolResult) -> None:
        series = self._series.get((result.tool, result.ok))
        if series is None:
            tool = self._tool(result.tool)
            series = (
                self.calls.labels(self.backend, tool, "ok" if result.ok else "error"),
                self.latency.labels(self.backend, tool),
            )
            if tool != _UNKNOWN:
                self._series[(result.tool, result.ok)] = series
        series[0].inc()
        series[1].observe(result.duration)
        if not result.ok:
            self.errors.labels(self.backend, result.error_type or "error").inc()

    def observe_error(self, tool: str, error: BaseException, duration: float) -> None:
        name = self._tool(tool)
        self.calls.labels(self.backend, name, "raised").inc()
        self.latency.labels(self.backend, name).observe(duration)
        self.errors.labels(self.backend, type(error).__name__).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
