"""Batched verification across sessions: concurrent callers' forwards run as one forward.

`BatchingTarget` wraps a `Transformer`, or a TP group's `TPModel` (verifier_service.tp_group,
whose `forward_batch` runs the batch on every rank), and is used exactly like one by
`TargetSession` (call, `new_cache`, `config`). A call queues a `Segment` (its tokens, its cache) and waits. Whoever finds
no batch running becomes the runner: it takes what is queued — up to `max_rows` rows (a request
larger than that runs alone) — runs `Transformer.forward_batch`, hands every caller its logits,
and goes on until its own request is done; then another waiting caller takes over. There is no
waiting window: a lone session runs as fast as unbatched, and sessions that arrive while a batch
runs form the next one, so N concurrent sessions share one read of the weights per step (on a
memory-bound CPU, 3 sessions' 5-node trees in one forward cost about 1.3 steps, not 3).

Outputs do not change: attention stays per session, and `max_rows` defaults to the small-M
kernel's range, in which a row's linear-layer result does not depend on the other rows (see
`specmesh.kernels`). A forward that fails in a batch (a bad request) is retried alone, so one
session's error never reaches another. The same threads, no extra thread to own or stop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specmesh import kernels
from specmesh.kv_cache import KVCache
from specmesh.model import Segment, Transformer


@dataclass
class _Request:
    segment: Segment
    done: bool = False
    logits: torch.Tensor | None = None
    error: BaseException | None = None

    @property
    def rows(self) -> int:
        return self.segment.tokens.shape[0]


@dataclass
class BatchStats:
    forwards: int = 0          # batched forwards run
    segments: int = 0          # requests served by them
    max_segments: int = 0      # the largest batch
    sizes: dict[int, int] = field(default_factory=dict)  # segments per forward -> how many forwards


ACTIVE_S = 0.5  # a session that asked for a forward this recently is expected to ask again


class BatchingTarget:
    def __init__(self, model: Transformer, max_rows: int = kernels.SMALL_M_MAX, gather_s: float = 0.01) -> None:
        self.model, self.config, self.max_rows, self.gather_s = model, model.config, max_rows, gather_s
        self.stats = BatchStats()
        self._queue: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._running = False
        self._seen: dict[int, float] = {}  # id(cache) -> when it last asked for a forward

    def new_cache(self, capacity: int = 256) -> KVCache:
        return self.model.new_cache(capacity)

    def __getattr__(self, name: str):
        """The wrapped model's other attributes (its `weight_format`; a TP group's `healthy`,
        `shutdown`, `device`, ...): the verifier holds this in the model's place."""
        if name == "model":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                 mask: torch.Tensor | None = None,
                 logits_rows: torch.Tensor | slice | None = slice(None), hidden: bool = False):
        """`Transformer.forward`, possibly run in one forward with other sessions' calls."""
        req = _Request(Segment(tokens, positions, cache, start, mask, logits_rows, want_hidden=hidden))
        with self._cv:
            self._queue.append(req)
            self._seen[id(cache)] = time.monotonic()
            self._cv.notify_all()  # a runner gathering a batch may be waiting for this request
            while self._running and not req.done:
                self._cv.wait()
            runner = not req.done
            self._running |= runner  # the runner runs batches until its own request is done
        if runner:
            try:
                while not req.done:
                    with self._cv:
                        self._gather()
                        batch = self._take()
                    self._run(batch)
                    with self._cv:
                        self._cv.notify_all()
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()
        if req.error is not None:
            raise req.error
        return (req.logits, req.segment.hidden) if hidden else req.logits

    forward = __call__

    def idle(self, cache: KVCache) -> None:
        """The session of `cache` asks for no forward before its next turn: batches stop waiting
        for it at once, not `ACTIVE_S` later (a turn that starts right after another ended would
        otherwise wait `gather_s` at each of its first steps for a session that is not coming)."""
        with self._cv:
            if self._seen.pop(id(cache), None) is not None:
                self._cv.notify_all()

    def _gather(self) -> None:
        """Wait up to `gather_s` for the other recently active sessions' next requests (they are
        busy between forwards: sampling, commit, streaming), so concurrent sessions step together
        instead of taking turns. A lone session never waits."""
        now = time.monotonic()
        for key in [k for k, t in self._seen.items() if now - t > ACTIVE_S]:
            del self._seen[key]
        deadline = now + self.gather_s
        while (len(self._queue) < len(self._seen) and sum(r.rows for r in self._queue) < self.max_rows
               and (left := deadline - time.monotonic()) > 0):
            self._cv.wait(left)

    def _take(self) -> list[_Request]:
        """Requests from the head of the queue while they fit in `max_rows` (the head always)."""
        batch = [self._queue.popleft()]
        rows = batch[0].rows
        while self._queue and rows <= self.max_rows and rows + self._queue[0].rows <= self.max_rows:
            batch.append(self._queue.popleft())
            rows += batch[-1].rows
        return batch

    def _run(self, batch: list[_Request]) -> None:
        try:
            outs = self.model.forward_batch([r.segment for r in batch])
        except Exception as e:  # noqa: BLE001 - handed to the caller(s), never swallowed
            if len(batch) == 1:
                batch[0].error = e
            else:  # whose error is it? each alone: the others are not failed by it
                for r in batch:
                    self._run([r])
                return
        else:
            for r, out in zip(batch, outs):
                r.logits = out
            s = self.stats
            s.forwards += 1
            s.segments += len(batch)
            s.max_segments = max(s.max_segments, len(batch))
            s.sizes[len(batch)] = s.sizes.get(len(batch), 0) + 1
        for r in batch:
            r.done = True
