"""Prometheus scrapes for the load-test report: fetch a /metrics page before and after the run and
keep what changed. Parsing covers the text format's sample lines (`name{labels} value`); comments,
timestamps and exemplars are ignored."""

from __future__ import annotations

import math
import ssl
import urllib.error
import urllib.request

SCRAPE_TIMEOUT_S = 5.0


def parse_prometheus(text: str) -> dict[str, float]:
    """`{'name{labels}': value}` of every sample line."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            end = line.rfind("}") + 1
            name, rest = line[:end], line[end:]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            out[name.strip()] = float(fields[0])
        except ValueError:
            continue
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every sample that changed (new samples count from 0)."""
    out = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if d and not math.isnan(d):
            out[k] = d
    return out


def fetch(url: str, context: ssl.SSLContext | None = None) -> dict[str, float]:
    """The samples of `url` (raises OSError / ValueError); `context` for https URLs."""
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S, context=context) as resp:
        return parse_prometheus(resp.read().decode("utf-8", "replace"))


def try_fetch(url: str, context: ssl.SSLContext | None = None) -> dict[str, float] | str:
    """Samples, or the error as text (a scrape never fails a load test)."""
    try:
        return fetch(url, context)
    except (OSError, ValueError, urllib.error.URLError) as e:
        return f"{type(e).__name__}: {e}"


def report(url: str, before: dict[str, float] | str, after: dict[str, float] | str) -> dict:
    if isinstance(before, str) or isinstance(after, str):
        return {"url": url, "error": before if isinstance(before, str) else after}
    return {"url": url, "delta": delta(before, after), "after": after}
