"""`specmesh loadtest` / `python -m loadtest.run`: drive a specmesh router with a workload
(loadtest.workload) over gRPC or the OpenAI HTTP API (loadtest.backends), at one or several load
levels, optionally A/B with speculation on and off in the same run; print a table, write JSON with
vLLM's field names (loadtest.metrics) and PNG plots (loadtest.plots, when matplotlib is there).

    specmesh loadtest --grpc 127.0.0.1:50050 --ab --num-prompts 8 --max-concurrency 1,2,4
    specmesh loadtest --target-url http://127.0.0.1:8000 --request-rate 2 --burstiness 0.5
    specmesh loadtest --grpc ... --ab --rounds 4 --long-fraction 0.25 --slo-ttft-ms 500 --slo-tpot-ms 80

Bounded: at most MAX_REQUESTS requests and --max-duration-s seconds (in-flight requests are then
cancelled and counted as failed); targets must be loopback addresses unless --allow-remote.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import socket
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from loadtest import plots, scrape
from loadtest.backends import GrpcBackend, HttpBackend, Sampling, SessionState
from loadtest.metrics import DEFAULT_PERCENTILES, RequestRecord, Slo, ab_comparison, identical_outputs, summarize
from loadtest.progress import Progress
from loadtest.report import markdown, table
from loadtest.workload import SPEC_OFF, SPEC_ON, WorkloadSpec, ab_jobs, arrival_offsets, build_units, messages_for
from specmesh import tls
from specmesh.tls import ClientTls

MAX_REQUESTS = 5000


@dataclass(frozen=True)
class Level:
    max_concurrency: int | None      # None = unbounded
    request_rate: float              # inf = closed loop (everything queued at once)
    burstiness: float = 1.0

    def to_dict(self) -> dict:
        rate = "inf" if math.isinf(self.request_rate) else self.request_rate
        return {"max_concurrency": self.max_concurrency, "request_rate": rate, "burstiness": self.burstiness}


@dataclass(frozen=True)
class LoadtestConfig:
    grpc: str = ""                   # router gRPC HOST:PORT, or
    target_url: str = ""             # router HTTP base URL (http://HOST:PORT)
    api_key: str | None = None
    tls: ClientTls = field(default_factory=ClientTls)  # TLS / mTLS to the router (both APIs, scrapes)
    model: str = ""                  # HTTP `model` field ("" = the router's)
    tokenizer: str | None = None     # gRPC: the chat template's tokenizer (None = bundled SmolLM2)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    sampling: Sampling = field(default_factory=Sampling)
    levels: tuple[Level, ...] = (Level(4, math.inf),)
    ab: bool = False                 # speculation on and off, interleaved (gRPC)
    speculate: bool = True           # the single arm's setting when not A/B
    slo: Slo = field(default_factory=Slo)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    max_duration_s: float = 600.0
    request_timeout_s: float = 300.0
    scrape: tuple[str, ...] = ()     # extra Prometheus URLs (HTTP targets add their own /metrics)
    out: str = "loadtest_result.json"
    plots: bool = True
    progress: bool = True
    allow_remote: bool = False

    @property
    def arms(self) -> tuple[str, ...]:
        return (SPEC_ON, SPEC_OFF) if self.ab else ((SPEC_ON,) if self.speculate else (SPEC_OFF,))

    @property
    def scrape_urls(self) -> tuple[str, ...]:
        own = (self.target_url.rstrip("/") + "/metrics",) if self.target_url else ()
        return own + tuple(u for u in self.scrape if u not in own)

    def total_requests(self) -> int:
        return len(self.levels) * len(self.arms) * self.workload.units * self.workload.rounds

    def validate(self) -> None:
        if bool(self.grpc) == bool(self.target_url):
            raise ValueError("target: give exactly one of --grpc HOST:PORT and --target-url http://HOST:PORT")
        self.workload.validate()
        if self.sampling.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.sampling.max_tokens}")
        if self.total_requests() > MAX_REQUESTS:
            raise ValueError(f"requests: {self.total_requests()} planned, at most {MAX_REQUESTS}")
        if not 0 < self.max_duration_s <= 24 * 3600:
            raise ValueError(f"max_duration_s: must be in (0, 86400], got {self.max_duration_s}")
        for lv in self.levels:
            if lv.max_concurrency is not None and lv.max_concurrency < 1:
                raise ValueError(f"max_concurrency: must be >= 1, got {lv.max_concurrency}")
            if lv.request_rate <= 0 or lv.burstiness <= 0:
                raise ValueError("request_rate and burstiness: must be > 0")
        for host in [_host_of_grpc(self.grpc)] if self.grpc else []:
            check_loopback(host, self.allow_remote)
        for url in ([self.target_url] if self.target_url else []) + list(self.scrape):
            check_loopback(urlparse(url).hostname or "", self.allow_remote)


def _host_of_grpc(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"grpc: HOST:PORT, got {address!r}")
    return host.strip("[]")


def check_loopback(host: str, allow_remote: bool) -> None:
    """ValueError unless `host` is (or resolves only to) loopback addresses, or remote is allowed."""
    if allow_remote:
        return
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            addrs = {ipaddress.ip_address(ai[4][0]) for ai in socket.getaddrinfo(host, None)}
        except (OSError, UnicodeError) as e:
            raise ValueError(f"target: cannot resolve {host!r} ({e})") from e
    if not addrs or not all(a.is_loopback for a in addrs):
        raise ValueError(f"target: {host!r} is not a loopback address; load tests stay on this machine "
                         "unless --allow-remote")


# -- the run -------------------------------------------------------------------------------------
async def run_level(backend, cfg: LoadtestConfig, level: Level, tag: str, deadline: float,
                    progress: Progress) -> tuple[list[RequestRecord], float, int]:
    """Every (unit, arm) job of the workload at this load: (records, duration, session rebuilds)."""
    jobs = ab_jobs(build_units(cfg.workload), cfg.arms)
    offsets = arrival_offsets(len(jobs), level.request_rate, level.burstiness, cfg.workload.seed)
    gate = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
    records: list[RequestRecord] = []
    rebuilds = 0
    t0 = time.perf_counter()

    async def job(offset: float, unit, arm: str) -> None:
        nonlocal rebuilds
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        if gate is not None:
            await gate.acquire()
        try:
            state = SessionState(f"{tag}-u{unit.index}-{arm}" if unit.rounds > 1 else "")
            for turn in range(unit.rounds):
                rec = RequestRecord(arm, unit.index, turn)
                records.append(rec)
                await backend.send(state, messages_for(unit, state.replies), cfg.sampling, arm == SPEC_ON, rec)
                progress.update(rec)
                if not rec.success:  # the session cannot go on without this turn's reply
                    break
            rebuilds += state.rebuilds
            await backend.end_session(state)
        finally:
            if gate is not None:
                gate.release()

    tasks = [asyncio.ensure_future(job(off, u, a)) for off, (u, a) in zip(offsets, jobs)]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter()
    for rec in records:
        if not rec.success and not rec.error:  # cut off by the time limit
            rec.end, rec.error = rec.end or end, "cancelled: --max-duration-s reached"
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return records, end - t0, rebuilds


async def run_async(cfg: LoadtestConfig) -> dict:
    ssl_context = cfg.tls.ssl_context()  # one for the HTTP backend and the scrapes
    backend = await _backend(cfg, ssl_context)
    before = {u: scrape.try_fetch(u, ssl_context) for u in cfg.scrape_urls}
    deadline = time.monotonic() + cfg.max_duration_s
    progress = Progress(cfg.total_requests(), enabled=cfg.progress)
    runs = []
    tag = f"lt{int(time.time())}"
    try:
        for i, level in enumerate(cfg.levels):
            if time.monotonic() >= deadline:
                break
            records, duration, rebuilds = await run_level(backend, cfg, level, f"{tag}-{i}", deadline, progress)
            runs.append(run_result(cfg, level, records, duration, rebuilds))
    finally:
        progress.close()
        await backend.close()
    after = {u: scrape.try_fetch(u, ssl_context) for u in cfg.scrape_urls}
    return {
        "backend": "grpc" if cfg.grpc else "http",
        "target": cfg.grpc or cfg.target_url,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": _config_dict(cfg),
        "runs": runs,
        "server_metrics": [scrape.report(u, before[u], after[u]) for u in cfg.scrape_urls],
    }


def run_result(cfg: LoadtestConfig, level: Level, records: list[RequestRecord], duration: float,
                rebuilds: int) -> dict:
    arms = {arm: summarize([r for r in records if r.arm == arm], duration, cfg.slo, cfg.percentiles)
            for arm in cfg.arms}
    planned = len(cfg.arms) * cfg.workload.units * cfg.workload.rounds
    res = {"level": level.to_dict(), "duration": duration, "session_rebuilds": rebuilds,
           "not_sent": planned - len(records),  # after the time limit, or turns after a failed one
           "request_throughput": sum(a["request_throughput"] for a in arms.values()),
           "output_throughput": sum(a["output_throughput"] for a in arms.values()), "arms": arms}
    if cfg.ab:
        res["ab"] = ab_comparison(arms[SPEC_ON], arms[SPEC_OFF])
        same, pairs = identical_outputs(records)
        res["ab"]["identical_outputs"] = {"same": same, "pairs": pairs,
                                          "checked": cfg.sampling.temperature == 0}
    return res


async def _backend(cfg: LoadtestConfig, ssl_context: ssl.SSLContext | None):
    if cfg.target_url:
        return HttpBackend(cfg.target_url, cfg.api_key, cfg.request_timeout_s, cfg.model, ssl_context)
    from specmesh.loader import bundled_target_path, load_tokenizer

    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.tokenizer or bundled_target_path())
    return GrpcBackend(cfg.grpc, tokenizer, cfg.api_key, cfg.request_timeout_s, cfg.tls)


def _config_dict(cfg: LoadtestConfig) -> dict:
    d = asdict(cfg)
    d["levels"] = [lv.to_dict() for lv in cfg.levels]
    d["api_key"] = "***" if cfg.api_key else None
    d["arms"] = list(cfg.arms)
    return d


def run(cfg: LoadtestConfig) -> int:
    """Run, print the table, write JSON and plots; 0 when every planned request completed, else 1."""
    cfg.validate()
    result = asyncio.run(run_async(cfg))
    print(table(result), flush=True)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"result: {out} (table: {out.with_suffix('.md')})", file=sys.stderr)
    if cfg.plots and result["runs"]:
        if plots.available():
            for p in plots.write_plots(result, out):
                print(f"plot: {p}", file=sys.stderr)
        else:
            print("plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    failed = sum(a["failed"] for r in result["runs"] for a in r["arms"].values())
    not_sent = sum(r["not_sent"] for r in result["runs"])
    return 0 if failed == 0 and not_sent == 0 and len(result["runs"]) == len(cfg.levels) else 1


# -- flags ---------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--grpc", default="", help="router gRPC HOST:PORT (the SDK; needed for --ab)")
    t.add_argument("--target-url", default="", help="router HTTP base URL, e.g. http://127.0.0.1:8000")
    t.add_argument("--api-key", default=None)
    t.add_argument("--model", default="", help="HTTP: the model name to send (default: the router's)")
    t.add_argument("--tokenizer", default=None, help="gRPC: tokenizer for the chat template (default: bundled)")
    t.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    tls.add_client_args(p)
    w = p.add_argument_group("workload")
    d = WorkloadSpec()
    w.add_argument("--num-prompts", type=int, default=d.units, help="prompts (or sessions) per arm and level")
    w.add_argument("--rounds", type=int, default=d.rounds, help="turns per session (1 = one-shot requests)")
    w.add_argument("--long-fraction", type=float, default=d.long_fraction,
                   help="share of sessions that start with a long document")
    w.add_argument("--long-words", type=int, default=d.long_words, help="length of that document (words)")
    w.add_argument("--seed", type=int, default=d.seed)
    s = p.add_argument_group("generation")
    s.add_argument("--max-tokens", type=int, default=Sampling.max_tokens, help="output tokens per turn")
    s.add_argument("--temperature", type=float, default=Sampling.temperature, help="0 = greedy (default)")
    s.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    s.add_argument("--ab", action="store_true", help="speculation on and off in the same run, interleaved (gRPC)")
    s.add_argument("--no-speculation", action="store_true", help="one arm, speculation off (gRPC)")
    lo = p.add_argument_group("load")
    lo.add_argument("--max-concurrency", default="4",
                    help="requests in flight, or a comma list of levels (closed loop); 0 = unbounded")
    lo.add_argument("--request-rate", default="inf",
                    help="requests/s of open-loop arrivals, or a comma list of levels; inf = closed loop")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    lo.add_argument("--max-duration-s", type=float, default=LoadtestConfig.max_duration_s)
    lo.add_argument("--request-timeout-s", type=float, default=LoadtestConfig.request_timeout_s)
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: time to first token objective")
    r.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: time per output token objective")
    r.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput: end-to-end latency objective")
    r.add_argument("--metric-percentiles", default="90,99")
    r.add_argument("--scrape", action="append", default=[], help="also scrape this Prometheus URL (repeatable)")
    r.add_argument("--out", default=LoadtestConfig.out, help="result JSON (plots are written next to it)")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", action="store_true")


def config_from_args(a: argparse.Namespace) -> LoadtestConfig:
    conc = [int(x) or None for x in _floats(a.max_concurrency)]
    rates = _floats(a.request_rate)
    if len(conc) > 1 and len(rates) > 1:
        raise ValueError("levels: sweep --max-concurrency or --request-rate, not both")
    levels = tuple(Level(c, r, a.burstiness) for c in conc for r in rates)
    return LoadtestConfig(
        grpc=a.grpc, target_url=a.target_url, api_key=a.api_key, tls=tls.client_from_args(a), model=a.model,
        tokenizer=a.tokenizer,
        workload=WorkloadSpec(units=a.num_prompts, rounds=a.rounds, long_fraction=a.long_fraction,
                              long_words=a.long_words, seed=a.seed),
        sampling=Sampling(a.max_tokens, a.temperature, a.ignore_eos),
        levels=levels, ab=a.ab, speculate=not a.no_speculation,
        slo=Slo(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2el_ms), percentiles=tuple(_floats(a.metric_percentiles)),
        max_duration_s=a.max_duration_s, request_timeout_s=a.request_timeout_s, scrape=tuple(a.scrape),
        out=a.out, plots=not a.no_plots, progress=not a.no_progress, allow_remote=a.allow_remote)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description="Load test a specmesh router.")
    add_arguments(p)
    try:
        return run(config_from_args(p.parse_args(argv)))
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
