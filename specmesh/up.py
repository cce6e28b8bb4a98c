"""`specmesh up`: a whole local deployment in one command (specmesh.cluster), its endpoints, a ready
line, and a clean stop on Ctrl-C / SIGTERM / SIGHUP; a child that exits on its own is reported and
started again on the same addresses while the others go on serving (a crash loop, more than 3
restarts of one child in a minute, stops the cluster with exit code 1). `--demo` runs one streamed chat generation through the
router with the SDK, prints the text as it streams and the speculation stats, then stops (exit 0).

Output (stdout): one line per process, then `specmesh ready: grpc HOST:PORT http http://HOST:H`.
Progress, child output after the ready line, and errors go to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from specmesh.cluster import Cluster, ClusterError, ClusterSpec
from specmesh.drafters import resolve_auto
from specmesh.redis_server import redacted

DEMO_PROMPT = "Explain speculative decoding in two sentences."
DEMO_TIMEOUT_S = 600.0
EXIT_CRASH = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class UpConfig:
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    demo: bool = False
    prompt: str = DEMO_PROMPT          # --demo only
    max_tokens: int = 96               # --demo only


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    d = ClusterSpec()
    p.add_argument("--drafters", type=int, default=d.drafters, help="drafter services (default 1)")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks of the verifier (default 1)")
    p.add_argument("--redis-url", default=env("SPECMESH_REDIS_URL", ""),
                   help="use this Redis (default: an embedded redis-server on a free port)")
    p.add_argument("--target", default=env("SPECMESH_TARGET"), help="HF folder, .safetensors or .gguf "
                   "(default: the bundled SmolLM2)")
    p.add_argument("--drafter", default="auto", help="auto | ngram | model:PATH (auto: the bundled trained "
                   "drafter with the bundled target, else ngram)")
    p.add_argument("--port", type=int, default=d.port, help="router gRPC port (default: a free one)")
    p.add_argument("--http-port", type=int, default=d.http_port,
                   help="router HTTP port (default: a free one; -1 = no HTTP API)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads per service and TP rank (default 0 = auto: the machine's cores for each "
                        "service, a TP rank its share; drafting and verification then take turns)")
    p.add_argument("--dtype", default=env("SPECMESH_DTYPE", d.dtype),
                   help="weights of the verifier and model drafters (specmesh.device; default auto: a GGUF as it "
                        "ships where that measured fastest here, any other checkpoint float32)")
    p.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoints on the verifier and drafters")
    p.add_argument("--tls-cert", default=env("SPECMESH_TLS_CERT", ""),
                   help="PEM certificate (naming 127.0.0.1) every service presents; with --tls-key and --tls-ca: "
                        "TLS on the router's ports, mTLS between services")
    p.add_argument("--tls-key", default=env("SPECMESH_TLS_KEY", ""), help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=env("SPECMESH_TLS_CA", ""), help="PEM CA that signed --tls-cert")
    p.add_argument("--no-service-token", action="store_true",
                   help="leave the verifier's and drafters' ports open to whoever reaches them (default: they "
                        "require a shared token, $SPECMESH_SERVICE_TOKEN or one generated per start)")
    p.add_argument("--demo", action="store_true", help="run one streamed chat generation, print stats, stop")
    p.add_argument("--prompt", default=UpConfig.prompt, help="--demo: the user message")
    p.add_argument("--max-tokens", type=int, default=UpConfig.max_tokens, help="--demo: tokens to generate")


def config_from_args(a: argparse.Namespace) -> UpConfig:
    spec = ClusterSpec(drafters=a.drafters, tp=a.tp, redis_url=a.redis_url, target=a.target,
                       drafter=resolve_auto(a.drafter, a.target),
                       port=a.port, http_port=a.http_port, threads=a.threads, dtype=a.dtype, metrics=not a.no_metrics,
                       tls_cert=a.tls_cert, tls_key=a.tls_key, tls_ca=a.tls_ca, service_token=not a.no_service_token)
    spec.validate()
    if a.max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {a.max_tokens}")
    return UpConfig(spec, a.demo, a.prompt, a.max_tokens)


def _err(msg: str) -> None:
    try:
        print(f"specmesh up: {msg}", file=sys.stderr, flush=True)
    except OSError:  # stderr is gone (a pipe whose reader left): never let that stop the shutdown
        pass


def _echo(name: str, line: str) -> None:
    try:
        sys.stderr.write(f"[{name}] {line if line.endswith(chr(10)) else line + chr(10)}")
        sys.stderr.flush()
    except OSError:
        pass


def print_endpoints(cluster: Cluster) -> None:
    """One line per process (name, address, pid, what it is, its metrics), then the ready line."""
    s = cluster.spec
    http = f"{'https' if s.tls_cert else 'http'}://{cluster.http_address}" if cluster.http_address else "off"
    for name, address, pid, metrics in cluster.endpoints():
        what = {"redis": "embedded", "verifier": f"tp={s.tp}"}.get(name, "")
        if name == "router":
            address = f"grpc {cluster.grpc_address}"
            what = f"http {http} (OpenAI API, /metrics)" if cluster.http_address else ""
        elif name.startswith("drafter-"):
            what = s.drafter
        what += f" metrics {metrics}" if metrics else ""
        print(f"  {name:<20} {address:<32} pid {pid:<8} {what.strip()}".rstrip(), flush=True)
    if cluster.redis is None:
        print(f"  {'redis':<20} {redacted(cluster.redis_url)} (external)", flush=True)
    if cluster.service_token:
        print("  internal ports (verifier, drafters) require a service token: set $SPECMESH_SERVICE_TOKEN "
              "before `specmesh up` to choose it (else one is generated, known to the children only)", flush=True)
    print(f"specmesh ready: grpc {cluster.grpc_address} http {http}", flush=True)


def summary(completion, seconds: float, ttft_s: float | None) -> str:
    """Speculation stats of one generation, in one paragraph."""
    sp, n = completion.speculation, len(completion.token_ids)
    ttft = f", first token after {ttft_s:.2f} s" if ttft_s is not None else ""
    return (f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tok/s{ttft}), finish: "
            f"{completion.finish_reason}\n"
            f"speculation: {sp.steps} verify steps, {sp.drafted_tokens} drafted, {sp.accepted_tokens} accepted "
            f"(acceptance {sp.acceptance_rate:.2f}, {sp.tokens_per_step:.2f} tokens/step), "
            f"predraft hits {sp.predraft_hits}, drafter timeouts {sp.drafter_timeouts}, "
            f"draft {sp.draft_s:.2f} s, verify {sp.verify_s:.2f} s")


def run_demo(cfg: UpConfig, grpc_address: str, stop: threading.Event) -> None:
    """One chat generation through the router: the chat template applied here, token ids sent."""
    from specmesh.client import Client
    from specmesh.loader import bundled_target_path, load_tokenizer
    from specmesh.runtime import encode_prompt

    tok = load_tokenizer(cfg.cluster.target or bundled_target_path())
    ids = encode_prompt(tok, cfg.prompt, chat=True)
    print(f"\n>>> {cfg.prompt}\n", flush=True)
    t0, ttft = time.perf_counter(), None
    with Client(grpc_address, timeout=DEMO_TIMEOUT_S, root_ca=cfg.cluster.tls_ca or None) as client, \
            client.generate(ids, max_tokens=cfg.max_tokens) as stream:  # one-shot: nothing kept in Redis
        for chunk in stream:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            print(chunk.text, end="", flush=True)
            if stop.is_set():
                return
        result = stream.result
    print("\n", flush=True)
    print(summary(result, time.perf_counter() - t0, ttft), flush=True)


def run(cfg: UpConfig) -> int:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    cluster = Cluster(cfg.cluster)
    code = 0
    try:
        s = cfg.cluster
        _err(f"starting redis ({'external' if s.redis_url else 'embedded'}), router, {s.drafters} drafter(s) "
             f"({s.drafter}), verifier (tp={s.tp}), threads: {'%d a drafter, %d a verifier rank' % s.service_threads()}")
        t0 = time.monotonic()
        cluster.start(stop.is_set)
        _err(f"up in {time.monotonic() - t0:.1f}s")
        print_endpoints(cluster)
        cluster.echo_output(_echo)
        demo = _Demo(cfg, cluster.grpc_address, stop) if cfg.demo else None
        if demo is not None:
            demo.start()
        while not stop.wait(0.2):
            cluster.watch(restart=_err, should_stop=stop.is_set)
            if demo is not None and not demo.is_alive():
                code = demo.code
                break
        else:
            _err("signal received")
    except ClusterError as e:
        if not stop.is_set():
            _err(e.report)
            code = EXIT_CRASH
    except OSError as e:  # stdout closed under us (`specmesh up | head`): stop everything all the same
        _err(f"output failed ({e}); stopping")
        code = EXIT_CRASH
    finally:
        cluster.stop(_err)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _err("stopped" + ("" if code == 0 else f" (exit {code})"))
    return code


class _Demo(threading.Thread):
    """--demo in a thread, so that the main thread keeps watching the children and signals."""

    def __init__(self, cfg: UpConfig, grpc_address: str, stop: threading.Event) -> None:
        super().__init__(name="demo", daemon=True)
        self.cfg, self.grpc_address, self.stop_event = cfg, grpc_address, stop
        self.code = EXIT_CRASH  # until it succeeds (an unexpected error prints its traceback)

    def run(self) -> None:
        from specmesh.client import SpecmeshError

        try:
            run_demo(self.cfg, self.grpc_address, self.stop_event)
            self.code = 0
        except (SpecmeshError, ValueError, OSError) as e:
            _err(f"demo failed: {e}")
