"""A sum tree over priorities held in torch tensors on one device, with batched operations.

The tree has fan-out F (32 by default; the replay uses 16): 1,048,576 leaves need 5 levels
at F = 16 (4 at F = 32), so a
batch of B samples or B priority updates costs ~4 rounds of a few tensor operations on
[B, F] blocks — no Python loop over items. On CUDA that is the code that runs; on CPU the
same walk over the same tensors runs as one C++ call per batch (`_cpu_kernels.py`), since
torch's per-operation overhead dominates small CPU tensors; tests hold both to the same
answers.

Levels: `levels[0]` are the leaves (capacity padded to a multiple of F), `levels[-1]` has
at most F nodes; `total` is the sum of the top level. Sums are float64 so that millions of
updates do not drift; every parent is recomputed from its children, never patched by deltas.
"""

from __future__ import annotations

from typing import Optional

import torch


class SumTree:
    def __init__(self, capacity: int, device: torch.device | str = "cpu", fanout: int = 32,
                 use_cpp: bool = True, levels: Optional[list[torch.Tensor]] = None) -> None:
        if capacity < 1:
            raise ValueError(f"sum tree capacity must be >= 1, got {capacity}")
        if fanout < 2:
            raise ValueError(f"sum tree fanout must be >= 2, got {fanout}")
        self.capacity = int(capacity)
        self.fanout = F = int(fanout)
        self.device = torch.device(device)
        sizes = self.level_sizes(capacity, F)
        if levels is None:
            levels = [torch.zeros(s, dtype=torch.float64, device=self.device) for s in sizes]
        elif [tuple(t.shape) for t in levels] != [(s,) for s in sizes] or any(t.dtype != torch.float64 for t in levels):
            raise ValueError(f"sum tree levels must be float64 of sizes {sizes}")
        self.levels = list(levels)  # given levels (e.g. shared memory) are used in place
        self._offsets = torch.arange(F, device=self.device)
        self.use_cpp = use_cpp  # CPU only: the C++ walk (replay_server/_cpu_kernels.py)

    @staticmethod
    def level_sizes(capacity: int, fanout: int) -> list[int]:
        """Lengths of the levels, leaves first (each padded to whole blocks of `fanout`)."""
        F = int(fanout)
        sizes = []
        n = -(-int(capacity) // F) * F
        while True:
            sizes.append(n)
            if n <= F:
                break
            n = -(-(n // F) // F) * F
        return sizes

    # ---------------------------------------------------------------------------------
    @property
    def total(self) -> torch.Tensor:
        return self.levels[-1].sum()

    @property
    def leaves(self) -> torch.Tensor:
        return self.levels[0][: self.capacity]

    def get(self, idx: torch.Tensor) -> torch.Tensor:
        return self.levels[0][idx]

    def update(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Set leaves `idx` [M] to `values` [M] (>= 0) and refresh their ancestors.

        Within one call a leaf given twice takes one of its values (the sums stay exact)."""
        if idx.shape != values.shape or idx.dim() != 1:
            raise ValueError(f"sum tree update needs equal 1-D idx and values, got {list(idx.shape)} "
                             f"and {list(values.shape)}")
        if idx.numel() == 0:
            return
        values = values.to(torch.float64)
        k = self._kernels()
        if k is not None:
            k.tree_update(self.levels, idx.contiguous(), values.contiguous(), self.fanout)
            return
        F = self.fanout
        self.levels[0][idx] = values
        node = idx
        for lo, hi in zip(self.levels[:-1], self.levels[1:]):
            node = torch.div(node, F, rounding_mode="floor")  # [M] parents
            block = lo[(node * F).unsqueeze(1) + self._offsets]  # [M, F] their children
            hi[node] = block.sum(1)

    def update_range(self, start: int, values: torch.Tensor) -> None:
        """Set the contiguous leaves [start, start + len(values)) and refresh their ancestors
        as whole blocks (the ring writer's case: cheaper than per-leaf walks)."""
        m = values.numel()
        if m == 0:
            return
        if start < 0 or start + m > self.capacity:
            raise ValueError(f"leaf range [{start}, {start + m}) is outside [0, {self.capacity})")
        F = self.fanout
        self.levels[0][start:start + m] = values.to(torch.float64)
        lo, hi = start, start + m
        for below, above in zip(self.levels[:-1], self.levels[1:]):
            lo, hi = lo // F, -(-hi // F)  # parents covering the changed children
            above[lo:hi] = below[lo * F:hi * F].view(-1, F).sum(1)

    def set_all(self, values: torch.Tensor) -> None:
        """Replace every leaf (length capacity) and rebuild the tree."""
        self.levels[0].zero_()
        self.levels[0][: self.capacity] = values.to(torch.float64)
        self.rebuild()

    def rebuild(self) -> None:
        F = self.fanout
        for lo, hi in zip(self.levels[:-1], self.levels[1:]):
            sums = lo.view(-1, F).sum(1)
            hi.zero_()
            hi[: sums.numel()] = sums

    def find(self, mass: torch.Tensor) -> torch.Tensor:
        """Leaf index for each prefix mass in `mass` [B] (0 <= mass < total).

        Leaf i is returned for mass in [sum(p[:i]), sum(p[:i+1])); a leaf with priority 0 is
        never returned while the total is positive (a mass that rounding pushes past the
        end of a block goes to the block's last non-empty child)."""
        u = mass.to(torch.float64)
        k = self._kernels()
        if k is not None:
            return k.tree_find(self.levels, u.contiguous(), self.fanout)
        F = self.fanout
        node = torch.zeros(u.shape, dtype=torch.long, device=self.device)
        top = len(self.levels) - 1
        for level in range(top, -1, -1):
            lv = self.levels[level]
            if level == top:
                base = node
                block = lv.unsqueeze(0).expand(u.numel(), -1)  # [B, <=F]
            else:
                base = node * F
                block = lv[base.unsqueeze(1) + self._offsets]  # [B, F] children
            below = block.cumsum(1) <= u.unsqueeze(1)  # children wholly below the mass
            u = u - (block * below).sum(1)
            j = below.sum(1)
            # Rounding can put the mass at the block's end: take its last non-empty child.
            n = block.shape[1]
            last = ((block > 0) * self._offsets[:n]).amax(1)
            overflow = j >= n
            node = base + torch.where(overflow, last, j)
            u = torch.where(overflow, torch.full_like(u, float("inf")), u)  # keep to the end below
        return node

    def _kernels(self):
        if self.device.type != "cpu" or not self.use_cpp:
            return None
        from replay_server._cpu_kernels import kernels
        return kernels()

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "fanout": self.fanout, "leaves": self.levels[0].clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["capacity"] != self.capacity or state["fanout"] != self.fanout:
            raise ValueError(f"sum tree state is for capacity {state['capacity']} / fanout {state['fanout']}, "
                             f"this tree has {self.capacity} / {self.fanout}")
        self.levels[0].copy_(state["leaves"].to(self.device))
        self.rebuild()
