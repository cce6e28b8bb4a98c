"""Prometheus metrics without a dependency: counters, gauges and histograms (thread-safe), rendered
in the text exposition format 0.0.4, and a tiny exporter (`/metrics` from the stdlib http.server in
a daemon thread). Used by the verifier and drafter services (their own metrics.py say what they
measure); the router renders its counters itself (router.metrics).

Knows nothing of what is measured.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for n, v in zip(names, values))
    return "{" + inner + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        assert amount >= 0, "a counter only goes up"
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    """A value read at scrape time from `read()`; with `labels`, `read()` returns label values ->
    value for every series."""
    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float] | Callable[[], dict],
                 labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self.read = read

    def render(self) -> list[str]:
        if not self.label_names:
            return self.header() + [f"{self.name} {_num(self.read())}"]
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}"
                                for k, v in sorted(self.read().items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        assert list(buckets) == sorted(buckets) and buckets, "buckets: ascending, at least one"
        self.buckets = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines, acc = self.header(), 0
        for b, n in zip((*map(_num, self.buckets), "+Inf"), counts):
            acc += n
            lines.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        return lines + [f"{self.name}_sum {_num(total)}", f"{self.name}_count {acc}"]


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric):
        assert all(m.name != metric.name for m in self.metrics), f"duplicate metric {metric.name}"
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


def start_exporter(host: str, port: int, render: Callable[[], str]) -> ThreadingHTTPServer:
    """Serve `render()` at http://host:port/metrics from a daemon thread; `shutdown()` stops it.
    Port 0 picks a free one (`server.server_address[1]`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's naming
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics")
                return
            body = render().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every few seconds: no access log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-exporter", daemon=True).start()
    return server
