"""Static-shape steps: every decode and verification forward of a target at one of a few fixed
shapes, over KV memory allocated once, so that a GPU can replay each shape as a CUDA graph.

A GPU decode step of a small model is bound by kernel launches, not by reading the weights (issue
19: about 9 ms a step where the weights take about 1 ms to read). Engines that users compare
against (vLLM, SGLang, transformers' static cache with `torch.compile`) capture the decode step
and each verification size once and replay it. That needs every tensor of a step at a fixed
address and shape, which `Transformer.forward_batch` does not give: its caches grow, its
attention reads `[0, start + T)` keys, and its row attention loops over rows in Python.

`StaticSteps` wraps a `Transformer` behind the same model interface (call, `new_cache`, `config`;
other attributes read through), as `BatchingTarget` and `device.OnDevice` do:

- **KV memory**: one pool, `[layers, kv heads, sessions x limit + max bucket, head dim]` for K and
  for V, allocated at start. A session's cache (`StaticCache`) is a region of `limit` slots, a view
  of the pool, so the `KVCache` operations (commit's gather, truncate) work in place and never
  reallocate; `new_cache` hands out a free region and a cache that is closed or collected gives it
  back. A context beyond `limit` is refused (ValueError naming `context`), never grown into.
- **Row buckets**: a forward's rows run in chunks of at most the largest bucket, each chunk at the
  smallest bucket that holds it (default: one bucket of 16 rows). The padding rows write their K/V
  into slots past every region (one per row, never read by a real row) and attend to the pool's
  first slot; their outputs are dropped. A chunk's rows see the K/V of the chunks
  before it (already written), so a prefill or a tree longer than a bucket runs as several steps
  (a row may see only rows before it: causal and tree masks).
- **One attention path**: each row attends over `limit` keys gathered from the pool by slot
  index: the slots it sees, in slot order, first, then masked filler. A tree node's keys are
  then where one-token decoding of its path finds them (the prefix, then its ancestors), and a
  reduction over them adds the same terms in the same order (attention over the region under a
  mask would not: a visible key's place in the reduction would depend on where the tree put
  it). Rows are SDPA's batch, one query each. Shapes depend only on B, never on the context
  length or the tree. The gather reads B x `limit` keys a layer: the price of exactness without
  a tree-attention kernel.
- **Graphs**: on CUDA (`graphs=True`, the default there), each bucket's step is captured once as a
  `torch.cuda.CUDAGraph` over static input buffers (tokens, positions, write slots, the session's
  region, the mask) and replayed for every session: the session is an input, not part of the
  graph. On a CPU the same step function runs eagerly at the same shapes: the CPU twin that CI
  runs (`tests/test_static_steps.py`). Off by default everywhere until a GPU run has measured it
  (`loadtest/gpu_check.py`); on a CPU it is slower than the dynamic path (a test twin).

Identity (what holds, and why): a row's result depends only on its own inputs when every product
is row-independent at a given row count and the attention's key count is fixed (it is: `limit`).
With **one bucket** (the default) every row of every forward (decode, verification, prefill) is
computed at the same shape, so a tree's rows and one-token decoding run the same kernels on the
same inputs: greedy output through speculation is token for token this runtime's plain decoding,
in any dtype (bf16 included), on any device. With several buckets that needs the kernels to be
row-invariant across row counts, and they are not: torch's SDPA and small GEMMs take other paths
for one or two query rows (measured on the CPU in fp32; `tests/test_static_steps.py`), so a decode
step's last bits differ from the same row in a tree. Several buckets trade that identity for
cheaper decode steps; it is a measured option, not the default. Output is compared against plain
decoding through the same `StaticSteps`, not against the dynamic path: the two attend in
different orders and may differ in the last bits.

Sessions together: `forward_batch` runs several sessions' rows as one step when they fit the
largest bucket (each row gathers its own session's keys; the graph is the same one), so
`specmesh.batching.BatchingTarget` with `max_rows` = the largest bucket batches verification
across sessions on a GPU as on a CPU, and with one bucket a row's result does not depend on which
rows share its step.

Not covered: tensor-parallel groups of more than one rank (each rank would need its own pool and
the all-reduce inside the graph).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specmesh.kv_cache import KVCache
from specmesh.model import Segment, Transformer, _rotate_half, _side_by_side, causal_mask

BUCKETS = (16,)  # one shape for every row: identity by construction (docstring)


class StaticCache(KVCache):
    """One session's region of a `StaticSteps` pool: `k`, `v` are views `[L, H_kv, limit, D]`."""

    def __init__(self, owner: "StaticSteps", region: int) -> None:  # no KVCache.__init__: no buffers of its own
        self.owner, self.region = owner, region
        self.base = region * owner.limit  # the region's first slot in the pool
        self.k = owner.k[:, :, self.base:self.base + owner.limit]
        self.v = owner.v[:, :, self.base:self.base + owner.limit]
        self.length = 0
        self._release = weakref.finalize(self, owner._give_back, region)

    def ensure_capacity(self, needed: int) -> None:
        if needed > self.owner.limit:
            raise ValueError(f"context: {needed} tokens exceed the static KV region of {self.owner.limit} slots "
                             f"per session")

    @property
    def closed(self) -> bool:
        """Whether `close` gave the region back (its finalizer has run)."""
        return not self._release.alive

    def close(self) -> None:
        """Give the region back now (another session may get it: this cache refuses further use)."""
        self.length = 0
        self._release()  # once: a finalizer runs at most one time


@dataclass
class StaticStats:
    steps: dict[int, int] = field(default_factory=dict)  # bucket -> forwards run at it
    padded_rows: int = 0  # rows run only to fill a bucket
    captured: list[int] = field(default_factory=list)  # buckets captured as CUDA graphs
    capture_s: float = 0.0


@dataclass
class _Inputs:
    """A step's static inputs (on the device): what a graph reads at every replay."""
    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64: pool slots the rows' K/V are written to
    keys: torch.Tensor  # [B, limit] int64: pool slots each row attends to, the visible ones first
    mask: torch.Tensor  # [B, limit] bool: which of `keys` are visible (a prefix of each row)
    features: torch.Tensor | None  # [B, hidden]: feature drafters' per-row input


class StaticSteps:
    def __init__(self, model: Transformer, limit: int = 4096, sessions: int = 8,
                 buckets: tuple[int, ...] = BUCKETS, graphs: bool | None = None) -> None:
        if model.tp_all_reduce is not None:
            raise ValueError("static_shapes: a tensor-parallel shard of more than one rank is not supported")
        if limit < 1 or sessions < 1:
            raise ValueError(f"static_shapes: limit and sessions must be >= 1, got {limit} and {sessions}")
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"static_shapes: buckets must be positive row counts, got {buckets}")
        p = model.model.norm.weight
        self.device, self.dtype = p.device, p.dtype
        graphs = self.device.type == "cuda" if graphs is None else graphs
        if graphs and self.device.type != "cuda":
            raise ValueError(f"static_shapes: CUDA graphs need a CUDA device, the model is on {self.device}")
        self.model, self.config = model, model.config
        self.limit, self.sessions, self.graphs = limit, sessions, graphs
        self.buckets = tuple(sorted(set(buckets)))
        attn = model.model.layers[0].self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        total = sessions * limit + self.buckets[-1]  # the regions, then one scratch slot per padding row
        shape = (model.config.num_layers, kv_heads, total, attn.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._scratch = sessions * limit
        self._free = list(range(sessions - 1, -1, -1))
        self._regions_lock = threading.Lock()
        self._lock = threading.Lock()  # one step at a time: the static inputs are shared
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, _Inputs, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.stats = StaticStats()

    # --- the model interface --------------------------------------------------------------------

    def new_cache(self, capacity: int = 0) -> StaticCache:
        """A free region (`capacity` is the caller's first guess; a region always holds `limit`)."""
        with self._regions_lock:
            if not self._free:
                raise RuntimeError(f"static_shapes: all {self.sessions} KV regions are in use (sessions)")
            return StaticCache(self, self._free.pop())

    def _give_back(self, region: int) -> None:
        with self._regions_lock:
            self._free.append(region)

    def __getattr__(self, name: str):
        if name == "model":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.model, name)  # weight_format, fc, vocab_map, ...

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticCache, start: int,
                mask: torch.Tensor | None = None, logits_rows: torch.Tensor | slice | None = slice(None),
                features: torch.Tensor | None = None, hidden: bool = False, exact: bool = True):
        """`Transformer.forward` at static shapes (`exact` is moot: there is one attention path)."""
        seg = Segment(tokens, positions, cache, start, mask, logits_rows, features, hidden)
        logits = self.forward_batch([seg])[0]
        return (logits, seg.hidden) if hidden else logits

    __call__ = forward

    def forward_batch(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """`Transformer.forward_batch` at static shapes: segments whose rows fit the largest bucket
        together run as one step (each row reads its own session's keys), a larger one alone in
        chunks. Rows are computed alike however they are grouped (one bucket: the same shapes)."""
        masks = [self._check(s) for s in segments]
        top = self.buckets[-1]
        with self._lock:
            if sum(s.tokens.shape[0] for s in segments) <= top:
                logits, h = self._run([self._part(s.cache, s.start, s.tokens, s.positions, m, s.features)
                                       for s, m in zip(segments, masks)])
                per = list(zip(logits.split([s.tokens.shape[0] for s in segments]),
                               h.split([s.tokens.shape[0] for s in segments])))
            else:
                per = []
                for s, m in zip(segments, masks):
                    t, f = s.tokens.shape[0], s.features
                    outs = [self._run([self._part(s.cache, s.start + lo, s.tokens[lo:lo + top],
                                                  s.positions[lo:lo + top], m[lo:lo + top, :s.start + min(t, lo + top)],
                                                  None if f is None else f[lo:lo + top])])
                            for lo in range(0, t, top)]
                    per.append((torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])))
        out = []
        for s, (logits, h) in zip(segments, per):
            dev = s.tokens.device
            if s.want_hidden:
                s.hidden = h.to(dev)
            out.append(None if s.logits_rows is None else logits[s.logits_rows].to(dev))
        return out

    def _check(self, s: Segment) -> torch.Tensor:
        """Refuse what this step cannot run (ValueError naming the field); the segment's mask on the CPU."""
        t = s.tokens.shape[0]
        if not isinstance(s.cache, StaticCache) or s.cache.owner is not self or s.cache.closed:
            raise ValueError("cache: not an open region of this model's static KV pool (use its new_cache)")
        if t < 1 or s.positions.shape != s.tokens.shape:
            raise ValueError(f"tokens: expected [T] tokens and [T] positions, T >= 1, got {tuple(s.tokens.shape)} "
                             f"and {tuple(s.positions.shape)}")
        s.cache.ensure_capacity(s.start + t)
        if s.mask is None:
            mask = causal_mask(s.start, t)
        elif tuple(s.mask.shape) != (t, s.start + t):
            raise ValueError(f"mask: expected shape ({t}, {s.start + t}), got {tuple(s.mask.shape)}")
        else:
            mask = s.mask.cpu()
        if t > self.buckets[-1] and mask[:, s.start:].triu(1).any():
            raise ValueError(f"mask: a forward of more than {self.buckets[-1]} rows runs in chunks, so a row may "
                             "see only rows before it (causal and tree masks do)")
        if (self.model.fc is not None) != (s.features is not None) or (
                s.features is not None and tuple(s.features.shape) != (t, self.config.hidden_size)):
            raise ValueError("features: a feature drafter needs one target feature per token; other models take none")
        return mask

    def _part(self, cache: StaticCache, start: int, tokens: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor, features: torch.Tensor | None) -> _Inputs:
        """One session's rows [start, start + n) as unpadded host inputs (`mask` [n, start + n])."""
        n = tokens.shape[0]
        seen = torch.zeros(n, self.limit, dtype=torch.bool)
        seen[:, :start + n] = mask
        # each row's visible slots first, in slot order (a stable sort of "hidden" keeps it)
        keys = torch.sort((~seen).to(torch.uint8), dim=1, stable=True).indices + cache.base
        return _Inputs(tokens.cpu().to(torch.int64), positions.cpu().to(torch.int64),
                       torch.arange(cache.base + start, cache.base + start + n), keys,
                       torch.arange(self.limit) < seen.sum(1, keepdim=True),
                       None if features is None else features.cpu().float())

    def _run(self, parts: list[_Inputs]) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts' rows (at most the largest bucket) as one step at their bucket: (logits,
        hidden) of the real rows, in order."""
        n = sum(p.tokens.shape[0] for p in parts)
        b = next(b for b in self.buckets if b >= n)
        pad = b - n  # padding rows: K/V to scratch slots, one visible key (outputs dropped; no empty softmax)
        host = _Inputs(*(torch.cat([getattr(p, name) for p in parts] + [filler])
                         for name, filler in (("tokens", torch.zeros(pad, dtype=torch.int64)),
                                              ("positions", torch.zeros(pad, dtype=torch.int64)),
                                              ("slots", torch.arange(self._scratch, self._scratch + pad)),
                                              ("keys", torch.zeros(pad, self.limit, dtype=torch.int64)),
                                              ("mask", torch.arange(self.limit).expand(pad, -1) < 1))),
                       features=None if parts[0].features is None else
                       torch.cat([p.features for p in parts] + [parts[0].features.new_zeros(pad, parts[0].features.shape[1])]))
        if self.graphs:
            graph, inputs, (logits, h) = self._graph(b)
            _copy_into(inputs, host)
            graph.replay()
            logits, h = logits[:n].clone(), h[:n].clone()
        else:
            logits, h = self._step(_on(host, self.device))
            logits, h = logits[:n], h[:n]
        self.stats.steps[b] = self.stats.steps.get(b, 0) + 1
        self.stats.padded_rows += pad
        return logits, h

    def warmup(self) -> dict:
        """Run (on CUDA: capture) every bucket once, on a scratch region; returns `report()`."""
        cache = self.new_cache()
        try:
            for b in self.buckets:
                ids = torch.zeros(b, dtype=torch.int64)
                feats = None if self.model.fc is None else torch.zeros(b, self.config.hidden_size)
                self.forward(ids, torch.arange(b), cache, 0, logits_rows=None, features=feats)
        finally:
            cache.close()
        self.stats.steps.clear()
        self.stats.padded_rows = 0
        return self.report()

    def report(self) -> dict:
        """What runs: buckets, graphs captured (and how long capturing took), forwards per bucket."""
        s = self.stats
        return {"buckets": list(self.buckets), "graphs": self.graphs,
                "captured": sorted(s.captured), "capture_s": round(s.capture_s, 3), "limit": self.limit,
                "sessions": self.sessions, "pool_bytes": 2 * self.k.numel() * self.k.element_size(),
                "steps": dict(sorted(s.steps.items())), "padded_rows": s.padded_rows}

    # --- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _step(self, x: _Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, vocab], final hidden states [B, hidden]) for the static inputs `x`; writes the
        rows' K/V into the pool at `x.slots`. Every shape depends on B only."""
        model = self.model
        layers = model.model.layers
        h = model.model.embed_tokens(x.tokens)
        if model.fc is not None:
            h = model.fc(torch.cat([x.features.to(h.dtype), h], dim=-1))
        cos, sin = model._rope(x.positions, h.dtype)
        hx = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            a = self._attention(layer.self_attn, hx, cos, sin, i, x)
            h, hx = layer.post_attention_layernorm.after_add(h, a)
            m = layer.mlp(hx)
            if i + 1 < len(layers):
                h, hx = layers[i + 1].input_layernorm.after_add(h, m)
            else:
                h = h + m
        return model._logits(h), h

    def _attention(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                   inputs: _Inputs) -> torch.Tensor:
        t, d = x.shape[0], attn.head_dim
        q, k, v = _side_by_side(attn, (attn.q_proj, attn.k_proj, attn.v_proj), x)
        q = q.view(t, -1, d).transpose(0, 1)  # [H, B, D]
        k = k.view(t, -1, d).transpose(0, 1)  # [H_kv, B, D]
        v = v.view(t, -1, d).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kc, vc = self.k[layer], self.v[layer]  # [H_kv, pool, D]
        kc.index_copy_(1, inputs.slots, k)
        vc.index_copy_(1, inputs.slots, v)
        flat = inputs.keys.flatten()
        keys = kc.index_select(1, flat).view(kc.shape[0], t, -1, d).transpose(0, 1)  # [B, H_kv, limit, D]
        values = vc.index_select(1, flat).view(vc.shape[0], t, -1, d).transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(2), keys, values,
                                           attn_mask=inputs.mask[:, None, None, :],
                                           enable_gqa=q.shape[0] != keys.shape[1])  # [B, H, 1, D]
        return attn.o_proj(o.reshape(t, -1))

    def _graph(self, b: int):
        """Bucket b's captured step (capturing it at its first use): (graph, its inputs, its outputs)."""
        got = self._graphs.get(b)
        if got is not None:
            return got
        t0 = time.perf_counter()
        dev = self.device
        inputs = _Inputs(  # padding-only rows: writes go to scratch slots, reads see one slot
            tokens=torch.zeros(b, dtype=torch.int64, device=dev), positions=torch.zeros(b, dtype=torch.int64, device=dev),
            slots=torch.arange(self._scratch, self._scratch + b, device=dev),
            keys=torch.zeros(b, self.limit, dtype=torch.int64, device=dev),
            mask=torch.arange(self.limit, device=dev).expand(b, -1) < 1,
            features=None if self.model.fc is None else torch.zeros(b, self.config.hidden_size, device=dev))
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up runs: lazy initialisation stays out of the graph
            for _ in range(2):
                self._step(inputs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._step(inputs)
        self._graphs[b] = got = (graph, inputs, outputs)
        self.stats.captured.append(b)
        self.stats.capture_s += time.perf_counter() - t0
        return got


def _on(x: _Inputs, device: torch.device) -> _Inputs:
    return _Inputs(*(None if t is None else t.to(device) for t in
                     (x.tokens, x.positions, x.slots, x.keys, x.mask, x.features)))


def _copy_into(dst: _Inputs, src: _Inputs) -> None:
    for name in ("tokens", "positions", "slots", "keys", "mask", "features"):
        d = getattr(dst, name)
        if d is not None:
            d.copy_(getattr(src, name), non_blocking=True)
