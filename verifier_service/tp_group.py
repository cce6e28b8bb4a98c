"""A tensor-parallel target: one model over N ranks (processes), driven by rank 0.

Rank 0 is the verifier process (it serves gRPC); `start_tp` starts ranks 1..K-1 as child
processes (`python -m verifier_service.tp_group`; K = `local_ranks`, default N), and ranks
K..N-1 join from other machines with the same command (`--master` = rank 0's `listen`; how ranks
find rank 0 and check that they belong to its group: tp_join.py). Every rank loads the full
model and keeps its shard (`specmesh.tp.apply_tp`). Rank 0 gets a `TPModel`: the interface the
engine uses (`forward` / `__call__`, `new_cache`, `config`), whose caches (`TPCache`) have
KVCache's `length`, `commit`, `truncate` and `ensure_capacity`. Each op is replayed on every
rank, then all run the same forward with their shard (all-reducing inside); only rank 0 computes
logits.

Protocol (rank 0 -> ranks 1..N-1, torch.distributed broadcasts over a gloo group, CPU tensors; no
pickling). An op is a header `int64[HEADER_LEN] = [op, cache_id, a, b, c, 0, ...]`, then:
    FORWARD   cache_id, start, T, mask_cols (0: no mask)  + int64[2, T] tokens/positions
                                                            + uint8[T, mask_cols] mask, if any
    BATCH     -, segments n, rows R, mask bytes B          + int64[n, 4] (cache_id, start, T, mask_cols)
              (several sessions' forwards as one:          + int64[2, R] tokens/positions
               `forward_batch`, specmesh.batching)         + uint8[B] their masks, flattened, if any
    COMMIT    cache_id, n                                 + int64[n] slots
    TRUNCATE  cache_id, length      ENSURE  cache_id, needed      NEW  cache_id, capacity
    FREE      cache_id              NOOP    (heartbeat)           STOP
Caches are named by integer ids chosen by rank 0. One lock on rank 0 makes each op (broadcasts and
rank 0's own part) atomic, so sessions in concurrent threads never interleave. A cache is freed
on every rank by `TPCache.close()`, or after it is garbage collected (queued by `__del__`, sent
before the next op: a finalizer must not broadcast, it may run in the middle of a forward).
With NCCL (when CUDA is present on rank 0, which chooses for every rank) the i-th rank of a
machine computes on cuda:i and all-reduces over NCCL; control messages still travel over a
separate gloo group, so they never wait on a GPU stream.

Failures: nothing waits forever. Every collective has the group's `timeout_s`; an idle rank 0
sends NOOP every `timeout_s / 4` so idle workers never time out. Before each op rank 0 checks its
children: a dead child is seen at once. A worker (child or remote) that dies mid-op closes its
sockets, so rank 0 fails at once; one that stalls fails rank 0 after `timeout_s`. Either way the
TPModel becomes **broken**: it kills its remaining children and every call raises `TPGroupError`
(the verifier should report itself unhealthy and restart; the router rebuilds sessions from
their history).
Workers exit when rank 0 goes away (closed sockets) or stalls (timeout). Bad input (a
`ValueError`, raised alike by every rank before any collective) leaves the group usable.
One TPModel per process: it owns torch.distributed's default group.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from enum import IntEnum
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from specmesh.kv_cache import MIN_CAPACITY, KVCache
from specmesh.loader import bundled_target_path, load_model, resolve_folder
from specmesh.model import Segment, Transformer
from specmesh.tp import apply_tp, check_world_size, tp_all_reduce
from verifier_service import tp_join
from verifier_service.tp_join import START_TIMEOUT_S, GroupSpec, JoinError, WorkerConfig

HEADER_LEN = 8
DEFAULT_TIMEOUT_S = 60.0
log = logging.getLogger(__name__)
R = TypeVar("R")


class Op(IntEnum):
    STOP = 1
    NOOP = 2
    NEW = 3
    FREE = 4
    FORWARD = 5
    COMMIT = 6
    TRUNCATE = 7
    ENSURE = 8
    BATCH = 9


class TPGroupError(RuntimeError):
    """The TP group is unusable: a rank died or stalled past the timeout, or it was shut down."""


def _commit(cache: KVCache, slots: list[int]) -> None:
    # A cache grown inside a forward holds inference tensors, which only accept in-place
    # updates (commit's gather) inside inference mode.
    with torch.inference_mode():
        cache.commit(slots)


class TPCache:
    """One session's KV cache over all ranks: rank 0's shard (`local`), the same id on the others."""

    def __init__(self, owner: TPModel, cache_id: int, local: KVCache) -> None:
        self.closed = False
        self._owner, self.id, self.local = owner, cache_id, local

    @property
    def length(self) -> int:
        return self.local.length

    @property
    def capacity(self) -> int:
        return self.local.capacity

    def commit(self, slots: list[int]) -> None:
        if slots:
            slots = [int(s) for s in slots]
            self._owner._op([Op.COMMIT, self.id, len(slots)], [torch.tensor(slots, dtype=torch.int64)],
                            lambda: _commit(self.local, slots), local_first=True)

    def truncate(self, length: int) -> None:
        self._owner._op([Op.TRUNCATE, self.id, length], [], lambda: self.local.truncate(length), local_first=True)

    def ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            self._owner._op([Op.ENSURE, self.id, needed], [], lambda: self.local.ensure_capacity(needed),
                            local_first=True)

    def close(self) -> None:
        """Free this cache on every rank now (a no-op once closed, or once the group is gone)."""
        if not self.closed:
            self.closed = True
            self._owner._free(self.id)

    def __del__(self) -> None:
        if not self.closed:
            self._owner._to_free.append(self.id)  # deque.append is thread-safe; sent by the next op


class TPModel:
    """Rank 0's handle on the group, with the engine's model interface."""

    def __init__(self, model: Transformer, device: torch.device, workers: Sequence[subprocess.Popen] = (),
                 group: dist.ProcessGroup | None = None, store: dist.Store | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, world_size: int | None = None) -> None:
        self.model = model  # rank 0's shard
        self.config = model.config
        self.device = device
        self.world_size = world_size or 1 + len(workers)  # workers: rank 0's children, ranks 1..K-1
        self._workers = list(workers)
        self._group, self._store = group, store
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._to_free: deque[int] = deque()
        self._error: str | None = None
        self._closed = False
        self._last_op = time.monotonic()
        self._stop = threading.Event()
        self._heartbeat_s = timeout_s / 4
        self._beat: threading.Thread | None = None
        if self.world_size > 1:
            self._beat = threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)
            self._beat.start()

    @property
    def worker_pids(self) -> list[int]:
        """Rank 0's child ranks (ranks on other machines are not its processes)."""
        return [p.pid for p in self._workers]

    @property
    def healthy(self) -> bool:
        """Not shut down or broken, and no child exited (a lost remote rank shows on the next op)."""
        return not self._closed and self._error is None and all(p.poll() is None for p in self._workers)

    def new_cache(self, capacity: int = MIN_CAPACITY) -> TPCache:
        cid = next(self._ids)
        local = self._op([Op.NEW, cid, capacity], [], lambda: self.model.new_cache(capacity), local_first=True)
        return TPCache(self, cid, local)

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        cache: TPCache,
        start: int,
        mask: torch.Tensor | None = None,  # [T, start + T] bool; None = causal
        logits_rows: torch.Tensor | slice | None = slice(None),
        hidden: bool = False,
    ):
        """`Transformer.forward` on every rank; logits [R, vocab] on `tokens`' device, from rank 0
        (with `hidden`, also rank 0's final hidden states: complete after the last all-reduce)."""
        t = self._check_forward(tokens, positions, cache, start, mask)
        dev = self.device

        def to_host(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(tokens.device)

        def rank0():
            m = None if mask is None else mask.to(dev)
            out = self.model(tokens.to(dev), positions.to(dev), cache.local, start, m, logits_rows, hidden=hidden)
            return (to_host(out[0]), to_host(out[1])) if hidden else to_host(out)

        header = [Op.FORWARD, cache.id, start, t, 0 if mask is None else mask.shape[1]]
        payload: list[torch.Tensor] = []
        if self.world_size > 1:
            payload.append(torch.stack([tokens.cpu(), positions.cpu()]).to(torch.int64))  # [2, T]
            if mask is not None:
                payload.append(mask.cpu().to(torch.uint8))  # [T, S]
        return self._op(header, payload, rank0)

    __call__ = forward

    def forward_batch(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """`Transformer.forward_batch` on every rank: several sessions' rows (each `Segment` with a
        `TPCache`) in one forward, the weights read once for all, attention per session; logits per
        segment from rank 0 (and `hidden` where asked). How `specmesh.batching` verifies sessions
        together at TP > 1: a row's result does not depend on the other rows on any rank (the
        shards' products are the batch-invariant kernel's, the all-reduce sums each row apart)."""
        if not segments:
            return []
        for s in segments:
            self._check_forward(s.tokens, s.positions, s.cache, s.start, s.mask)
            if s.features is not None:
                raise ValueError("features: a TP target takes no drafter features")
        if len({s.cache.id for s in segments}) != len(segments):
            raise ValueError("forward_batch: a cache appears twice in one batch")
        dev = self.device
        local = [Segment(s.tokens.to(dev), s.positions.to(dev), s.cache.local, s.start,
                         None if s.mask is None else s.mask.to(dev), s.logits_rows, want_hidden=s.want_hidden,
                         exact=s.exact) for s in segments]

        def rank0():
            outs = self.model.forward_batch(local)
            for s, mine in zip(segments, local):
                s.hidden = None if mine.hidden is None else mine.hidden.to(s.tokens.device)
            return [None if o is None else o.to(s.tokens.device) for o, s in zip(outs, segments)]

        masks = [s.mask.cpu().to(torch.uint8).flatten() for s in segments if s.mask is not None]
        mask_bytes = sum(m.numel() for m in masks)
        header = [Op.BATCH, 0, len(segments), sum(s.tokens.shape[0] for s in segments), mask_bytes]
        payload: list[torch.Tensor] = []
        if self.world_size > 1:
            payload.append(torch.tensor([[s.cache.id, s.start, s.tokens.shape[0], 0 if s.mask is None else s.mask.shape[1]]
                                         for s in segments], dtype=torch.int64))  # [n, 4]
            payload.append(torch.cat([torch.stack([s.tokens.cpu(), s.positions.cpu()]) for s in segments], 1)
                           .to(torch.int64))  # [2, R]
            if masks:
                payload.append(torch.cat(masks))  # [B]
        return self._op(header, payload, rank0)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop and reap the workers and destroy the process group. Idempotent."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.world_size > 1 and self._error is None:
                try:
                    self._send([Op.STOP], [])
                except TPGroupError:
                    pass  # recorded and logged by _fail, which also killed the workers
            deadline = time.monotonic() + grace_s
            for p in self._workers:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("tp: worker %d did not stop within %.0f s; killing it", p.pid, grace_s)
                    p.kill()
                    p.wait()
            if (self.world_size > 1 or self.device.type == "cuda") and dist.is_initialized():
                dist.destroy_process_group()
        if self._beat is not None:
            self._beat.join()

    def __enter__(self) -> TPModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- internals --------------------------------------------------------------------------------

    def _check_forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: TPCache, start: int,
                       mask: torch.Tensor | None) -> int:
        """Refuse bad input on rank 0, before any rank sees it."""
        if not isinstance(cache, TPCache) or cache._owner is not self:
            raise ValueError("cache: not a cache of this TPModel")
        if cache.closed:
            raise ValueError("cache: closed")
        if tokens.dim() != 1 or tokens.shape[0] < 1 or positions.shape != tokens.shape:
            raise ValueError(f"forward: need tokens [T>=1] and positions [T], got {list(tokens.shape)}, "
                             f"{list(positions.shape)}")
        t = tokens.shape[0]
        if start < 0:
            raise ValueError(f"forward: start must be >= 0, got {start}")
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (t, start + t)):
            raise ValueError(f"forward: mask must be bool [{t}, {start + t}], got {mask.dtype} {list(mask.shape)}")
        return t

    def _op(self, header: list[int], payload: Sequence[torch.Tensor], rank0: Callable[[], R],
            local_first: bool = False) -> R:
        """Run one op on every rank, atomically. `local_first`: rank 0's part has no collective and
        may refuse (assert) the op, so it runs before the others are told."""
        with self._lock:
            self._check()
            self._flush_frees()
            if local_first:
                result = rank0()
                self._send(header, payload)
                return result
            self._send(header, payload)
            try:
                return rank0()
            except ValueError:
                raise  # refused by every rank alike, before any collective: the group stays in step
            except Exception as e:
                self._fail(f"tp: rank 0 failed in {Op(header[0]).name}: {e!r}")
                raise TPGroupError(self._error) from e

    def _send(self, header: list[int], payload: Sequence[torch.Tensor]) -> None:
        if self.world_size == 1:
            return
        h = torch.tensor([int(x) for x in header] + [0] * (HEADER_LEN - len(header)), dtype=torch.int64)
        try:
            dist.broadcast(h, src=0, group=self._group)
            for x in payload:
                dist.broadcast(x.contiguous(), src=0, group=self._group)
        except Exception as e:
            self._fail(f"tp: broadcast of {Op(header[0]).name} failed: {e!r}")
            raise TPGroupError(self._error) from e
        self._last_op = time.monotonic()

    def _check(self) -> None:
        """Raise TPGroupError if the group is shut down, broken, or has lost a worker."""
        if self._closed:
            raise TPGroupError("tp: the group was shut down")
        if self._error is None:
            for rank, p in enumerate(self._workers, 1):
                if p.poll() is not None:
                    self._fail(f"tp: rank {rank} (pid {p.pid}) exited with code {p.returncode}")
                    break
        if self._error is not None:
            raise TPGroupError(self._error)

    def _fail(self, reason: str) -> None:
        """Mark the group broken (first reason wins) and kill the children: it cannot recover.
        (Remote ranks exit when their next collective fails or times out.)"""
        if self._error is None:
            self._error = reason
            log.error("%s; the TP group is broken", reason)
        for p in self._workers:
            if p.poll() is None:
                p.kill()

    def _flush_frees(self) -> None:
        while self._to_free:
            self._send([Op.FREE, self._to_free.popleft()], [])

    def _free(self, cache_id: int) -> None:
        with self._lock:
            if self._closed or self._error is not None:
                return
            self._flush_frees()
            self._send([Op.FREE, cache_id], [])

    def _heartbeat(self) -> None:
        """Keep idle workers from timing out, notice dead ones, and free collected caches."""
        while not self._stop.wait(self._heartbeat_s):
            with self._lock:
                if self._closed:
                    return
                try:
                    self._check()
                    self._flush_frees()
                    if time.monotonic() - self._last_op >= self._heartbeat_s:
                        self._send([Op.NOOP], [])
                except TPGroupError:
                    return  # recorded by _fail; callers get it on their next op


# --- starting the group ---------------------------------------------------------------------------


def _device(backend: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def _init_group(backend: str, store: dist.Store, rank: int, world: int, timeout_s: float,
                local_rank: int) -> dist.ProcessGroup | None:
    """Join the default group; return the group control messages use (None: the default one)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)


def _shard(model: Transformer, rank: int, world: int, device: torch.device) -> Transformer:
    return apply_tp(model, rank, world, partial(tp_all_reduce, group=None)).to(device)


def _spawn(rank: int, world: int, master: str, folder: Path, threads: int, start_timeout_s: float,
           local_rank: int) -> subprocess.Popen:
    """`python -m verifier_service.tp_group` for one rank on this machine."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    root = str(Path(__file__).resolve().parents[1])  # so `-m verifier_service.tp_group` imports from any cwd
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "verifier_service.tp_group", "--target", str(folder), "--master", master,
           "--rank", str(rank), "--world", str(world), "--local-rank", str(local_rank), "--threads", str(threads),
           "--start-timeout-s", str(start_timeout_s)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def start_tp(target_path: str | os.PathLike, world_size: int, threads_per_rank: int = 1, backend: str | None = None,
             *, dtype: torch.dtype = torch.float32, timeout_s: float = DEFAULT_TIMEOUT_S, listen: str | None = None,
             local_ranks: int | None = None, start_timeout_s: float = START_TIMEOUT_S) -> TPModel:
    """Load `target_path` over `world_size` ranks: this process is rank 0, ranks 1..local_ranks-1
    its children, ranks local_ranks..world_size-1 processes elsewhere that join at `listen`.

    listen: "HOST:PORT" of rank 0's store, where remote ranks dial (None: 127.0.0.1 at a free
    port, local ranks only). local_ranks: ranks on this machine, rank 0 included (None: all).
    Every rank must have joined and loaded within `start_timeout_s`, else a TimeoutError naming
    the missing ones; a rank that refuses (another world size or target) or exits: TPStartError.
    backend: "nccl" if CUDA is available else "gloo" (NCCL: local rank i on cuda:i); workers
    follow rank 0's choice. Sets this process's torch threads to `threads_per_rank`, as each
    local worker does. `world_size` 1: no workers; a process group only with NCCL (initialised
    and checked with one all-reduce). Call `shutdown()` (or use
    `with`) when done.
    """
    local_ranks = world_size if local_ranks is None else local_ranks
    if threads_per_rank < 1:
        raise ValueError(f"tp: threads_per_rank must be >= 1, got {threads_per_rank}")
    if not 1 <= local_ranks <= world_size:
        raise ValueError(f"tp: local_ranks must be in 1..{world_size}, got {local_ranks}")
    if local_ranks < world_size and listen is None:
        raise ValueError("tp: ranks on other machines need `listen` (HOST:PORT they dial)")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"tp: backend must be 'gloo' or 'nccl', got {backend!r}")
    torch.set_num_threads(threads_per_rank)
    folder = resolve_folder(target_path)  # converts a GGUF once, here, not in N processes at once
    deadline = time.monotonic() + start_timeout_s
    cfg = tp_join.target_config(folder)
    check_world_size(cfg, world_size)
    if backend == "nccl" and torch.cuda.device_count() < local_ranks:
        raise ValueError(f"tp: {local_ranks} local ranks need {local_ranks} GPUs, found {torch.cuda.device_count()}")
    device = _device(backend, 0)
    if (world_size > 1 or backend == "nccl") and dist.is_initialized():
        raise RuntimeError("tp: this process already has a torch.distributed group (one TPModel per process)")
    if world_size == 1:
        model = load_model(folder, dtype).to(device)
        if backend == "gloo":
            return TPModel(model, device)
        # On a GPU, as vLLM does at TP=1: the NCCL group exists and its communicator is checked
        # now (one all-reduce), though one rank never all-reduces in a forward.
        _init_group(backend, dist.HashStore(), 0, 1, timeout_s, 0)
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
        torch.cuda.synchronize(device)
        if probe.item() != 1.0:
            raise RuntimeError(f"tp: NCCL all-reduce over one rank returned {probe.item()}, expected 1.0")
        return TPModel(model, device, timeout_s=timeout_s)
    spec = GroupSpec(world_size, backend, str(dtype).removeprefix("torch."), timeout_s, tp_join.config_sha(cfg))
    store, master, advertised = tp_join.open_store(listen, world_size, spec, start_timeout_s)
    if local_ranks < world_size:
        log.info("tp: rank 0 waits for ranks %d..%d to join at %s", local_ranks, world_size - 1, advertised)
    workers = {rank: _spawn(rank, world_size, master, folder, threads_per_rank, start_timeout_s, rank)
               for rank in range(1, local_ranks)}
    try:
        model = load_model(folder, dtype)  # while the workers load theirs
        store.set("tp/weights", tp_join.weights_sha(model))
        tp_join.wait_ready(store, world_size, workers, deadline, start_timeout_s, advertised)
        group = _init_group(backend, store, 0, world_size, timeout_s, 0)
        model = _shard(model, 0, world_size, device)
    except BaseException:
        for p in workers.values():
            p.kill()
            p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return TPModel(model, device, list(workers.values()), group, store, timeout_s, world_size)


# --- ranks 1..N-1 ---------------------------------------------------------------------------------


def _recv(shape: tuple[int, ...], dtype: torch.dtype, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype)
    dist.broadcast(x, src=0, group=group)
    return x


@torch.inference_mode()
def serve(model: Transformer, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Replay rank 0's ops on this rank's shard until STOP."""
    caches: dict[int, KVCache] = {}
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=group)
        op, cid, a, b, c = header.tolist()[:5]
        if op == Op.STOP:
            return
        if op == Op.NOOP:
            continue
        if op == Op.NEW:
            caches[cid] = model.new_cache(a)
        elif op == Op.FREE:
            del caches[cid]
        elif op == Op.FORWARD:
            tp = _recv((2, b), torch.int64, group).to(device)  # [2, T] tokens; positions
            mask = _recv((b, c), torch.uint8, group).to(device).bool() if c else None  # [T, S]
            try:
                model(tp[0], tp[1], caches[cid], a, mask, logits_rows=None)
            except ValueError as e:
                log.info("forward refused (as on rank 0): %s", e)
        elif op == Op.BATCH:  # a segments, b rows, c mask bytes
            meta = _recv((a, 4), torch.int64, group).tolist()  # (cache_id, start, T, mask_cols) each
            tp = _recv((2, b), torch.int64, group).to(device)
            masks = _recv((c,), torch.uint8, group).to(device).bool() if c else None
            segments, row, at = [], 0, 0
            for cache_id, start, t, cols in meta:
                mask = None
                if cols:
                    mask, at = masks[at:at + t * cols].view(t, cols), at + t * cols
                segments.append(Segment(tp[0, row:row + t], tp[1, row:row + t], caches[cache_id], start, mask, None))
                row += t
            try:
                model.forward_batch(segments)
            except ValueError as e:
                log.info("batched forward refused (as on rank 0): %s", e)
        elif op == Op.COMMIT:
            caches[cid].commit(_recv((a,), torch.int64, group).tolist())
        elif op == Op.TRUNCATE:
            caches[cid].truncate(a)
        elif op == Op.ENSURE:
            caches[cid].ensure_capacity(a)
        else:
            raise AssertionError(f"tp: unknown op {op}")


def run_worker(folder: Path, rank: int, world: int, master: tuple[str, int], local_rank: int = 0,
               start_timeout_s: float = START_TIMEOUT_S) -> None:
    """Join rank 0's group as `rank`, load this rank's shard, replay ops until STOP."""
    store = tp_join.connect(*master, world, start_timeout_s)
    try:
        spec = tp_join.join(store, rank, world, folder)
        if spec.backend == "nccl" and torch.cuda.device_count() <= local_rank:
            raise JoinError(f"rank 0 uses NCCL, and local rank {local_rank} needs cuda:{local_rank}, but this "
                            f"machine has {torch.cuda.device_count()} GPUs")
        device = _device(spec.backend, local_rank)
        model = load_model(folder, getattr(torch, spec.dtype))
        tp_join.check_weights(store, model, folder)
        model = _shard(model, rank, world, device)
    except Exception as e:
        tp_join.report_error(store, rank, e)
        raise
    store.set(f"tp/ready/{rank}", "1")
    log.info("joined rank 0 at %s:%d as rank %d of %d (%s on %s)", *master, rank, world, spec.backend, device)
    group = _init_group(spec.backend, store, rank, world, spec.timeout_s, local_rank)
    serve(model, group, device)
    dist.destroy_process_group()


def _supervise(cfg: WorkerConfig, folder: Path) -> int:
    """Run ranks cfg.rank .. cfg.rank + cfg.local_ranks - 1 as children until all stop (0) or
    one fails (the rest are stopped too: the group cannot go on without it)."""
    master = f"{cfg.master[0]}:{cfg.master[1]}"
    procs = [_spawn(cfg.rank + i, cfg.world, master, folder, cfg.threads, cfg.start_timeout_s, cfg.local_rank + i)
             for i in range(cfg.local_ranks)]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    failed: list[tuple[int, int]] = []
    while not stop.wait(0.2):
        codes = [p.poll() for p in procs]
        failed = [(cfg.rank + i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
    if failed:
        log.error("%s; stopping this machine's other ranks",
                  ", ".join(f"rank {r} exited with code {c}" for r, c in failed))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return 1 if failed or any(p.returncode != 0 for p in procs) else 0


def main(argv: list[str] | None = None) -> int:
    cfg = tp_join.parse_worker_args(argv)
    last = cfg.rank + cfg.local_ranks - 1
    logging.basicConfig(level=logging.INFO, format=f"tp rank {cfg.rank}{'' if last == cfg.rank else f'-{last}'}: "
                        "%(levelname)s %(message)s")
    torch.set_num_threads(cfg.threads)
    try:
        folder = resolve_folder(cfg.target or bundled_target_path())  # a GGUF: once per machine, before the ranks
        if cfg.local_ranks > 1:
            return _supervise(cfg, folder)
        run_worker(folder, cfg.rank, cfg.world, cfg.master, cfg.local_rank, cfg.start_timeout_s)
    except JoinError as e:
        log.error("cannot join rank 0's group at %s:%d: %s", *cfg.master, e)
        return 1
    except Exception as e:  # rank 0 gone or stalled (closed sockets / timeout), or a bug: say so and exit
        log.error("exiting: %r", e)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (~2 s with torch loaded): shutdown() waits on it
