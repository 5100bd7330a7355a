"""Platform v2: S shards x K request classes, one capacity pool per class, vectorised in numpy.

Each class runs in its own pool of replicas, as Kubernetes runs one Deployment (and one HPA)
per service. Per tick and shard:
  1. replicas whose provisioning delay has passed become ready;
  2. the action, per class: `capacity_k` picks a plan factor f and the class's plan is the
     replicas the queueing model needs for the SLO at f x its monitored request rate
     (`apex_bdq.sizing.replicas_for`, the one sizing function); `hold_k` picks a scale-down
     hold h and the class's target is the highest plan of the last h seconds (in 15-s
     blocks). New replicas enter a `delay` pipeline; removals cancel the newest booting
     replicas first, then take ready ones. `admission` sets the backlog limit (level 0
     admits everything). A rule may set every pool's replicas directly instead;
  3. arrivals ~ Poisson(rate(t) x tick) from the trace, each shard at its own phase;
  4. per class an M/M/c queue on its ready replicas (stationary Erlang-C wait, a fluid backlog
     for overload, admission refusals beyond the limit);
  5. p99 latency = service + Erlang-C p99 wait + backlog drain time; a request is late when
     it waits past its SLO's budget; a refused request counts as late (no policy buys SLO
     compliance by refusing work);
  6. every ready or booting replica is billed for the tick (per-second cloud billing);
     reward = revenue of served work - replica cost - refusal penalty - SLO credit, the last
     settled once per accounting window (a class whose window broke its SLO pays back the
     value of the work offered to it in that window);
  7. monitoring: per class the requests in flight (in service + queued: the concurrency
     Knative's autoscaler and KEDA's HTTP add-on scale on) and the utilisation, averaged over
     the metrics resolution and read `lag` ticks late; per-class arrival history in coarse
     blocks; the trace's rate a day and a week ago at a few leads (what a metrics store
     holds); micro features per class and tick are immediate.

The plan of a capacity tier sizes for the monitored concurrency: at the stationary point it
is the offered load (Erlangs), and under overload its queue part makes the plan grow.

The observation and info layout matches v1's interface (`Observation`, the info keys the
trainer, evaluation and preference code read); feature names are in `macro_names(cfg)` and
`MICRO_FEATURES_V2`.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.features import Scales, macro_v2, micro_frame_v2
from apex_bdq.sim.platform import Observation, make_rates
from apex_bdq.sim.provisioning import (P99_Q, ActionError, CapacityBounds, PoolsView, Provisioning, check_layout,
                                       serve_tick)
from apex_bdq.sim.queueing import ErlangCTable
from apex_bdq.sim.trace import TickRates
from apex_bdq.sizing import HoldWindow, SizingTable, replicas_for

MACRO_GLOBAL_V2 = ("tod_sin", "tod_cos", "tow_sin", "tow_cos", "window_phase", "admission_level",
                   "history_1d_ok", "history_7d_ok")
MACRO_CLASS_V2 = ("in_flight", "utilisation", "ready", "booting", "booting_soon", "target", "plan_level",
                  "hold_level", "last_window_violated")
MICRO_FEATURES_V2 = ("arrivals", "backlog", "p99_over_slo", "refused", "ready", "booting", "slo_budget_burn")
MONITORED_V2 = ("load", "rate", "utilisation")
HOLD_BLOCK_S = 15.0  # the HPA sync period: holds and rules work in blocks of it
DAY_S, WEEK_S = 86400.0, 7 * 86400.0


def macro_names(cfg: SimConfig) -> tuple[str, ...]:
    """Names of the v2 macro features in order: global ones, then per class k its state,
    its coarse history (oldest first) and its seasonal rates."""
    per = list(MACRO_CLASS_V2) + [f"rate_block_{j}" for j in range(cfg.coarse_history)]
    per += [f"rate_1d_plus_{int(s)}s" for s in cfg.seasonal_leads_s]
    per += [f"rate_7d_plus_{int(s)}s" for s in cfg.seasonal_leads_s]
    return MACRO_GLOBAL_V2 + tuple(f"{name}[{k}]" for k in range(cfg.num_classes) for name in per)


def pool_caps(cfg: SimConfig, rates: TickRates) -> np.ndarray:
    """[K] replicas each pool may hold: pool_cap_factor x the class's peak offered load over
    the whole trace, plus the floor (no burst of the trace is unservable by construction)."""
    peak = rates.peak * np.asarray(cfg.service_time_s)  # [K] Erlangs
    return np.ceil(cfg.pool_cap_factor * peak).astype(np.int64) + max(1, cfg.min_servers)


@functools.lru_cache(maxsize=16)
def _sizing_table(svc: tuple, slo: tuple, caps: tuple, min_servers: int) -> SizingTable:
    return SizingTable.build(svc, slo, caps, min_servers, P99_Q)


def default_action_v2(cfg: SimConfig) -> tuple[int, ...]:
    """The platform's default setting: the middle plan factor, HPA's default 300-s hold (the
    longest hold choice), admit everything."""
    K, n = cfg.num_classes, cfg.sub_actions
    return tuple([n // 2] * K + [int(np.argmax(cfg.hold_s))] * K + [0])


class PlatformSimV2(PoolsView):
    """Vectorised platform v2; see the module docstring for the dynamics.

    split, phases, eval_replicas, copy_obs: as PlatformSim (v1). With phases="random" an
    episode starts at a random tick of the split that leaves room for a whole episode; with
    phases="even" shard i starts at its phase minus `warmup_ticks` (earlier ticks of the
    trace: state warms up on real history, the evaluation does not count them).
    arrival_groups: G > 1 splits the shards into G equal consecutive groups that meet the same
    Poisson arrivals shard for shard (common random numbers: settings of a rule swept side by
    side in one run differ by their decisions only).
    """

    def __init__(self, cfg: SimConfig = SimConfig(), split: str = "train",
                 rates: Optional[TickRates] = None, copy_obs: bool = True, eval_replicas: int = 1,
                 phases: Optional[str] = None, warmup_ticks: int = 0, arrival_groups: int = 1) -> None:
        if cfg.platform != "v2":
            raise ValueError(f"PlatformSimV2 needs sim.platform='v2', got {cfg.platform!r}")
        phases = check_layout(cfg, split, phases, eval_replicas)
        if not (isinstance(warmup_ticks, int) and warmup_ticks >= 0):
            raise ValueError(f"warmup_ticks must be an int >= 0, got {warmup_ticks!r}")
        if not (isinstance(arrival_groups, int) and arrival_groups >= 1 and cfg.num_shards % arrival_groups == 0):
            raise ValueError(f"arrival_groups must be an int >= 1 dividing num_shards={cfg.num_shards}, "
                             f"got {arrival_groups!r}")
        if arrival_groups > 1 and (phases != "even" or eval_replicas % arrival_groups):
            raise ValueError("arrival_groups needs evenly spaced phases with eval_replicas a multiple of it "
                             "(each group then covers the same ticks)")
        self.arrival_groups = arrival_groups
        self.observe = True  # False: step returns no observation (a rule that reads none: evaluation only)
        self.cfg, self.split, self.phases, self.copy_obs = cfg, split, phases, copy_obs
        self.eval_replicas, self.warmup_ticks = eval_replicas, warmup_ticks
        self.rates = rates if rates is not None else make_rates(cfg)
        if self.rates.rates.shape[1] != cfg.num_classes:
            raise ValueError(f"rates have {self.rates.rates.shape[1]} classes, config has {cfg.num_classes}")
        S, K, H, n = cfg.num_shards, cfg.num_classes, cfg.history, cfg.sub_actions
        self.S, self.K, self.H, self.n, self.P, self.D = S, K, H, n, K, cfg.num_branches
        self.dt = dt = cfg.tick_s
        self.range = self.rates.split_range(split)
        self.range_len = self.range[1] - self.range[0]
        if phases == "random" and self.range_len <= cfg.episode_ticks:
            raise ValueError(f"the {split!r} range ({self.range_len} ticks) is not longer than one episode "
                             f"({cfg.episode_ticks} ticks)")
        f32 = np.float32
        svc = np.asarray(cfg.service_time_s, dtype=np.float64)
        sc = self.scales = Scales(cfg)  # the observation's normalisers (apex_bdq.features)
        self.mu, self.slo, self.inv_slo = sc.mu, sc.slo, sc.inv_slo  # [K] per second per replica; p99 target, s
        self.inv_mu = svc.astype(f32)  # [K] replica-seconds of work per request
        self.lat_cap = (cfg.latency_cap_factor * self.slo).astype(f32)
        self.mean_load = cfg.mean_load_erlangs
        self.class_load, self.inv_class_load = sc.class_load, sc.inv_class_load  # [K] Erlangs
        self.class_rate, self.inv_class_rate = sc.class_rate, sc.inv_class_rate  # [K] mean requests per second
        self.lam_table = self.rates.rates.astype(f32, copy=False)  # [T, K], shared by every simulator of the trace
        self.tod_table, self.tow_table = self.rates.time_of_day, self.rates.time_of_week
        self.caps = pool_caps(cfg, self.rates)  # [K]
        # Mixed training traces (sim.augment.traces): one table of every trace's days up to the
        # end of its training range, and per trace (first tick, training range) in that table.
        self.mix_segments = np.array([[0, *self.range]], dtype=np.int64)  # [M, 3]
        self.mix_base: np.ndarray | int = 0  # [S] first tick of each shard's trace in the table
        if self.mixing:
            self._build_mix()
        self.pool_max = self.caps  # [K] (v1 has one int)
        self.sizing = _sizing_table(tuple(svc), tuple(self.slo.astype(np.float64)), tuple(self.caps.tolist()),
                                    cfg.min_servers)
        self.erlang = ErlangCTable(int(self.caps.max()))
        self.onesK = np.ones(K, dtype=f32)
        self.plan = np.asarray(cfg.plan_factors, dtype=np.float64)  # [n]
        self.hold_block = max(1, int(round(HOLD_BLOCK_S / dt)))
        self.hold_blocks = np.array([math.ceil(h / (self.hold_block * dt) - 1e-9) for h in cfg.hold_s],
                                    dtype=np.int64)  # [n] closed blocks a hold reaches back
        adm = np.array([1e30] + [2.0 ** (n - 2 - lvl) for lvl in range(n - 1)])  # [n] SLOs of backlog
        self.adm_slo = (adm[:, None] * self.slo[None, :]).astype(f32)  # [n, K] seconds
        self.L = max(1, cfg.delay_ticks)
        self.soon = max(1, self.L // 2)  # "booting_soon": ready within half the delay
        self.lag = cfg.lag_ticks
        self.mon_alpha = np.float32(1.0 / max(1, self.lag))
        self.W = cfg.window_ticks
        self.cb = max(1, int(round(cfg.coarse_block_s / dt)))  # ticks per coarse history block
        self.Hc = cfg.coarse_history
        self.day = int(round(DAY_S / dt))
        self.week = int(round(WEEK_S / dt))
        self.leads = np.array([int(round(s / dt)) for s in cfg.seasonal_leads_s], dtype=np.int64)
        self.macro_names = macro_names(cfg)
        self.rng = np.random.default_rng(cfg.seed)
        self.reset(seed=cfg.seed)

    # ---------------------------------------------------------------------------------
    def reset(self, seed: Optional[int] = None) -> Observation:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        S, K, H, cfg = self.S, self.K, self.H, self.cfg
        f32 = np.float32
        lo = self.range[0]
        self.aug_warp = self.aug_mult = self.aug_scale = None
        if self.phases == "random" and self.augmenting:
            self._draw_augmentation()
        elif self.phases == "random":
            self.offset = lo + self.rng.integers(0, self.range_len - cfg.episode_ticks, size=S)
        else:
            phases = S // self.eval_replicas
            # Warm-up reads the ticks before each phase; at the trace's first tick it is cut short.
            self.offset = np.maximum(lo + ((np.arange(S) % phases) * self.range_len) // phases - self.warmup_ticks, 0)
        self.t = 0
        self.raised = self.lowered = None  # [S, K] pools the last capacity_bounds moved
        lam = self.lam_table[self.offset].astype(f32)  # [S, K] requests per second
        if self.aug_scale is not None:
            lam *= self.aug_mult[:, :1]
        d = default_action_v2(cfg)
        self.target = replicas_for(lam * self.plan[d[0]], self.sizing).astype(np.int32)  # [S, K]
        self.prov = Provisioning(self.target.copy(), cfg.delay_ticks, cfg.min_servers)
        self.level = np.empty((S, self.D), dtype=np.int64)  # the sub-actions in force
        self.level[:] = d
        self.hold = HoldWindow(self.target, self.hold_blocks, self.hold_block)
        load = lam * self.inv_mu
        self.load_est = (load + 1e-6).astype(f32)  # requests in service per class
        self.backlog = np.zeros((S, K), dtype=f32)
        self.win_req = np.zeros((S, K), dtype=f32)
        self.win_late = np.zeros((S, K), dtype=f32)
        self.win_work = np.zeros((S, K), dtype=f32)
        self.last_violated = np.zeros((S, K), dtype=f32)
        fu = len(MICRO_FEATURES_V2)
        self.micro_buf = np.zeros((S, K, 2 * H, fu), dtype=f32)
        self.frame = np.zeros((S, K, fu), dtype=f32)
        as_item = np.dtype((np.void, 4 * fu))
        self.micro_items = self.micro_buf.view(as_item)[..., 0]
        self.frame_items = self.frame.view(as_item)[..., 0]
        self.hist_ptr = 0
        # Monitored per-class concurrency (Erlangs) and utilisation, read `lag` ticks late.
        self.mon_load = np.repeat(load[None].astype(f32), self.lag + 1, axis=0)  # [lag+1, S, K]
        self.mon_util = np.empty((self.lag + 1, S, K), dtype=f32)
        self.mon_util[:] = np.minimum(load / np.maximum(self.active, 1), 1.0)
        self.mon_ptr = 0
        # Coarse history: block means of the observed arrival rate, oldest first, seeded from
        # the trace before the episode (a platform has history when an episode starts).
        j = np.arange(self.Hc, 0, -1)[:, None] * self.cb - self.cb // 2  # [Hc, 1] ticks back
        back = np.maximum(self.offset[None, :] - j, self.mix_base)  # [Hc, S], within the shard's own trace
        self.coarse = self.lam_table[back].astype(f32)  # [Hc, S, K]
        if self.aug_scale is not None:
            self.coarse *= self.aug_scale[None, :, None]
        self.coarse_acc = np.zeros((S, K), dtype=f32)
        self.coarse_ptr = 0
        return self._observe()

    def _build_mix(self) -> None:
        """The table of mixed training traces: this run's trace whole (its validation and
        held-out days are never drawn: episodes start in its training range), then each
        extra trace up to the end of its training range; pools sized for every trace's peak."""
        import dataclasses as dc
        tables, tods, tows, segs = [self.lam_table], [self.tod_table], [self.tow_table], [[0, *self.range]]
        base = len(self.lam_table)
        for path in self.cfg.augment.traces:
            r = make_rates(self.cfg.replace(trace=dc.replace(self.cfg.trace, path=path, columns=None, smooth_s=None)))
            if r.rates.shape[1] != self.K:
                raise ValueError(f"sim.augment.traces: {path} gives {r.rates.shape[1]} classes, the run has {self.K}")
            lo, hi = r.split_range("train")
            tables.append(r.rates[:hi].astype(np.float32, copy=False))
            tods.append(r.time_of_day[:hi])
            tows.append(r.time_of_week[:hi] if r.time_of_week is not None else np.zeros(hi, dtype=np.float32))
            segs.append([base, base + lo, base + hi])
            self.caps = np.maximum(self.caps, pool_caps(self.cfg, r))  # the sizing table is built from these
            base += hi
        self.lam_table = np.concatenate(tables)
        self.tod_table, self.tow_table = np.concatenate(tods), np.concatenate(tows)
        self.mix_segments = np.array(segs, dtype=np.int64)

    @property
    def mixing(self) -> bool:
        """Whether training episodes draw among several traces (sim.augment.traces)."""
        return bool(self.cfg.augment.traces) and self.split == "train" and self.phases == "random"

    # ---------------------------------------------------------------------------------
    def _draw_augmentation(self) -> None:
        """Training episodes with `sim.augment` on: per shard a rate scale, a time warp and
        flash-crowd bursts for this episode (from the simulator's own generator, so one seed
        draws the same shapes), and a start that leaves room for the warped episode."""
        aug, S, E, rng = self.cfg.augment, self.S, self.cfg.episode_ticks, self.rng

        def log_uniform(lo_hi):
            lo, hi = np.log(lo_hi[0]), np.log(lo_hi[1])
            return np.exp(rng.uniform(lo, hi, size=S))

        scale = log_uniform(aug.scale).astype(np.float32) if aug.enabled else None
        warp = log_uniform(aug.time_warp) if aug.enabled else np.ones(S)
        span = np.ceil(E * warp).astype(np.int64) + 1  # trace ticks the episode reads
        seg = self.mix_segments[rng.integers(0, len(self.mix_segments), size=S)] if self.mixing \
            else self.mix_segments[np.zeros(S, dtype=np.int64)]  # [S, 3]: table base, training range
        room = seg[:, 2] - seg[:, 1]
        if (span >= room).any():
            raise ValueError(f"sim.augment.time_warp up to {aug.time_warp[1]} needs {int(span.max())} ticks of the "
                             f"training range per episode; it has {int(room[span >= room].min())}")
        self.offset = seg[:, 1] + (rng.random(S) * (room - span)).astype(np.int64)
        self.mix_base = seg[:, 0] if self.mixing else 0
        if not aug.enabled:  # mixed traces only: each replayed as it is (no per-tick reshaping)
            return
        self.aug_scale, self.aug_warp = scale, warp
        mult = np.ones((S, E + 1), dtype=np.float32)
        t = np.arange(E + 1, dtype=np.float64)
        n = rng.poisson(aug.bursts_per_hour * E * self.dt / 3600.0, size=S)
        for i in np.nonzero(n)[0]:
            for _ in range(int(n[i])):
                length = rng.uniform(*aug.burst_s) / self.dt
                start = rng.uniform(-0.5 * length, E)  # a burst may already be under way
                x = (t - start) / length
                inside = (x > 0) & (x < 1)
                mult[i, inside] += rng.uniform(*aug.burst_height) * np.sin(np.pi * x[inside]).astype(np.float32)
        self.aug_mult = mult * self.aug_scale[:, None]  # [S, E + 1]

    @property
    def augmenting(self) -> bool:
        """Whether episodes reshape or mix traces: training days, random phases, augment on."""
        return self.cfg.augment.active and self.split == "train" and self.phases == "random"

    def trace_index(self) -> np.ndarray:
        """[S] trace tick of each shard now."""
        if self.aug_warp is not None:
            return self.offset + (self.t * self.aug_warp).astype(np.int64)
        if self.phases == "random":
            return self.offset + self.t
        return np.minimum(self.offset + self.t, self.range[1] - 1)

    def plan_for(self, rate: np.ndarray, plan_level: np.ndarray) -> np.ndarray:
        """[S, K] replicas the capacity branch asks for: the SLO sizing of plan x rate."""
        return replicas_for(rate * self.plan[plan_level], self.sizing)

    # ---------------------------------------------------------------------------------
    def _pools(self, x, name: str) -> np.ndarray:
        a = np.asarray(x)
        if a.shape != (self.S, self.K) or a.dtype.kind not in "iu":
            raise ActionError(f"{name} must be integers of shape [S={self.S}, K={self.K}], got {a.dtype} {a.shape}")
        return a

    def step(self, actions, capacity_target=None, capacity_bounds: Optional[CapacityBounds] = None):
        """Advance one tick. actions: int [S, D]; capacity_target: optional int [S, K] that
        replaces the capacity and hold branches (how rules set replicas directly);
        capacity_bounds: optional `CapacityBounds(lo, hi)` that keeps the branches' target
        within [lo, hi] per pool (how the guard bounds a learned decision by a rule's; the
        scale-down hold keeps the branches' own plans). Returns (obs, reward [S] float64,
        truncated, info); `self.raised` / `self.lowered` [S, K] say which pools the bounds moved."""
        a = self.check_actions(actions)
        cfg, S, K, dt = self.cfg, self.S, self.K, self.dt
        # Every input checked before any state moves.
        lo = hi = None
        if capacity_target is not None:
            if capacity_bounds is not None:
                raise ActionError("capacity_target replaces the branches: it takes no capacity_bounds")
            capacity_target = self._pools(capacity_target, "capacity_target")
        elif capacity_bounds is not None:
            lo, hi = capacity_bounds
            lo = None if lo is None else self._pools(lo, "capacity_bounds.lo")
            hi = None if hi is None else self._pools(hi, "capacity_bounds.hi")
        self.raised = self.lowered = None

        # 1. provisioning: replicas launched `delay` ticks ago become ready.
        self.prov.activate()

        # 2. targets per class.
        self.level[:] = a
        mon_load = self.mon_load[(self.mon_ptr - self.lag) % (self.lag + 1)]  # [S, K] Erlangs, lagged
        if capacity_target is not None:
            want = capacity_target
        else:
            plan = self.plan_for(mon_load * self.mu, a[:, :K]).astype(np.int32)  # [S, K]
            want = self.hold.target(plan, a[:, K:2 * K])
        self.hold.step()
        self.target = np.clip(want, cfg.min_servers, self.caps).astype(np.int32)
        if lo is not None or hi is not None:
            free = self.target  # the branches' own target; the bounds move it, then the pool's limits
            bounded = want if lo is None else np.maximum(want, lo)
            bounded = bounded if hi is None else np.minimum(bounded, hi)
            self.target = np.clip(bounded, cfg.min_servers, self.caps).astype(np.int32)
            self.raised, self.lowered = self.target > free, self.target < free
        self.prov.reconcile(self.target)

        # 3. arrivals.
        lam = self.lam_table[self.trace_index()]  # [S, K] per second
        if self.aug_mult is not None:
            lam = lam * self.aug_mult[:, min(self.t, self.aug_mult.shape[1] - 1), None]
        mean_n = lam * dt
        if not cfg.trace.poisson_noise:
            arrivals = mean_n.copy()
        elif self.arrival_groups > 1:
            arrivals = np.tile(self.rng.poisson(mean_n[:S // self.arrival_groups]).astype(np.float32),
                               (self.arrival_groups, 1))
        else:
            arrivals = self.rng.poisson(mean_n).astype(np.float32)

        # 4-5. queues and latency on the ready replicas.
        c = self.active.astype(np.float32)
        served, drops, backlog, p99, late, theta, inv_rate = serve_tick(
            self, c, self.mu, lam, arrivals, self.adm_slo[a[:, -1]])

        # 6. accounting (normalised by the mean load, so rewards are O(1) at any scale).
        ones = self.onesK
        mus_dt = self.mu * dt
        alpha = np.minimum(mus_dt, 1.0)
        admitted = np.maximum(arrivals - drops, 0.0)
        self.load_est += alpha * (admitted / mus_dt - self.load_est)
        busy_k = np.minimum(self.load_est, c)  # [S, K] busy replicas
        busy = (busy_k @ ones).astype(np.float64) * dt
        work_s = ((served * self.inv_mu) @ ones).astype(np.float64)
        ready = self.active.sum(1)
        booting = self.pending.sum(1)
        cost = (ready + booting).astype(np.float64) * dt  # replica-seconds billed
        revenue = cfg.revenue_per_work * work_s
        drop_pen = cfg.drop_penalty * ((drops * self.inv_mu) @ ones)
        self.win_req += arrivals
        late_req = late * admitted + drops  # refused requests count as late
        self.win_late += late_req
        self.win_work += arrivals * self.inv_mu
        self.t += 1
        norm = self.mean_load * dt
        violated = None
        if self.t % self.W == 0:
            violated = self.win_late > P99_Q * self.win_req  # [S, K]
            slo_pen = cfg.slo_credit * cfg.revenue_per_work * ((violated * self.win_work) @ ones)
            self.last_violated = violated.astype(np.float32)
            for acc in (self.win_req, self.win_late, self.win_work):
                acc[...] = 0.0
            reward = (revenue - cost - drop_pen - slo_pen) / norm
        else:
            slo_pen = np.zeros(S)
            reward = (revenue - cost - drop_pen) / norm

        # 7. monitoring, coarse history, micro history.
        util_k = busy_k / np.maximum(c, 1.0)
        prev_l = self.mon_load[self.mon_ptr]
        prev_u = self.mon_util[self.mon_ptr]
        self.mon_ptr = (self.mon_ptr + 1) % (self.lag + 1)
        am = self.mon_alpha
        self.mon_load[self.mon_ptr] = prev_l + am * (self.load_est + backlog - prev_l)  # in flight
        self.mon_util[self.mon_ptr] = prev_u + am * (util_k - prev_u)
        self.coarse_acc += arrivals
        if self.t % self.cb == 0:
            self.coarse[self.coarse_ptr] = self.coarse_acc * (1.0 / (self.cb * dt))
            self.coarse_ptr = (self.coarse_ptr + 1) % self.Hc
            self.coarse_acc[:] = 0.0
        self.hist_ptr = h = (self.hist_ptr + 1) % self.H
        micro_frame_v2(self.frame, self.scales, arrivals=arrivals, backlog=backlog, p99_s=p99, refused=drops, ready=c,
                       booting=self.pending, win_late=self.win_late, win_req=self.win_req, inv_rate=inv_rate)
        self.micro_items[:, :, h] = self.frame_items
        self.micro_items[:, :, h + self.H] = self.frame_items

        x = (1.0 - drops / np.maximum(arrivals, 1.0)) * np.minimum(self.slo / p99, 1.0)
        offered_k = lam * self.inv_mu
        info = {
            "served": revenue / norm, "cost": cost / norm, "slo_penalty": slo_pen / norm,
            "drop_penalty": drop_pen / norm,
            "overload": (((backlog > 0) | (theta <= 0)) @ ones) > 0,
            "fairness": (x @ ones) ** 2 / (K * np.maximum((x * x) @ ones, 1e-12)),
            "slo_violation": ((p99 > self.slo) @ ones) > 0,
            "window_violated": violated,
            "late_requests": late_req,
            "p99_s": p99, "utilisation": busy / np.maximum(ready * dt, 1e-9), "servers": ready, "pending": booting,
            "arrivals": arrivals, "served_requests": served, "dropped": drops, "backlog": backlog,
            "offered_erlangs": offered_k @ ones, "busy": busy / norm,
            "servers_k": self.active, "target_k": self.target,
        }
        truncated = self.t >= cfg.episode_ticks
        return (self._observe() if self.observe else None), reward, truncated, info

    # ---------------------------------------------------------------------------------
    def seasonal(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The trace's rate a day and a week before `idx` at each lead: ([S, J, K], [S, J, K],
        day available [S], week available [S]); zeros where the trace does not reach back."""
        day_i = idx[:, None] - self.day + self.leads[None, :]  # [S, J]
        week_i = idx[:, None] - self.week + self.leads[None, :]
        ok_d = idx - self.mix_base >= self.day  # within the shard's own trace
        ok_w = idx - self.mix_base >= self.week
        d = self.lam_table[np.maximum(day_i, 0)] * ok_d[:, None, None]
        w = self.lam_table[np.maximum(week_i, 0)] * ok_w[:, None, None]
        if self.aug_scale is not None:  # history at the episode's level (its bursts are new)
            d, w = d * self.aug_scale[:, None, None], w * self.aug_scale[:, None, None]
        return d, w, ok_d, ok_w

    def _observe(self) -> Observation:
        S, K = self.S, self.K
        idx = self.trace_index()
        per = len(MACRO_CLASS_V2) + self.Hc + 2 * len(self.leads)
        macro = np.empty((S, len(MACRO_GLOBAL_V2) + K * per), dtype=np.float32)
        cls = np.empty((S, K, per), dtype=np.float32)
        d, w, ok_d, ok_w = self.seasonal(idx)
        lagged = (self.mon_ptr - self.lag) % (self.lag + 1)
        order = (self.coarse_ptr + np.arange(self.Hc)) % self.Hc  # oldest first
        macro_v2(macro, cls, self.scales, tod=self.tod_table[idx], tow=self.tow_table[idx],
                 window_phase=(self.t % self.W) / self.W, admission_level=self.level[:, -1], ok_1d=ok_d, ok_7d=ok_w,
                 in_flight=self.mon_load[lagged], utilisation=self.mon_util[lagged], ready=self.active,
                 booting=self.pending, booting_soon=self.prov.ready_within(self.soon), target=self.target,
                 plan_level=self.level[:, :K], hold_level=self.level[:, K:2 * K], last_violated=self.last_violated,
                 rate_blocks=self.coarse[order], rate_1d=d, rate_7d=w)
        p = self.hist_ptr + 1
        micro = self.micro_buf[:, :, p:p + self.H]
        return Observation(macro=macro, micro=micro.copy() if self.copy_obs else micro)

    def monitored(self) -> dict:
        """What a metrics system reports per class, each [S, K] and `lag` ticks late: "load",
        requests in flight (Erlangs at the stationary point); "rate", the request rate that
        load implies (load / service time); "utilisation" of the class's ready replicas."""
        lagged = (self.mon_ptr - self.lag) % (self.lag + 1)
        load = self.mon_load[lagged]
        return {"load": load, "rate": load * self.mu, "utilisation": self.mon_util[lagged]}
