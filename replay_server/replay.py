"""Prioritized replay = storage + ring writer + proportional sampler (Schaul et al. 2016),
in torch tensors on one device (CPU here, CUDA when present), no Ray.

- Storage: one preallocated tensor per field, `[capacity, *shape]`.
- Writer: a ring (oldest overwritten first); every write stamps the slot with a fresh
  generation number, so a priority update computed for an overwritten transition is
  recognised and ignored.
- Sampler: proportional to p^alpha through a sum tree on the same device; importance
  weights (N P(i))^-beta normalised by the batch maximum (as Ape-X / Acme do), with beta
  annealed linearly from beta0 to 1 over `beta_steps` sample calls.
Every operation is batched: no Python loop over transitions.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

import torch

from replay_server import _memory
from replay_server.sum_tree import SumTree

if TYPE_CHECKING:
    from replay_server.shared import SharedArena


_PACKABLE = (torch.float32, torch.bool, torch.uint8, torch.int8, torch.int16)


class ReplayError(ValueError):
    """Bad input to the replay (shapes, dtypes, NaN priorities, empty buffer, bad state)."""


@dataclass(frozen=True)
class FieldSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class SampledBatch:
    indices: torch.Tensor  # [B] long, slots
    generations: torch.Tensor  # [B] long, the slots' generations when sampled
    weights: torch.Tensor  # [B] float32 importance weights, max 1
    probabilities: torch.Tensor  # [B] float64 sampling probability of each slot
    data: dict  # field -> [B, *shape]


class PrioritizedReplay:
    def __init__(self, capacity: int, fields: Mapping[str, FieldSpec], device: torch.device | str = "cpu",
                 alpha: float = 0.6, beta0: float = 0.4, beta_steps: int = 100_000, eps: float = 1e-6,
                 fanout: int = 16, seed: Optional[int] = None, shared: Optional["SharedArena"] = None,
                 use_cpp: bool = True) -> None:
        """shared: allocate every tensor from this arena (`replay_server/shared.py`): a fresh
        one makes this replay shareable (hand `shared_spec()` to another process on the node);
        an attached one makes this object a view of that replay, operating on it in place.
        use_cpp: on CPU, run sample and priority update as one C++ call each
        (`_cpu_kernels.py`); False runs the tensor-operation path CUDA runs (the reference)."""
        if capacity < 1:
            raise ReplayError(f"replay capacity must be >= 1, got {capacity}")
        if not 0 <= alpha <= 1 or not 0 <= beta0 <= 1:
            raise ReplayError(f"alpha and beta0 must be in [0, 1], got alpha={alpha}, beta0={beta0}")
        if not fields:
            raise ReplayError("replay needs at least one field")
        self.capacity = int(capacity)
        self.device = torch.device(device) if shared is None else shared.device
        self.fields = dict(fields)
        self.alpha, self.beta0, self.beta_steps, self.eps = alpha, beta0, max(1, beta_steps), eps
        # Fields that float32 holds exactly (float32, bool, 8/16-bit ints) share one packed
        # [capacity, columns] matrix, so a sampled batch is one row gather; others get their
        # own tensor. `storage[name]` is a [capacity, *shape] view either way.
        self.columns: dict[str, tuple[int, int]] = {}
        col = 0
        for k, f in self.fields.items():
            if f.dtype in _PACKABLE:
                width = int(torch.Size(f.shape).numel())
                self.columns[k] = (col, col + width)
                col += width
        plan = [("packed", (self.capacity, col), torch.float32)]
        plan += [(f"field.{k}", (self.capacity, *f.shape), f.dtype) for k, f in self.fields.items()
                 if k not in self.columns]
        plan += [("generation", (self.capacity,), torch.long), ("meta", (4,), torch.long),
                 ("max_priority", (), torch.float64)]
        plan += [(f"tree.{i}", (n,), torch.float64) for i, n in enumerate(SumTree.level_sizes(self.capacity, fanout))]
        self.shared = shared
        if shared is None:
            t = {name: _memory.zeros(shape, dt, self.device) for name, shape, dt in plan}
            self.lock = threading.RLock()  # the learner samples from a prefetch thread
        else:
            t = shared.allocate(plan)
            self.lock = shared.lock
        fresh = shared is None or not shared.attached
        self.packed = t["packed"]
        self.storage = {}
        for k, f in self.fields.items():
            if k in self.columns:
                a, b = self.columns[k]
                self.storage[k] = self.packed[:, a:b].view(self.capacity, *f.shape)
            else:
                self.storage[k] = t[f"field.{k}"]
        self.generation = t["generation"]
        # Counters live in a tensor so that an attached process sees them: next slot, size,
        # transitions ever written (the next generation number), transitions ever sampled.
        self._meta = t["meta"]
        self._max_p = t["max_priority"]  # largest priority seen
        if fresh:
            self.generation.fill_(-1)
            self._max_p.fill_(1.0)
        self.use_cpp = use_cpp
        self._unpacked = [k for k in self.fields if k not in self.columns]
        self._split_plan: Optional[list] = None  # the C++ sample's field split, built at first use
        self.tree = SumTree(self.capacity, self.device, fanout, use_cpp=use_cpp,
                            levels=[t[f"tree.{i}"] for i in range(len(SumTree.level_sizes(self.capacity, fanout)))])
        self.samples = 0  # this process's sample calls (drive its beta)
        if use_cpp and self.device.type == "cpu":
            self.tree._kernels()  # build (first time, ~35 s) or load the C++ kernels now, not inside a timed run
        self.rng = torch.Generator(device=self.device)
        self.rng.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        self._arange_all = torch.arange(self.capacity, device=self.device)

    # -- counters (shared with attached processes) ----------------------------------------
    @property
    def next_slot(self) -> int:
        return int(self._meta[0])

    @property
    def size(self) -> int:
        return int(self._meta[1])

    @property
    def writes(self) -> int:
        """Transitions ever written (inserted)."""
        return int(self._meta[2])

    @property
    def sampled(self) -> int:
        """Transitions ever sampled, by every process using this replay."""
        return int(self._meta[3])

    def shared_spec(self, node_id: Optional[str] = None):
        """The handle another process on this node attaches with (shareable replays only)."""
        if self.shared is None:
            raise ReplayError("this replay was not created with a SharedArena; it cannot be attached to")
        return self.shared.spec(node_id)

    @classmethod
    def attach(cls, spec, capacity: int, fields: Mapping[str, FieldSpec], **kwargs) -> "PrioritizedReplay":
        """A view of the shareable replay described by `spec` (same capacity and fields)."""
        from replay_server.shared import SharedArena
        return cls(capacity, fields, shared=SharedArena.attach(spec), **kwargs)

    # -- writer --------------------------------------------------------------------------
    def _arange(self, m: int) -> torch.Tensor:
        return self._arange_all[:m]  # m <= capacity

    def _check_batch(self, batch: Mapping[str, torch.Tensor], finite_checked_by=()) -> int:
        """Fields, dtypes, shapes and row counts; NaN / inf in float fields except those in
        `finite_checked_by` (the C++ insert checks the packed ones in its copy pass)."""
        missing = set(self.fields) - set(batch)
        extra = set(batch) - set(self.fields)
        if missing or extra:
            raise ReplayError(f"batch fields must be {sorted(self.fields)}; missing {sorted(missing)}, "
                              f"unexpected {sorted(extra)}")
        m = None
        for k, spec in self.fields.items():
            t = batch[k]
            if not isinstance(t, torch.Tensor):
                raise ReplayError(f"field {k!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != spec.dtype:
                raise ReplayError(f"field {k!r} must be {spec.dtype}, got {t.dtype}")
            if tuple(t.shape[1:]) != spec.shape:
                raise ReplayError(f"field {k!r} must be [M, {', '.join(map(str, spec.shape))}], got {list(t.shape)}")
            if m is None:
                m = t.shape[0]
            elif t.shape[0] != m:
                raise ReplayError(f"field {k!r} has {t.shape[0]} rows, other fields have {m}")
            # One reduction finds NaN / inf (an overflowing sum is then checked element-wise).
            if (k not in finite_checked_by and t.is_floating_point() and not bool(torch.isfinite(t.sum()))
                    and not bool(torch.isfinite(t).all())):
                raise ReplayError(f"field {k!r} has NaN or infinite values")
        return int(m)

    def _leaf_values(self, priorities: torch.Tensor, name: str = "priorities") -> torch.Tensor:
        p = priorities.to(self.device, torch.float64)
        if not bool(((p >= 0) & (p < float("inf"))).all()):  # NaN fails both comparisons
            bad = p[~((p >= 0) & (p < float("inf")))][0].item()
            raise ReplayError(f"{name} must be finite and >= 0, got {bad}")
        return (p + self.eps) ** self.alpha

    def add(self, batch: Mapping[str, torch.Tensor], priorities: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write M transitions (fields [M, ...]); priorities [M] (e.g. |TD|), or the running
        maximum when None. Returns (slots [M], generations [M])."""
        kern = self._insert_kernel()
        m = self._check_batch(batch, self.columns if kern is not None else ())
        if priorities is not None and priorities.shape != (m,):
            raise ReplayError(f"priorities must be [M={m}], got {list(priorities.shape)}")
        if m == 0:
            empty = torch.empty(0, dtype=torch.long, device=self.device)
            return empty, empty
        keep = min(m, self.capacity)  # a batch larger than the ring keeps its newest rows
        # Leaf values are computed (and validated) before anything is written, outside the lock.
        leaf = None if priorities is None else self._leaf_values(priorities)[m - keep:]
        with self.lock:
            return self._add(batch, priorities, leaf, m, kern)

    def _insert_kernel(self):
        """The C++ one-pass insert (CPU, C++ kernels built), else None."""
        if not self.use_cpp or self.device.type != "cpu" or not self.columns:
            return None
        return self.tree._kernels()

    def _add(self, batch, priorities, leaf, m: int, kern=None) -> tuple[torch.Tensor, torch.Tensor]:
        next_slot, writes = self.next_slot, self.writes
        keep = min(m, self.capacity)  # a batch larger than the ring keeps its newest rows
        src = slice(m - keep, m)
        slots = (next_slot + self._arange(keep)) % self.capacity
        # The ring range is one or two contiguous runs: plain slice copies, no index scatter.
        first = min(keep, self.capacity - next_slot)
        runs = [(slice(next_slot, next_slot + first), slice(m - keep, m - keep + first))]
        if first < keep:
            runs.append((slice(0, keep - first), slice(m - keep + first, m)))
        rest = batch
        if kern is not None:  # packed fields: checked, then written row by row in one C++ pass
            names = list(self.columns)
            srcs = [batch[k].contiguous() for k in names]
            status, f, row = kern.replay_insert(self.packed, srcs, [self.columns[k][0] for k in names],
                                                m - keep, keep, next_slot)
            if status:
                raise ReplayError(f"field {names[f]!r} has NaN or infinite values (row {row})")
            rest = {k: t for k, t in batch.items() if k not in self.columns}
        for k, t in rest.items():
            dst = self.storage[k]
            for d, s_ in runs:
                dst[d] = t[s_].to(self.device, dst.dtype, non_blocking=True)
        gens = writes + (m - keep) + self._arange(keep)
        self.generation[slots] = gens
        if leaf is None:
            leaf = ((self._max_p + self.eps) ** self.alpha).expand(keep)
        else:
            pr = priorities[src]
            torch.maximum(self._max_p, pr.max().to(self.device, torch.float64), out=self._max_p)
        self.tree.update_range(next_slot, leaf[:first])
        if first < keep:
            self.tree.update_range(0, leaf[first:])
        self._meta[0] = (next_slot + keep) % self.capacity
        self._meta[1] = min(self.capacity, self.size + keep)
        self._meta[2] = writes + m
        return slots, gens

    # -- sampler -------------------------------------------------------------------------
    @property
    def beta(self) -> float:
        return self.beta0 + (1.0 - self.beta0) * min(1.0, self.samples / self.beta_steps)

    def sample(self, batch_size: int, beta: Optional[float] = None) -> SampledBatch:
        if batch_size < 1:
            raise ReplayError(f"batch_size must be >= 1, got {batch_size}")
        with self.lock:
            return self._sample(batch_size, beta)

    def _sample(self, batch_size: int, beta: Optional[float]) -> SampledBatch:
        size = self.size
        if size == 0:
            raise ReplayError("cannot sample from an empty replay")
        k = self.tree._kernels()
        if k is not None:  # CPU: walk, weights, row gather and generations in one C++ call
            total = float(self.tree.total)
            if not total > 0:
                raise ReplayError("cannot sample: every priority in the replay is zero (use eps > 0)")
            u = torch.rand(batch_size, dtype=torch.float64, generator=self.rng)  # times total in C++
            b = float(self.beta if beta is None else beta)
            idx, p, w, parts, gens, bad = k.replay_sample(self.tree.levels, u, self.tree.fanout, total, size, b,
                                                          self.packed, self.generation, self._meta,
                                                          self._split_plan or self._make_split(k))
            if not bad:
                self.samples += 1
                data = dict(zip(self.columns, parts))
                for name in self._unpacked:
                    data[name] = self.storage[name].index_select(0, idx)
                return SampledBatch(indices=idx, generations=gens, weights=w, probabilities=p,
                                    data={name: data[name] for name in self.fields})
            # A sampled leaf <= 0 (float rounding): undo the count; the path below draws again.
            self._meta[3] -= batch_size
        total = self.tree.total
        if not bool(total > 0):
            raise ReplayError("cannot sample: every priority in the replay is zero (use eps > 0)")
        u = torch.rand(batch_size, dtype=torch.float64, device=self.device, generator=self.rng) * total
        b = self.beta if beta is None else beta
        idx = self.tree.find(u)
        leaf = self.tree.get(idx)
        while not bool((leaf > 0).all()):  # float rounding at a block end: draw those again
            bad = leaf <= 0
            u2 = torch.rand(int(bad.sum()), dtype=torch.float64, device=self.device, generator=self.rng) * total
            idx[bad] = self.tree.find(u2)
            leaf = self.tree.get(idx)
        p = leaf / total  # [B] sampling probabilities
        w = (size * p) ** (-b)
        w = (w / w.max()).to(torch.float32)
        self.samples += 1
        self._meta[3] += batch_size
        rows = self.packed.index_select(0, idx)  # [B, columns]: one gather for the packed fields
        return SampledBatch(indices=idx, generations=self.generation.index_select(0, idx), weights=w,
                            probabilities=p, data=self._fields_of(rows, idx))

    def _make_split(self, k) -> list:
        """Each packed field as [first column, end column, c10 dtype code, *shape]."""
        self._split_plan = [[a, b, k.scalar_type(torch.empty(0, dtype=self.fields[name].dtype)),
                             *self.fields[name].shape] for name, (a, b) in self.columns.items()]
        return self._split_plan

    def _fields_of(self, rows: torch.Tensor, idx: torch.Tensor) -> dict:
        """field -> [B, *shape] from the gathered packed rows (views) and the other fields."""
        n = rows.shape[0]
        data = {}
        for k, f in self.fields.items():
            if k in self.columns:
                a, b_ = self.columns[k]
                v = rows[:, a:b_].view(n, *f.shape)
                data[k] = v if f.dtype == torch.float32 else v.to(f.dtype)
            else:
                data[k] = self.storage[k].index_select(0, idx)
        return data

    def update_priorities(self, indices: torch.Tensor, generations: torch.Tensor, priorities: torch.Tensor) -> int:
        """Set new priorities; entries whose slot has been overwritten since sampling (its
        generation changed) are ignored. Returns how many were applied."""
        if not (indices.shape == generations.shape == priorities.shape) or indices.dim() != 1:
            raise ReplayError(f"indices, generations and priorities must be equal 1-D shapes, got "
                              f"{list(indices.shape)}, {list(generations.shape)}, {list(priorities.shape)}")
        idx = indices.to(self.device)
        if idx.numel() == 0:
            return 0
        k = self.tree._kernels()
        if k is not None:  # CPU: checks, generation test, leaves, ancestors, max in one C++ call
            pr = priorities.to(self.device)  # e.g. from a learner on a GPU
            if pr.dtype not in (torch.float32, torch.float64):
                pr = pr.double()
            with self.lock:
                applied, status, pos = k.replay_update(
                    self.tree.levels, self.tree.fanout, self.generation, idx.long().contiguous(),
                    generations.to(self.device, torch.long).contiguous(), pr.contiguous(), self.eps, self.alpha,
                    self._max_p)
            if status == 1:
                raise ReplayError(f"indices must be in [0, {self.capacity}), got {int(idx.min())}..{int(idx.max())}")
            if status == 2:
                raise ReplayError(f"priorities must be finite and >= 0, got {pr[pos].item()}")
            return applied
        if not bool(((idx >= 0) & (idx < self.capacity)).all()):
            raise ReplayError(f"indices must be in [0, {self.capacity}), got {int(idx.min())}..{int(idx.max())}")
        leaf = self._leaf_values(priorities)
        with self.lock:
            return self._update(idx, generations, priorities, leaf)

    def _update(self, idx, generations, priorities, leaf) -> int:
        fresh = self.generation[idx] == generations.to(self.device)
        pr = priorities.to(self.device)
        n = idx.numel()
        if not bool(fresh.all()):
            idx, leaf, pr = idx[fresh], leaf[fresh], pr[fresh]
            n = idx.numel()
        if n:
            self.tree.update(idx, leaf)
            torch.maximum(self._max_p, pr.max().to(torch.float64), out=self._max_p)  # no host sync
        return n

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self.lock:
            return self._state_dict()

    def _state_dict(self) -> dict:
        return {
            "capacity": self.capacity, "fields": {k: (f.shape, str(f.dtype)) for k, f in self.fields.items()},
            "storage": {k: t[: self.size].clone() if self.size < self.capacity else t.clone()
                        for k, t in self.storage.items()},
            "generation": self.generation.clone(), "leaves": self.tree.leaves.clone(),
            "next_slot": self.next_slot, "size": self.size, "writes": self.writes, "samples": self.samples,
            "sampled": self.sampled,
            "max_priority": float(self._max_p), "alpha": self.alpha, "rng": self.rng.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        want = {k: (f.shape, str(f.dtype)) for k, f in self.fields.items()}
        got = {k: (tuple(v[0]), v[1]) for k, v in state.get("fields", {}).items()}
        if state.get("capacity") != self.capacity or got != want:
            raise ReplayError(f"replay state is for capacity {state.get('capacity')} with fields {got}; "
                              f"this replay has capacity {self.capacity} with fields {want}")
        if state.get("alpha") != self.alpha:
            raise ReplayError(f"replay state was written with alpha={state.get('alpha')}, this replay has {self.alpha}")
        with self.lock:
            self._load(state)

    def _load(self, state: dict) -> None:
        n = state["size"]
        for k, t in state["storage"].items():
            self.storage[k][: t.shape[0]].copy_(t.to(self.device))
        self.generation.copy_(state["generation"].to(self.device))
        self.tree.set_all(state["leaves"].to(self.device))
        self._meta.copy_(torch.tensor([state["next_slot"], n, state["writes"], state.get("sampled", 0)]))
        self.samples = state["samples"]
        self._max_p.fill_(state["max_priority"])
        self.rng.set_state(state["rng"])
