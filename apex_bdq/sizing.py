"""Replica sizing from the queueing model: one pure function shared by the simulator, the
rules that size with a model (the predictive rule, the oracle) and the serving path.

A class with mean service time s (exponential) and p99 latency SLO L is served by c
replicas; an arrival is late when its wait exceeds the budget b = L - s. In the stationary
M/M/c queue at offered load a = lambda * s (Erlangs), P(W > b) = C(c, a) exp(-(c - a) b / s)
(Erlang C). `SizingTable` holds, per class and replica count c, the largest offered load c
replicas carry with P(late) <= `tail` (the SLO's 1 %); `replicas_for` inverts it: the fewest
replicas whose stationary p99 meets the SLO at a given request rate. A capacity action of
platform v2 plans for `factor x rate` (the factor is the tier the policy picks), so a served
decision means the same replica count in the simulator, in a rule and behind an API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np



def max_load_within_slo(c: np.ndarray, service_s: float, slo_s: float, tail: float,
                        iters: int = 60) -> np.ndarray:
    """Largest offered load (Erlangs) that c >= 1 replicas serve with P(latency > slo) <= tail,
    by bisection on a in [0, c) (P(late) rises with a). 0 where even a -> 0 is late (slo <= s)."""
    from apex_bdq.sim.queueing import erlang_c  # here: apex_bdq.sim imports this module
    c = np.asarray(c, dtype=np.float64)
    budget = slo_s - service_s
    lo = np.zeros_like(c)
    hi = c.copy()
    if budget <= 0:
        return lo
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        late = erlang_c(c, mid) * np.exp(-(c - mid) * budget / service_s)
        ok = late <= tail
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid)
    return lo


@dataclass(frozen=True)
class SizingTable:
    """Per class k and replica count c = 1..c_max[k]: the load c replicas carry within the SLO."""

    service_s: np.ndarray  # [K] mean service time, seconds
    max_load: np.ndarray  # [K, C] float64, Erlangs; column j is c = j + 1; +inf past the class's c_max
    c_max: np.ndarray  # [K] int, the pool cap of each class
    min_replicas: int

    @classmethod
    def build(cls, service_s: Sequence[float], slo_s: Sequence[float], c_max: Sequence[int],
              min_replicas: int = 1, tail: float = 0.01) -> "SizingTable":
        svc = np.asarray(service_s, dtype=np.float64)
        slo = np.asarray(slo_s, dtype=np.float64)
        cap = np.asarray(c_max, dtype=np.int64)
        if svc.shape != slo.shape or svc.shape != cap.shape or svc.ndim != 1:
            raise ValueError(f"service_s, slo_s and c_max need one value per class, got shapes "
                             f"{svc.shape}, {slo.shape}, {cap.shape}")
        if (slo <= svc).any():
            k = int(np.argmax(slo <= svc))
            raise ValueError(f"class {k}: SLO {slo[k]} s is not above its mean service time {svc[k]} s")
        if (cap < max(1, min_replicas)).any():
            raise ValueError(f"c_max {cap.tolist()} must be >= max(1, min_replicas={min_replicas})")
        width = int(cap.max())
        table = np.full((len(svc), width), np.inf)
        for k in range(len(svc)):
            c = np.arange(1, cap[k] + 1, dtype=np.float64)
            table[k, :cap[k]] = max_load_within_slo(c, svc[k], slo[k], tail)
        return cls(service_s=svc, max_load=table, c_max=cap, min_replicas=int(min_replicas))

    @property
    def num_classes(self) -> int:
        return len(self.service_s)


def replicas_for(rate_rps: np.ndarray, table: SizingTable) -> np.ndarray:
    """Fewest replicas per class whose stationary p99 meets the SLO at `rate_rps` [..., K]
    requests per second, clipped to [min_replicas, c_max]; int64 of the same shape. A rate
    beyond what the pool cap can carry within the SLO gets the cap (the pool's limit)."""
    rate = np.asarray(rate_rps, dtype=np.float64)
    if rate.shape[-1:] != (table.num_classes,):
        raise ValueError(f"rate_rps must end in the class axis ({table.num_classes}), got shape {rate.shape}")
    if not np.isfinite(rate).all() or (rate < 0).any():
        raise ValueError("rate_rps must be finite and >= 0")
    load = rate * table.service_s  # [..., K] Erlangs
    out = np.empty(load.shape, dtype=np.int64)
    for k in range(table.num_classes):
        # First c (1-based) whose max_load reaches the load; the table is increasing in c.
        out[..., k] = np.searchsorted(table.max_load[k, :table.c_max[k]], load[..., k], side="left") + 1
    out = np.where(load > 0, out, 0)  # no requests: the floor
    return np.clip(out, table.min_replicas, table.c_max)


class HoldWindow:
    """The scale-down hold of platform v2's capacity branch, for [S, K] pools: a pool's target
    is the highest plan of the open 15-s block and of the newest `hold_blocks[h]` closed ones
    (h = the hold level; 0 blocks releases at once), as HPA's scale-down stabilisation window
    does. `step` is called once per tick, after the plans of that tick; the simulator and the
    KEDA scaler (`apex_bdq.control`) both hold with this class."""

    def __init__(self, initial: np.ndarray, hold_blocks: np.ndarray, block_ticks: int) -> None:
        self.hold_blocks = np.asarray(hold_blocks, dtype=np.int64)  # [n] closed blocks each level reaches back
        self.block = max(1, int(block_ticks))
        self.nb = max(1, int(self.hold_blocks.max()))
        self.ring = np.repeat(np.asarray(initial, dtype=np.int32)[None], self.nb, axis=0)  # [nb, S, K]
        self.open = np.asarray(initial, dtype=np.int32).copy()
        self.ptr = 0
        self.t = 0
        self._suffix()

    def _suffix(self) -> None:
        """suffix[j] [S, K]: highest plan over the newest j closed blocks (suffix[0] = 0)."""
        nb = self.nb
        order = [(self.ptr - 1 - j) % nb for j in range(nb)]  # newest first
        suf = np.zeros((nb + 1,) + self.open.shape, dtype=np.int32)
        np.maximum.accumulate(self.ring[order], axis=0, out=suf[1:])
        self.suffix = suf

    def target(self, plan: np.ndarray, hold_level: np.ndarray) -> np.ndarray:
        """[S, K] the held target for this tick's `plan` [S, K] at hold levels [S, K]."""
        np.maximum(self.open, plan, out=self.open)
        reach = self.hold_blocks[hold_level]  # [S, K] closed blocks each hold reaches back
        held = np.take_along_axis(self.suffix, reach[None], axis=0)[0]
        # A hold covers the open block (plans since it began) and `reach` closed ones.
        return np.where(reach > 0, np.maximum(self.open, held), plan)

    def step(self) -> None:
        """End of a tick: the open block closes every `block_ticks` ticks."""
        if self.t % self.block == self.block - 1:
            self.ring[self.ptr] = self.open
            self.ptr = (self.ptr + 1) % self.nb
            self._suffix()
            self.open = np.zeros_like(self.open)
        self.t += 1
