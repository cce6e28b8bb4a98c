"""Per-session key/value cache with tree verification and path commit.

Layout: one preallocated buffer per K and V, `[num_layers, num_kv_heads, capacity, head_dim]`.
Slots `[0, length)` hold **committed** tokens. A forward may write scratch slots after `length`
(a verification tree, or a drafter's tree being built); `commit(slots)` then moves just the
accepted scratch slots down to `length..` (a gather of a handful of entries, never a copy of the
whole cache) and drops the rest. Capacity grows by doubling, so appends are amortised O(1).

The cache does not know about models, tokens or trees: only slots.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 256


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int = MIN_CAPACITY,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, max(capacity, 1), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, H_kv, C, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, H_kv, C, D]
        self.length = 0  # committed slots

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @torch.inference_mode()
    def ensure_capacity(self, needed: int) -> None:
        """Grow (by doubling) so that slots [0, needed) exist; keeps all current contents."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity, MIN_CAPACITY)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], new_cap, old.shape[3]))
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[H_kv, T, D]` at slots [start, start+T) of one layer."""
        end = start + k.shape[1]
        assert end <= self.capacity, "call ensure_capacity before the forward"
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of every slot of one layer: `[H_kv, capacity, D]` each (contiguous views, to write into)."""
        return self.k[layer], self.v[layer]

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [0, end) for one layer: `[H_kv, end, D]` each (views, no copy)."""
        return self.k[layer, :, :end], self.v[layer, :, :end]

    @torch.inference_mode()  # the buffers may be inference tensors (grown inside a forward)
    def commit(self, slots: list[int]) -> None:
        """Append scratch `slots` (each >= length, in order) to the committed prefix."""
        if not slots:
            return
        assert all(s >= self.length for s in slots), "only scratch slots can be committed"
        assert max(slots) < self.capacity
        n = len(slots)
        if slots != list(range(self.length, self.length + n)):
            src = torch.tensor(slots, device=self.k.device)
            dst = torch.arange(self.length, self.length + n, device=self.k.device)
            self.k[:, :, dst] = self.k[:, :, src]
            self.v[:, :, dst] = self.v[:, :, src]
        self.length += n

    def close(self) -> None:
        """Release the buffers (the session is gone)."""
        self.k = self.v = torch.zeros(0, 0, 0, 0)
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget committed slots from `length` on (rollback to an earlier point)."""
        assert 0 <= length <= self.length
        self.length = length
