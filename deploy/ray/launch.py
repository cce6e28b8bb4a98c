"""specmesh on a Ray cluster: `python -m deploy.ray.launch --address auto --redis-url URL ...`

Places the three services as Ray actors, each of which starts and supervises one service process
(the same `python -m drafter_service | verifier_service | router` entry points as everywhere):

- **drafters**: `--drafters N` actors, each needing the custom resource `drafter_gpu` (start the
  cheap-accelerator nodes with `ray start --resources '{"drafter_gpu": 1}'`), each with its
  registry sidecar (`python -m router.register`);
- **verifiers**: `--verifiers M` tensor-parallel groups; each is a placement group of `--tp`
  bundles with strategy STRICT_PACK (every rank on one node: rank 0 spawns ranks 1..tp-1 itself).
  The actor in bundle 0 runs rank 0 with CUDA_VISIBLE_DEVICES = the GPUs Ray granted the whole
  group (placeholder actors hold bundles 1..tp-1 and report theirs);
- **routers**: `--routers R` actors; clients use the printed gRPC / HTTP addresses.

Verifiers and drafters register in Redis (`--redis-url`, or $SPECMESH_REDIS_URL; run Redis as you
like: a managed service, or `redis-server --appendonly yes --requirepass ...` on the head node).
The launcher prints the router endpoints and a `ready` line, then supervises: a service process that
exits is reported with its last output and the launcher exits 1; Ctrl-C / SIGTERM stops every
process, actor and placement group, and exits 0.

Needs `ray` on the driver and the nodes, and specmesh (plus model files at the paths given) on
every node: the images of deploy/docker, or `pip install`. The actor code travels by value, so
nodes need no checkout. Knows nothing about what the services do beyond their command lines.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

LISTEN = re.compile(r"listening on ([\w.\-]+):(\d+)")
HEARTBEATING = re.compile(r"router\.register: heartbeating")
HTTP = re.compile(r" http ([\w.\-]+):(\d+)")
DRAFTER_RESOURCE = "drafter_gpu"
POLL_S = 2.0

if __name__ != "__main__":  # imported (tests, your own driver): ship the actor code by value too
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class RayLaunchConfig:
    redis_url: str
    routers: int = 1
    router_port: int = 50050            # 0 = a free port
    router_http_port: int = 8000        # 0 = a free port, -1 = no HTTP API
    router_cpus: float = 1.0
    api_keys: tuple[str, ...] = ()
    tokenizer: str | None = None        # None = the target's (the router serves the model by its name)
    verifiers: int = 1
    tp: int = 1                         # ranks per verifier, all on one node (STRICT_PACK)
    threads: int = 1                    # torch threads per rank
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0          # 1 on GPU clusters: rank r of the group uses cuda:r
    target: str | None = None           # None = the bundled model (installed on the nodes)
    drafters: int = 1
    drafter: str = "ngram"              # ngram | model:PATH
    drafter_cpus: float = 1.0
    drafter_gpus: float = 0.0
    drafter_resource: str = DRAFTER_RESOURCE
    start_timeout_s: float = 600.0
    extra_env: dict[str, str] = field(default_factory=dict)   # e.g. SPECMESH_CACHE for every service

    def validate(self) -> None:
        if not self.redis_url:
            raise ValueError("redis_url: required (--redis-url or $SPECMESH_REDIS_URL)")
        for name in ("routers", "verifiers", "tp", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.drafters < 0:
            raise ValueError(f"drafters: must be >= 0, got {self.drafters}")


# --- inside the actors ----------------------------------------------------------------------------


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook for the child: SIGTERM when the actor process dies (Ray kills actors with
    SIGKILL, which would otherwise orphan the service). prctl is looked up here, in the parent, so
    the child only calls it between fork and exec. None where there is no prctl (not Linux)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is None:
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _granted_gpus() -> list[str]:
    """The GPU ids Ray assigned to this actor (what it put in CUDA_VISIBLE_DEVICES)."""
    return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


class _Process:
    """One child process whose output is drained into a bounded tail."""

    def __init__(self, cmd: list[str], env: dict[str, str], ready: re.Pattern = LISTEN) -> None:
        self.cmd, self.ready = cmd, ready
        self.tail: deque[str] = deque(maxlen=200)
        self.popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      preexec_fn=_die_with_parent())  # noqa: PLW1509 (calls prctl only)
        self.first_line = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.tail.append(line.rstrip("\n"))
            if self.ready.search(line):
                self.first_line.set()
        self.first_line.set()

    def wait_ready(self, timeout_s: float) -> re.Match:
        """The match of the first output line saying the process is ready (`listening on ...`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.first_line.wait(0.5)
            for line in list(self.tail):
                if m := self.ready.search(line):
                    return m
            if self.popen.poll() is not None:
                break
        self.stop(5.0)
        raise RuntimeError(f"{' '.join(self.cmd[:3])} did not start (exit {self.popen.returncode}):\n"
                           + "\n".join(list(self.tail)[-30:]))

    def stop(self, timeout_s: float) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        return self.popen.returncode


class ServiceActor:
    """Starts `python -m <module>` (plus sidecars) on its node and keeps them alive until stop()."""

    def __init__(self, env: dict[str, str]) -> None:
        from specmesh.launch import service_env

        self.env = service_env(env)  # the node's environment, passive OpenMP waits (actors may share cores)
        self.procs: list[_Process] = []

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def gpu_ids(self) -> list[str]:
        return _granted_gpus()

    def start(self, module: str, args: list[str], timeout_s: float, visible_gpus: list[str] | None = None,
              register_role: str = "") -> dict:
        """Start the service bound to this node's IP on a free port; return its endpoints."""
        env = dict(self.env)
        if visible_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        ip = self.node_ip()
        main = _Process([sys.executable, "-m", module, "--host", ip, "--port", "0", *args], env)
        self.procs.append(main)
        m = main.wait_ready(timeout_s)
        out = {"node": ip, "address": f"{ip}:{m.group(2)}"}
        http = next((h for line in main.tail if (h := HTTP.search(line))), None)
        if http:
            out["http"] = f"{ip}:{http.group(2)}"
        if register_role:  # the registry sidecar, as in the k8s drafter pods
            sidecar = _Process([sys.executable, "-m", "router.register", "--role", register_role,
                                "--address", out["address"]], env, HEARTBEATING)
            self.procs.append(sidecar)
            sidecar.wait_ready(timeout_s)
        return out

    def poll(self) -> list[tuple[str, int]]:
        """(command, exit code) of every process that has exited."""
        return [(" ".join(p.cmd[1:4]), p.popen.returncode) for p in self.procs if p.popen.poll() is not None]

    def tail(self, n: int = 30) -> str:
        return "\n".join(line for p in self.procs for line in list(p.tail)[-n:])

    def stop(self, timeout_s: float = 30.0) -> list[int | None]:
        return [p.stop(timeout_s) for p in reversed(self.procs)]


class RankSlot:
    """Holds one bundle of a verifier's placement group; reports the GPUs Ray gave it."""

    def gpu_ids(self) -> list[str]:
        return _granted_gpus()


# --- the driver -----------------------------------------------------------------------------------


@dataclass
class Deployment:
    """What launch() placed: actors, placement groups and the routers' endpoints."""

    routers: list[dict] = field(default_factory=list)      # {"node", "address", "http"?}
    verifiers: list[dict] = field(default_factory=list)
    drafters: list[dict] = field(default_factory=list)
    actors: dict[str, ray.actor.ActorHandle] = field(default_factory=dict)
    slots: list[ray.actor.ActorHandle] = field(default_factory=list)
    groups: list[PlacementGroup] = field(default_factory=list)

    def failures(self) -> list[str]:
        """A line per service process that has exited or actor that died."""
        out = []
        for name, actor in self.actors.items():
            try:
                for cmd, code in ray.get(actor.poll.remote(), timeout=30):
                    out.append(f"{name}: `{cmd}` exited with code {code}:\n{ray.get(actor.tail.remote())}")
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                out.append(f"{name}: actor lost: {e}")
        return out

    def stop(self) -> None:
        """Stop every process (gracefully), then the actors and placement groups."""
        pending = {name: a.stop.remote() for name, a in self.actors.items()}
        for name, ref in pending.items():
            try:
                ray.get(ref, timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                print(f"specmesh-ray: stopping {name}: {e}", file=sys.stderr, flush=True)
        for a in [*self.actors.values(), *self.slots]:
            ray.kill(a)
        for g in self.groups:
            remove_placement_group(g)
        self.actors.clear()
        self.slots.clear()
        self.groups.clear()


def _service_env(cfg: RayLaunchConfig) -> dict[str, str]:
    env = {"SPECMESH_REDIS_URL": cfg.redis_url, **cfg.extra_env}  # secrets travel in env, not argv
    if cfg.api_keys:
        env["SPECMESH_API_KEYS"] = ",".join(cfg.api_keys)
    return env


def _start_verifier(cfg: RayLaunchConfig, dep: Deployment, i: int) -> ray.ObjectRef:
    bundle = {"CPU": cfg.cpus_per_rank, **({"GPU": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})}
    pg = placement_group([dict(bundle) for _ in range(cfg.tp)], strategy="STRICT_PACK", name=f"specmesh-verifier-{i}")
    dep.groups.append(pg)
    ray.get(pg.ready(), timeout=cfg.start_timeout_s)

    def in_bundle(k: int) -> dict:
        return {"num_cpus": cfg.cpus_per_rank, "num_gpus": cfg.gpus_per_rank,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k)}

    rank0 = ray.remote(ServiceActor).options(name=f"specmesh-verifier-{i}", **in_bundle(0)).remote(_service_env(cfg))
    slots = [ray.remote(RankSlot).options(**in_bundle(k)).remote() for k in range(1, cfg.tp)]
    dep.slots += slots
    dep.actors[f"verifier-{i}"] = rank0
    gpus = None
    if cfg.gpus_per_rank:  # rank r of the group sees the r-th of the group's GPUs as cuda:r
        gpus = [g for ids in ray.get([rank0.gpu_ids.remote(), *(s.gpu_ids.remote() for s in slots)]) for g in ids]
    args = ["--tp", str(cfg.tp), "--threads", str(cfg.threads), *(["--target", cfg.target] if cfg.target else [])]
    return rank0.start.remote("verifier_service", args, cfg.start_timeout_s, gpus)


def launch(cfg: RayLaunchConfig) -> Deployment:
    """Place and start everything on the connected Ray cluster (ray.init() first); return when
    every service listens. On failure, stops what was started and raises."""
    cfg.validate()
    dep = Deployment()
    try:
        starts: dict[str, ray.ObjectRef] = {}
        for i in range(cfg.verifiers):
            starts[f"verifier-{i}"] = _start_verifier(cfg, dep, i)
        for i in range(cfg.drafters):
            a = ray.remote(ServiceActor).options(
                name=f"specmesh-drafter-{i}", num_cpus=cfg.drafter_cpus, num_gpus=cfg.drafter_gpus,
                resources={cfg.drafter_resource: 1}).remote(_service_env(cfg))
            dep.actors[f"drafter-{i}"] = a
            starts[f"drafter-{i}"] = a.start.remote("drafter_service", ["--drafter", cfg.drafter],
                                                    cfg.start_timeout_s, None, "drafter")
        router_args = ["--http-port", str(cfg.router_http_port)]
        if cfg.tokenizer or cfg.target:  # same file, same served model name as the verifiers register
            router_args += ["--tokenizer", cfg.tokenizer or cfg.target]
        if cfg.router_port:
            router_args += ["--port", str(cfg.router_port)]  # the last --port wins over the actor's `--port 0`
        for i in range(cfg.routers):
            a = ray.remote(ServiceActor).options(name=f"specmesh-router-{i}", num_cpus=cfg.router_cpus).remote(
                _service_env(cfg))
            dep.actors[f"router-{i}"] = a
            starts[f"router-{i}"] = a.start.remote("router", router_args, cfg.start_timeout_s)
        # Generous: actors may wait for resources (autoscaling) before they start their process.
        for name, ref in starts.items():
            info = ray.get(ref, timeout=2 * cfg.start_timeout_s)
            getattr(dep, name.split("-")[0] + "s").append(info)
    except BaseException:
        dep.stop()
        raise
    return dep


# --- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[str, str, RayLaunchConfig]:
    env = os.environ.get
    d = RayLaunchConfig(redis_url="")
    p = argparse.ArgumentParser(prog="python -m deploy.ray.launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="auto", help="Ray cluster address (auto | ray://HOST:10001 | "
                   "HOST:6379); `local` starts a Ray instance on this machine")
    p.add_argument("--namespace", default="specmesh", help="Ray namespace of the actors")
    p.add_argument("--redis-url", default=env("SPECMESH_REDIS_URL", ""), help="also $SPECMESH_REDIS_URL")
    p.add_argument("--routers", type=int, default=d.routers)
    p.add_argument("--router-port", type=int, default=d.router_port, help="router gRPC port (0 = a free one)")
    p.add_argument("--router-http-port", type=int, default=d.router_http_port, help="0 = a free one, -1 = off")
    p.add_argument("--router-cpus", type=float, default=d.router_cpus)
    p.add_argument("--api-key", dest="api_keys", action="append", default=None,
                   help="accepted bearer key (repeat); also $SPECMESH_API_KEYS=k1,k2")
    p.add_argument("--tokenizer", default=d.tokenizer, help="tokenizer path on the router nodes (default: --target's)")
    p.add_argument("--verifiers", type=int, default=d.verifiers)
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks per verifier (one node)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--cpus-per-rank", type=float, default=d.cpus_per_rank)
    p.add_argument("--gpus-per-rank", type=float, default=d.gpus_per_rank, help="1 on GPU clusters")
    p.add_argument("--target", default=d.target, help="target model path on the verifier nodes")
    p.add_argument("--drafters", type=int, default=d.drafters)
    p.add_argument("--drafter", default=d.drafter, help="ngram | model:PATH (path on the drafter nodes)")
    p.add_argument("--drafter-cpus", type=float, default=d.drafter_cpus)
    p.add_argument("--drafter-gpus", type=float, default=d.drafter_gpus)
    p.add_argument("--drafter-resource", default=d.drafter_resource,
                   help="custom resource a drafter needs one unit of")
    p.add_argument("--start-timeout-s", type=float, default=d.start_timeout_s)
    a = vars(p.parse_args(argv))
    address, namespace = a.pop("address"), a.pop("namespace")
    keys = a.pop("api_keys") or [k for k in env("SPECMESH_API_KEYS", "").split(",") if k]
    cfg = RayLaunchConfig(api_keys=tuple(keys), **a)
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return address, namespace, cfg


def main(argv: list[str] | None = None) -> int:
    address, namespace, cfg = parse_args(argv)
    ray.init(address=None if address == "local" else address, namespace=namespace, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dep = launch(cfg)
    try:
        for r in dep.routers:
            http = f" http {r['http']}" if "http" in r else ""
            print(f"specmesh-ray: router grpc {r['address']}{http}", flush=True)
        for kind in ("verifiers", "drafters"):
            for s in getattr(dep, kind):
                print(f"specmesh-ray: {kind[:-1]} {s['address']}", flush=True)
        print(f"specmesh-ray: ready ({cfg.routers} router, {cfg.verifiers} verifier x tp={cfg.tp}, "
              f"{cfg.drafters} drafter)", flush=True)
        while not stop.wait(POLL_S):
            if failed := dep.failures():
                print("specmesh-ray: " + "\n".join(failed), file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        dep.stop()
        print("specmesh-ray: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
