"""How the ranks of a TP group find rank 0 and agree that they are one group.

Rank 0 hosts a torch.distributed TCPStore (`open_store`: 127.0.0.1 at a free port, or the port of
`--tp-listen HOST:PORT` so that ranks on other machines can reach it) and publishes the group's
`GroupSpec`. Every other rank, whether a child of rank 0 or a process started elsewhere with
`python -m verifier_service.tp_group`, connects (`connect`), checks the spec against its own
settings and target (`join`, `check_weights`), loads its shard and says it is ready. Store keys:

    tp/group     rank 0: GroupSpec JSON (world size, backend, dtype, op timeout, target config sha)
    tp/weights   rank 0, once loaded: sha of a sample of every weight tensor (`weights_sha`)
    tp/joined/R  how many processes claimed rank R (more than one: a misconfiguration)
    tp/ready/R   rank R has loaded its shard and is entering init_process_group
    tp/errors    lines "rank R refused to join: why", appended by ranks that give up while
                 starting (any R, even one outside rank 0's world); rank 0 fails its start at once

A rank whose world size, target config or weights differ from rank 0's refuses with a `JoinError`
naming both sides. Rank 0 (`wait_ready`) fails its start with `TPStartError` (a rank refused or a
local one exited) or with a `TimeoutError` naming the ranks that never joined and those still
loading. The backend (gloo / NCCL), dtype and op timeout are rank 0's choice: workers take them
from the spec.

Workers' settings (`WorkerConfig`, `parse_worker_args`): flags, else the torchrun-style environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), else, with `--lws`, a LeaderWorkerSet
pod's (LWS_LEADER_ADDRESS, LWS_WORKER_INDEX, LWS_GROUP_SIZE, GPUS_PER_POD, MASTER_PORT): pod i
runs ranks i x GPUS_PER_POD .. (i + 1) x GPUS_PER_POD - 1, so the leader (i = 0) must run rank 0
with GPUS_PER_POD local ranks. This module knows nothing of the ops protocol (tp_group.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from specmesh.model import ModelConfig

LOOPBACK = "127.0.0.1"
ANY_HOST = ("", "0.0.0.0", "::")
LWS_MASTER_PORT = 29500
START_TIMEOUT_S = 600.0  # every rank joined and loaded the model
ERRORS = "tp/errors"
log = logging.getLogger(__name__)


class TPStartError(RuntimeError):
    """Rank 0 could not start the group: a rank refused to join or exited while starting."""


class JoinError(RuntimeError):
    """This rank does not belong to rank 0's group (world size, rank or target differ)."""


@dataclass(frozen=True)
class GroupSpec:
    """What every rank must agree on; rank 0 decides and publishes it."""
    world: int
    backend: str      # "gloo" | "nccl"
    dtype: str        # torch dtype name, e.g. "float32"
    timeout_s: float  # every collective's timeout
    config_sha: str   # of the target's ModelConfig


def parse_hostport(text: str) -> tuple[str, int]:
    """"HOST:PORT" (or "[v6]:PORT") -> (host, port); ValueError if it is not one."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def config_sha(cfg: ModelConfig) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()).hexdigest()[:16]


def target_config(folder: Path) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(folder))


@torch.no_grad()
def weights_sha(model: torch.nn.Module, per_tensor: int = 64) -> str:
    """A cheap fingerprint of unsharded weights: every tensor's name, shape, dtype and `per_tensor`
    evenly spaced values (a different checkpoint of the same architecture shows)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().flatten()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(flat[:: max(1, flat.numel() // per_tensor)][:per_tensor].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _key(kind: str, rank: int) -> str:
    return f"tp/{kind}/{rank}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# --- rank 0 ---------------------------------------------------------------------------------------


def open_store(listen: str | None, world: int, spec: GroupSpec, timeout_s: float) -> tuple[dist.TCPStore, str, str]:
    """Rank 0's store, with the spec published. `listen` "HOST:PORT" (None: a free port, for local
    ranks only). Returns the store, the HOST:PORT this machine's ranks dial, and the one to tell
    other machines. (torch's TCPStore listens on every interface: HOST only says where rank 0 and
    its local ranks connect; 0.0.0.0 means the loopback.)"""
    host, port = parse_hostport(listen) if listen else (LOOPBACK, 0)
    dial = LOOPBACK if host in ANY_HOST else host
    store = dist.TCPStore(dial, port, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    store.set("tp/group", json.dumps(dataclasses.asdict(spec)))
    return store, f"{dial}:{store.port}", f"{socket.gethostname() if host in ANY_HOST else host}:{store.port}"


def wait_ready(store: dist.Store, world: int, local: Mapping[int, subprocess.Popen], deadline: float,
               timeout_s: float, master: str) -> None:
    """Until ranks 1..world-1 are ready. Fails at once when one gives up (tp/error/R) or a local
    one (`local`: rank -> process) exits; at `deadline` (monotonic) with a TimeoutError."""
    pending = list(range(1, world))
    while True:
        pending = [r for r in pending if not store.check([_key("ready", r)])]
        if not pending:
            return
        if store.check([ERRORS]):
            lines = store.get(ERRORS).decode().splitlines()
            more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
            raise TPStartError(f"tp: {lines[0]}{more}")
        for r, p in local.items():
            if p.poll() is not None:
                raise TPStartError(f"tp: rank {r} exited with code {p.returncode} while starting (see its stderr)")
        if time.monotonic() > deadline:
            raise TimeoutError(_not_ready(store, pending, world, local, timeout_s, master))
        time.sleep(0.05)


def _not_ready(store: dist.Store, pending: list[int], world: int, local: Mapping[int, subprocess.Popen],
               timeout_s: float, master: str) -> str:
    absent = [r for r in pending if not store.check([_key("joined", r)])]
    loading = [r for r in pending if r not in absent]
    parts = []
    remote = [r for r in absent if r not in local]
    if remote:
        parts.append(f"{_ranks(remote)} never joined (start each on its machine with `python -m "
                     f"verifier_service.tp_group --master {master} --rank R --world {world}`, or --lws in a "
                     f"LeaderWorkerSet)")
    if [r for r in absent if r in local]:
        parts.append(f"local {_ranks([r for r in absent if r in local])} never joined")
    if loading:
        parts.append(f"{_ranks(loading)} joined but still loading")
    return f"tp: {_ranks(pending)} of {world} not ready after {timeout_s:.0f} s: " + "; ".join(parts)


# --- ranks 1..N-1 ---------------------------------------------------------------------------------


def connect(host: str, port: int, world: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store (retrying until it is up, for at most `timeout_s`)."""
    return dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))


def join(store: dist.Store, rank: int, world: int, folder: Path) -> GroupSpec:
    """Claim `rank` and check world size and target config against rank 0's; its spec."""
    claims = store.add(_key("joined", rank), 1)
    spec = GroupSpec(**json.loads(store.get("tp/group")))
    if spec.world != world:
        raise JoinError(f"started for a world of {world} ranks, but rank 0 leads {spec.world} (its --tp): "
                        f"start every rank with the same world size")
    if claims > 1:
        raise JoinError(f"rank {rank} is taken by another process: check each one's --rank "
                        f"(LWS: LWS_WORKER_INDEX x GPUS_PER_POD)")
    mine = config_sha(target_config(folder))
    if mine != spec.config_sha:
        raise JoinError(f"target {folder} is not rank 0's: model config sha {mine} here, {spec.config_sha} "
                        f"on rank 0")
    return spec


def check_weights(store: dist.Store, model: torch.nn.Module, folder: Path) -> None:
    """Compare the loaded (unsharded) weights with rank 0's, once rank 0 has loaded its own."""
    mine = weights_sha(model)
    theirs = store.get("tp/weights").decode()
    if mine != theirs:
        raise JoinError(f"target {folder} has the config of rank 0's but other weights: weights sha {mine} "
                        f"here, {theirs} on rank 0")


def report_error(store: dist.Store, rank: int, e: BaseException) -> None:
    """Tell rank 0 why this rank gives up, so its start fails now with the reason (best effort:
    the store may be the thing that failed; the caller re-raises `e` either way)."""
    why = f"refused to join: {e}" if isinstance(e, JoinError) else f"failed while starting: {type(e).__name__}: {e}"
    try:
        store.append(ERRORS, f"rank {rank} {' '.join(why.split())[:2000]}\n")
    except Exception as store_error:  # noqa: BLE001 - the original error is what matters
        log.debug("could not report the error to rank 0: %r", store_error)


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of `python -m verifier_service.tp_group`: ranks rank .. rank + local_ranks - 1."""
    target: str | None         # HF folder, .safetensors or .gguf; None = bundled SmolLM2 (as rank 0)
    master: tuple[str, int]    # rank 0's store (its --tp-listen)
    rank: int                  # the first rank run here (>= 1)
    world: int                 # ranks in the group (rank 0's --tp)
    local_ranks: int = 1       # ranks run here, one process each
    local_rank: int = 0        # device of `rank` on this machine (cuda:local_rank with NCCL)
    threads: int = 1           # torch threads per rank
    start_timeout_s: float = START_TIMEOUT_S


def parse_worker_args(argv: list[str] | None = None, env: Mapping[str, str] = os.environ) -> WorkerConfig:
    p = argparse.ArgumentParser(
        prog="python -m verifier_service.tp_group",
        description="Ranks 1..N-1 of a verifier's tensor-parallel group: join rank 0 (`python -m "
                    "verifier_service --tp N --tp-listen HOST:PORT --tp-local-ranks K`) from any machine. "
                    "Unset flags come from MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK, or "
                    "with --lws from LWS_LEADER_ADDRESS, LWS_WORKER_INDEX, LWS_GROUP_SIZE and GPUS_PER_POD.")
    p.add_argument("--target", default=env.get("SPECMESH_TARGET"), help="the target, as rank 0's (it is resolved "
                   "here: a GGUF converts into this machine's cache); default: the bundled SmolLM2")
    p.add_argument("--master", help="rank 0's HOST:PORT (its --tp-listen)")
    p.add_argument("--rank", type=int, help="the (first) rank run here")
    p.add_argument("--world", type=int, help="ranks in the group: rank 0's --tp")
    p.add_argument("--local-ranks", type=int, help="run ranks RANK..RANK+M-1 here, one process each (default 1)")
    p.add_argument("--local-rank", type=int, default=int(env.get("LOCAL_RANK", 0)),
                   help="device index of RANK on this machine (cuda:LOCAL_RANK with NCCL)")
    p.add_argument("--threads", type=int, default=int(env.get("SPECMESH_THREADS", 1)), help="torch threads per rank")
    p.add_argument("--start-timeout-s", type=float,
                   default=float(env.get("SPECMESH_TP_START_TIMEOUT_S", START_TIMEOUT_S)))
    p.add_argument("--lws", action="store_true", help="in a LeaderWorkerSet pod: master LWS_LEADER_ADDRESS:"
                   "MASTER_PORT, local ranks GPUS_PER_POD, rank LWS_WORKER_INDEX x GPUS_PER_POD, world "
                   "LWS_GROUP_SIZE x GPUS_PER_POD")
    a = p.parse_args(argv)

    def need(name: str) -> str:
        if not env.get(name):
            p.error(f"--lws: ${name} is not set (the LeaderWorkerSet controller sets LWS_*; set GPUS_PER_POD)")
        return env[name]

    master, rank, world, local = a.master, a.rank, a.world, a.local_ranks
    if a.lws:
        local = local or int(need("GPUS_PER_POD"))
        master = master or f"{need('LWS_LEADER_ADDRESS')}:{env.get('MASTER_PORT') or LWS_MASTER_PORT}"
        rank = int(need("LWS_WORKER_INDEX")) * local if rank is None else rank
        world = int(need("LWS_GROUP_SIZE")) * local if world is None else world
    else:
        local = local or 1
        if master is None and env.get("MASTER_PORT"):
            master = f"{env.get('MASTER_ADDR') or LOOPBACK}:{env['MASTER_PORT']}"
        rank = int(env["RANK"]) if rank is None and env.get("RANK") else rank
        world = int(env["WORLD_SIZE"]) if world is None and env.get("WORLD_SIZE") else world
    for value, what in ((master, "--master (or MASTER_PORT)"), (rank, "--rank (or RANK)"),
                        (world, "--world (or WORLD_SIZE)")):
        if value is None:
            p.error(f"{what} is required (or --lws in a LeaderWorkerSet pod)")
    try:
        host, port = parse_hostport(master)
    except ValueError as e:
        p.error(f"--master: {e}")
    if local < 1 or a.threads < 1 or a.local_rank < 0:
        p.error("--local-ranks and --threads must be >= 1, --local-rank >= 0")
    if not 1 <= rank or rank + local > world:
        p.error(f"ranks {rank}..{rank + local - 1} are not among ranks 1..{world - 1} of a world of {world} "
                f"(rank 0 is the verifier)")
    return WorkerConfig(a.target or None, (host, port), rank, world, local, a.local_rank, a.threads, a.start_timeout_s)
