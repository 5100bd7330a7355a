"""What both platforms share: the replica pipeline, the action and layout checks, and one
tick of the per-class queues.

`Provisioning` holds each pool's ready replicas and the ones still booting. New replicas
boot for `delay` ticks; a lower target first cancels the newest booting replicas, then
removes ready ones at once, down to the floor. The pipeline is a ring of cumulative launch
counts (slot t % L holds the replicas launched up to tick t, read back L ticks later), so
cancelling the newest booting replicas is one clamp of the whole ring at the new total.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

P99_Q = 0.01  # tail mass of the p99


class ActionError(ValueError):
    """An action array has the wrong shape, type or range."""


class CapacityBounds(NamedTuple):
    """Per-pool replica bounds [S, K] (either may be None) that a guard puts around the
    capacity and hold branches' target: the simulator keeps the target within [lo, hi]."""

    lo: Optional[np.ndarray] = None
    hi: Optional[np.ndarray] = None


class Provisioning:
    """Ready and booting replicas of [S, P] pools."""

    def __init__(self, active: np.ndarray, delay_ticks: int, min_servers: int) -> None:
        S, P = active.shape
        self.delayed = delay_ticks > 0
        self.L = max(1, delay_ticks)
        self.min_servers = min_servers
        self.active = active.astype(np.int32)  # [S, P] ready
        self.launched = np.zeros((S, P), dtype=np.int32)
        self.activated = np.zeros((S, P), dtype=np.int32)
        self.launch_ring = np.zeros((self.L, S, P), dtype=np.int32)
        self.pending = np.zeros((S, P), dtype=np.int32)  # booting
        self.ring_ptr = 0

    def activate(self) -> None:
        """Replicas launched `delay` ticks ago become ready (the start of a tick)."""
        if self.delayed:
            due = np.maximum(self.launch_ring[self.ring_ptr] - self.activated, 0)
            self.activated += due
            self.active += due

    def reconcile(self, target: np.ndarray) -> None:
        """Launch towards `target` [S, P], or cancel booting replicas newest first and then
        remove ready ones."""
        pending = self.launched - self.activated
        gap = target - (self.active + pending)
        shrink = np.maximum(-gap, 0)
        if self.delayed:
            cancel = np.minimum(shrink, pending)  # newest pending first
            self.launched += np.maximum(gap, 0) - cancel
            if cancel.any():
                np.minimum(self.launch_ring, self.launched, out=self.launch_ring)
            self.launch_ring[self.ring_ptr] = self.launched
            self.ring_ptr = (self.ring_ptr + 1) % self.L
            self.pending = self.launched - self.activated
            shrink -= cancel
        else:
            self.active += np.maximum(gap, 0)
        # Removal beyond the pending replicas takes ready ones, down to the floor.
        self.active = np.maximum(self.active - shrink, np.minimum(self.active, self.min_servers))

    def ready_within(self, ticks: int) -> np.ndarray:
        """[S, P] booting replicas that are ready within the next `ticks` ticks."""
        slot = self.launch_ring[(self.ring_ptr + max(1, ticks) - 1) % self.L]
        return np.clip(slot - self.activated, 0, None)


class PoolsView:
    """What both simulators expose of their pools: `active` (ready) and `pending` (booting)
    replicas [S, P] from `self.prov`, and the action check against their S, D, n."""

    prov: Provisioning

    @property
    def active(self) -> np.ndarray:
        return self.prov.active

    @property
    def pending(self) -> np.ndarray:
        return self.prov.pending

    def check_actions(self, actions) -> np.ndarray:
        return check_actions(actions, self.S, self.D, self.n, self.cfg.branch_names)


def check_layout(cfg, split: str, phases: Optional[str], eval_replicas: int) -> str:
    """Validate the split / phases / copies of a simulator; returns the phases in force."""
    if split not in ("train", "val", "eval"):
        raise ValueError(f"split must be 'train', 'val' or 'eval', got {split!r}")
    phases = phases if phases is not None else ("random" if split == "train" else "even")
    if phases not in ("random", "even"):
        raise ValueError(f"phases must be 'random' or 'even', got {phases!r}")
    if phases == "random" and eval_replicas != 1:
        raise ValueError(f"eval_replicas={eval_replicas!r} needs evenly spaced phases (phases='even')")
    if not (isinstance(eval_replicas, int) and eval_replicas >= 1 and cfg.num_shards % eval_replicas == 0):
        raise ValueError(f"eval_replicas must be an int >= 1 dividing num_shards={cfg.num_shards}, "
                         f"got {eval_replicas!r}")
    return phases


def check_actions(actions, S: int, D: int, n: int, branch_names) -> np.ndarray:
    """Integer actions [S, D] in [0, n), or ActionError naming the shard, branch and value."""
    a = np.asarray(actions)
    if a.shape != (S, D):
        raise ActionError(f"actions must have shape [S={S}, D={D}] (branches {branch_names}), got {a.shape}")
    if a.dtype.kind not in "iu":
        if a.dtype.kind != "f" or not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise ActionError(f"actions must be integers in [0, {n - 1}], got dtype {a.dtype} "
                              f"with values like {a.reshape(-1)[:4].tolist()}")
        a = a.astype(np.int64)
    if (a.view(np.uint64 if a.itemsize == 8 else f"u{a.itemsize}") >= n).any():  # < 0 wraps high
        bad = np.argwhere((a < 0) | (a >= n))[0]
        raise ActionError(f"action out of range: shard {bad[0]} branch {branch_names[bad[1]]!r} = "
                          f"{a[bad[0], bad[1]]}, valid choices are 0..{n - 1}")
    return a


def serve_tick(sim, c: np.ndarray, mu: np.ndarray, lam: np.ndarray, arrivals: np.ndarray, adm_slo: np.ndarray):
    """One tick of the per-class M/M/c queues: c [S, K] servers at rate mu ([K] or [S, K]),
    true rate lam, `arrivals` this tick, admission limit `adm_slo` [S, K] seconds of backlog.
    Sets sim.backlog; returns (served, refused, backlog, p99, late share, theta, 1/rate).
    Latency: service + Erlang-C p99 wait at the true rate + backlog drain time."""
    dt = sim.dt
    rate = c * mu  # [S, K] requests per second
    rate_pos = np.maximum(rate, 1e-9)  # a class with no servers: limits and drain times still defined
    # Queues: fluid backlog beyond what capacity serves; admission refuses its excess.
    avail = sim.backlog + arrivals
    served = np.minimum(avail, rate * dt)
    q = avail - served
    drops = np.maximum(q - rate_pos * adm_slo, 0.0)
    sim.backlog = backlog = q - drops
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv_rate = 1.0 / rate_pos
        pw = sim.erlang(c, lam * inv_rate)  # [S, K] P(wait)
        theta = rate - lam
        w99 = np.maximum(np.log(pw * (1.0 / P99_Q)) / np.maximum(theta, 1e-9), 0.0)
        drain = backlog * inv_rate
        svc = 1.0 / mu
        p99 = np.minimum(svc + w99 + drain, sim.lat_cap)
        budget = sim.slo - svc - drain
        late = np.where(budget > 0, np.minimum(pw * np.exp(-theta * budget), 1.0), 1.0)
    return served, drops, backlog, p99, late, theta, inv_rate
