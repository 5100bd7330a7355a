"""PlatformSim: S platform shards x K request classes, vectorised in numpy.

Per tick and shard (DESIGN.md, "The learning problem"):
  1. servers whose provisioning delay has passed become active;
  2. the action sets the capacity tier (target = monitored demand x headroom; new servers
     enter a `delay` pipeline, removals cancel the newest pending servers first, then remove
     active ones), the priority tilt, the admission level and the service-speed
     (scheduling) level;
  3. active servers are split between classes by the servers each needs (requests in
     service, an M/M/inf estimate from admitted arrivals, plus what drains its queue
     within one SLO; never less than that need averaged over a window) x priority weight;
  4. arrivals ~ Poisson(rate(t) * tick) from the trace, per shard with its own phase;
  5. per class an M/M/c queue: the stationary wait from Erlang C, a fluid backlog for
     overload, admission drops when the backlog exceeds the admission limit;
  6. p99 latency = service time + Erlang-C p99 wait + backlog drain time;
  7. reward = revenue of served work - power cost - drop penalty - SLO credit, the last
     settled once per accounting window (delayed, sparse): a class whose SLO broke in the
     window pays back the value of all the work offered to it in that window;
  8. macro observations are averaged over the monitoring resolution and read through a
     monitoring lag (metrics-server style); micro ones are immediate.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.sim.provisioning import P99_Q, ActionError, PoolsView, Provisioning, check_layout, serve_tick  # noqa: F401
from apex_bdq.sim.queueing import ErlangCTable
from apex_bdq.sim.trace import TickRates, bundled_trace, default_smooth_s, load_trace, make_tick_rates, smooth_trace

# Feature layout of the observations (names are part of the interface, for plots and tests).
MACRO_MONITORED = ("load", "utilisation", "window_utilisation", "window_cost", "window_slo_violation",
                   "window_drop", "backlog")
MACRO_CONTROL = ("tod_sin", "tod_cos", "active", "pending", "target", "priority_level",
                 "admission_level", "speed_level", "window_phase")
MACRO_FEATURES = MACRO_MONITORED + MACRO_CONTROL
MICRO_FEATURES = ("arrivals", "backlog", "p99_over_slo", "drops", "servers", "slo_budget_burn")


@dataclass(frozen=True)
class Observation:
    macro: np.ndarray  # [S, Fm] float32
    micro: np.ndarray  # [S, K, H, Fu] float32


@functools.lru_cache(maxsize=8)
def _cached_rates(cfg_key: tuple) -> TickRates:
    (path, _stamp, columns, interval_s, smooth_s, tick_s, k, svc, share, load, eval_frac, val_frac) = cfg_key
    tr = smooth_trace(load_trace(path, columns, interval_s), smooth_s)
    return make_tick_rates(tr, tick_s, k, svc, share, load, eval_frac, val_frac)


def make_rates(cfg: SimConfig) -> TickRates:
    """The trace of `cfg` (the platform's bundled one by default), resampled and normalised
    (cached per process and file version)."""
    t = cfg.trace
    default_path, default_columns = bundled_trace(cfg.platform)
    path = str(t.path or default_path)
    columns = t.columns if t.columns is not None else (default_columns if t.path is None else None)
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        stamp = None  # load_trace reports the missing file
    smooth = t.smooth_s if t.smooth_s is not None else default_smooth_s(path)
    return _cached_rates((path, stamp, columns, t.interval_s, smooth, cfg.tick_s, cfg.num_classes,
                          cfg.service_time_s, cfg.shares, cfg.mean_load_erlangs, t.eval_fraction,
                          t.validation_fraction))


class PlatformSim(PoolsView):
    """Vectorised simulator; see the module docstring for the dynamics.

    split: "train" (the training range), "val" (the validation range, when
    trace.validation_fraction > 0) or "eval" (the held-out range).
    phases: "random" (a random phase per shard at reset: how the trainer explores) or "even"
    (phases evenly spaced over the range, so S shards x range/S ticks cover it once: how a
    policy is evaluated). Default: random on "train", even on "eval".
    eval_replicas: with even phases, R copies of S/R evenly spaced phases (shard i starts at
    phase i mod S/R): the range is covered R times, each with its own arrivals.
    copy_obs: True returns fresh observation arrays; False returns the micro history as a
    view into the simulator's ring buffer, valid until the next `step` (the zero-copy path
    a trainer uses when it copies observations into replay itself, like gymnasium's
    `copy=False`).
    Per-class arrays are float32 (half the memory traffic of float64 on the hot path);
    server counts are integers.
    """

    def __init__(self, cfg: SimConfig = SimConfig(platform="v1"), split: str = "train",
                 rates: Optional[TickRates] = None, copy_obs: bool = True, eval_replicas: int = 1,
                 phases: Optional[str] = None) -> None:
        if cfg.platform != "v1":
            raise ValueError(f"PlatformSim is platform v1 (sim.platform={cfg.platform!r}): build the simulator "
                             f"with apex_bdq.sim.make_sim(cfg)")
        self.phases = check_layout(cfg, split, phases, eval_replicas)
        self.eval_replicas = eval_replicas
        self.cfg = cfg
        self.split = split
        self.copy_obs = copy_obs
        self.rates = rates if rates is not None else make_rates(cfg)
        if self.rates.rates.shape[1] != cfg.num_classes:
            raise ValueError(f"rates have {self.rates.rates.shape[1]} classes, config has {cfg.num_classes}")
        S, K, H, n = cfg.num_shards, cfg.num_classes, cfg.history, cfg.sub_actions
        self.S, self.K, self.H, self.n, self.P, self.D = S, K, H, n, cfg.num_pools, cfg.num_branches
        self.dt = cfg.tick_s
        self.range = self.rates.split_range(split)
        self.range_len = self.range[1] - self.range[0]
        f32 = np.float32
        svc_time = np.asarray(cfg.service_time_s, dtype=np.float64)
        self.mu = (1.0 / svc_time).astype(f32)  # [K] per second per server at full speed
        self.inv_mu = svc_time.astype(f32)  # [K] server-seconds of work per request
        self.slo = (np.asarray(cfg.slo_factor) * svc_time).astype(f32)  # [K] p99 target, seconds
        self.lat_cap = (cfg.latency_cap_factor * self.slo).astype(f32)  # [K]
        self.mean_load = cfg.mean_load_erlangs
        self.class_load = (np.asarray(cfg.shares) * cfg.mean_load_erlangs).astype(f32)  # [K] Erlangs
        self.inv_class_load = (1.0 / self.class_load).astype(f32)
        self.inv_mean_n = (1.0 / (self.class_load * self.mu * self.dt)).astype(f32)  # [K]
        self.inv_slo = (1.0 / self.slo).astype(f32)
        self.drain_per_server = (1.0 / (self.mu * self.slo)).astype(f32)  # [K] servers per queued request
        self.need_alpha = np.float32(1.0 / cfg.window_ticks)
        self.lam_table = self.rates.rates.astype(f32)  # [T, K]
        self.erlang = ErlangCTable(cfg.max_servers)
        self.onesK = np.ones(K, dtype=f32)  # row sums as matmuls: 5x faster than .sum(1) on [S, K]
        self.cum_mat = np.triu(np.ones((K, K), dtype=f32))  # x @ cum_mat = cumsum over classes
        self.diff_mat = (np.eye(K) - np.eye(K, k=1)).astype(f32)  # x @ diff_mat = diff, first kept
        # Choices per branch, derived once.
        self.headroom = np.geomspace(cfg.headroom_min, cfg.headroom_max, n)  # [n] capacity tiers
        tilts = np.linspace(-cfg.priority_tilt, cfg.priority_tilt, n)  # [n]
        class_rank = np.linspace(1.0, -1.0, K) if K > 1 else np.zeros(1)  # tight SLO first
        self.tilt_w = np.exp(tilts[:, None] * class_rank[None, :]).astype(f32)  # [n, K]
        # Admission limit on the backlog, in SLOs of drain time; level 0 admits everything.
        # (1e30 stays finite in float32 and beats any queue even with no servers.)
        adm = np.array([1e30] + [2.0 ** (n - 2 - lvl) for lvl in range(n - 1)])  # [n]
        self.adm_slo = (adm[:, None] * self.slo[None, :]).astype(f32)  # [n, K] seconds
        self.speeds = np.linspace(cfg.speed_min, 1.0, n).astype(f32)  # [n]
        self.speeds3 = self.speeds ** 3
        self.pool_max = cfg.max_servers // self.P
        self.L = max(1, cfg.delay_ticks)  # provisioning ring: one slot per tick of delay
        self.lag = cfg.lag_ticks
        # Monitored per-tick signals are averaged over the monitoring resolution (an EWMA of
        # that time constant), then reported `lag` ticks late.
        self.mon_alpha = np.float32(1.0 / max(1, self.lag))
        self.W = cfg.window_ticks
        # Scale-down stabilisation: maxima of the monitored demand per block of ticks; the
        # window's peak is the max of the completed blocks (recomputed once per block) and
        # of the open one, so a tick costs O(S P) whatever the window.
        self.stab_block = max(1, self.lag)
        win = int(round(cfg.scale_down_window_s / cfg.tick_s))
        self.stab_nblocks = -(-win // self.stab_block) if win > 0 else 0
        self.rng = np.random.default_rng(cfg.seed)
        self.reset(seed=cfg.seed)

    # ---------------------------------------------------------------------------------
    def reset(self, seed: Optional[int] = None) -> Observation:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        S, K, P, H = self.S, self.K, self.P, self.H
        f32 = np.float32
        lo = self.range[0]
        if self.phases == "random":
            self.offset = lo + self.rng.integers(0, self.range_len, size=S)
        else:
            phases = S // self.eval_replicas
            self.offset = lo + ((np.arange(S) % phases) * self.range_len) // phases
        self.t = 0
        self._idx_t = -1
        lam = self.lam_table[self.offset]  # [S, K]
        load = lam * self.inv_mu  # [S, K] Erlangs
        if P == 1:
            init = np.ceil(load.sum(1, keepdims=True) / self.cfg.initial_utilisation)
        else:
            init = np.ceil(load / self.cfg.initial_utilisation)
        self.target = np.clip(init, self.cfg.min_servers, self.pool_max).astype(np.int32)  # [S, P]
        self.prov = Provisioning(self.target.copy(), self.cfg.delay_ticks, self.cfg.min_servers)
        self.level = np.empty((S, 3), dtype=np.int64)  # priority, admission, speed levels
        self.level[:] = (self.n // 2, 0, self.n - 1)
        self.load_est = (load + 1e-6).astype(f32)  # [S, K]
        self.need_avg = self.load_est.copy()  # [S, K]
        self.backlog = np.zeros((S, K), dtype=f32)
        # Accounting window accumulators.
        self.win_req = np.zeros((S, K), dtype=f32)
        self.win_late = np.zeros((S, K), dtype=f32)
        self.win_work = np.zeros((S, K), dtype=f32)
        self.win = np.zeros((4, S), dtype=f32)  # busy, capacity, cost, drops
        self.last_window = np.zeros((S, 4), dtype=f32)  # utilisation, cost, SLO violation, drop
        # Observation buffers: micro history is doubled so the last H ticks are one slice.
        fu = len(MICRO_FEATURES)
        self.micro_buf = np.zeros((S, K, 2 * H, fu), dtype=f32)
        self.frame = np.zeros((S, K, fu), dtype=f32)  # this tick's micro features
        # The same memory seen as one opaque item per (shard, class, tick): copying a frame
        # into the history is then 4 K items of 20 bytes, not 20 K strided floats (3x faster).
        as_item = np.dtype((np.void, 4 * fu))
        self.micro_items = self.micro_buf.view(as_item)[..., 0]  # [S, K, 2H]
        self.frame_items = self.frame.view(as_item)[..., 0]  # [S, K]
        self.hist_ptr = 0
        self.mon_ring = np.zeros((self.lag + 1, S, len(MACRO_MONITORED)), dtype=f32)
        self.mon_ptr = 0
        mon = self.mon_ring[0]
        mon[:, 0] = load.sum(1) / self.mean_load
        mon[:, 1] = self.cfg.initial_utilisation
        self.mon_ring[:] = mon
        self.mon_class = np.empty((self.lag + 1, S, K), dtype=f32)  # monitored per-class demand, Erlangs
        self.mon_class[:] = load
        demand0 = (load @ self.onesK[:, None]) if P == 1 else load  # [S, P] Erlangs
        self.stab_ring = np.repeat(demand0[None].astype(f32), max(1, self.stab_nblocks), axis=0)  # [nb, S, P]
        self.stab_open = demand0.astype(f32)  # max of the open block
        self.stab_closed = demand0.astype(f32)  # max of the completed blocks in the window
        self.stab_ptr = 0
        self.servers_k = self._split_capacity()
        return self._observe()

    # ---------------------------------------------------------------------------------
    def _split_capacity(self) -> np.ndarray:
        """Integer servers per class [S, K] (float32)."""
        if self.P > 1:
            return self.active.astype(np.float32)
        # Servers each class needs now: requests in service, plus enough to drain its queue
        # within one SLO; times the priority tilt.
        # The share never falls below the class's need averaged over the last window, so a
        # class whose traffic comes in bursts keeps servers between them.
        need = self.load_est + self.backlog * self.drain_per_server + 1e-3  # [S, K]
        self.need_avg += self.need_alpha * (need - self.need_avg)
        w = np.maximum(need, self.need_avg) * self.tilt_w[self.level[:, 0]]
        cum = w @ self.cum_mat
        # Cumulative rounding: integers that sum exactly to the active servers.
        cum = np.rint(cum * (self.active[:, :1] / cum[:, -1:]).astype(np.float32))
        return cum @ self.diff_mat

    def _stabilised(self, demand: np.ndarray) -> np.ndarray:
        """Highest monitored demand [S, P] over the scale-down window, this tick included."""
        np.maximum(self.stab_open, demand, out=self.stab_open)
        peak = np.maximum(self.stab_closed, self.stab_open)
        if self.t % self.stab_block == self.stab_block - 1:  # the open block completes
            self.stab_ring[self.stab_ptr] = self.stab_open
            self.stab_ptr = (self.stab_ptr + 1) % self.stab_nblocks
            self.stab_closed = self.stab_ring.max(0)
            self.stab_open = demand.astype(np.float32)
        return peak

    # ---------------------------------------------------------------------------------
    def step(self, actions, capacity_target=None):
        """Advance one tick.

        actions: int [S, D]. capacity_target: optional int [S, P] that replaces the capacity
        branches (how rule-based baselines set replicas directly).
        Returns (obs, reward [S] float64, truncated: bool, info: dict of arrays).
        """
        a = self.check_actions(actions)
        cfg, S, K, P, dt = self.cfg, self.S, self.K, self.P, self.dt

        # 1. provisioning: servers launched `delay` ticks ago become active.
        self.prov.activate()

        # 2. decode the action; reconcile provisioned capacity with the target.
        if capacity_target is not None:
            ct = np.asarray(capacity_target)
            if ct.shape != (S, P) or ct.dtype.kind not in "iu":
                raise ActionError(f"capacity_target must be integers of shape [S={S}, P={P}], got "
                                  f"{ct.dtype} {ct.shape}")
            self.target = np.clip(ct, cfg.min_servers, self.pool_max).astype(np.int32)
        else:
            # Capacity tier: spare capacity over the demand the monitoring reports (lagged).
            demand = self.mon_class[(self.mon_ptr - self.lag) % (self.lag + 1)]  # [S, K] Erlangs
            if P == 1:
                demand = demand @ self.onesK[:, None]  # [S, 1]
            if self.stab_nblocks:
                demand = self._stabilised(demand)
            want = np.ceil(demand * self.headroom[a[:, :P]])
            self.target = np.clip(want, cfg.min_servers, self.pool_max).astype(np.int32)
        if P == 1:
            self.level[:, 0] = a[:, 1]
        self.level[:, 1:] = a[:, -2:]
        self.prov.reconcile(self.target)

        # 3. split servers between classes; service rate at the chosen speed.
        self.servers_k = c = self._split_capacity()  # [S, K] float32 integers
        lvl_speed = self.level[:, 2]
        spd = self.speeds[lvl_speed]  # [S]
        mus = self.mu * spd[:, None]  # [S, K] per-server rate

        # 4. arrivals from the trace, each shard at its own phase.
        lam = self.lam_table[self._trace_index()]  # [S, K] per second
        mean_n = lam * dt if dt != 1.0 else lam
        arrivals = self.rng.poisson(mean_n).astype(np.float32) if cfg.trace.poisson_noise else mean_n.copy()

        # 5-6. queues (fluid backlog, admission refusals) and latency (service + Erlang-C p99
        # wait at the true rate + backlog drain time).
        served, drops, backlog, p99, late, theta, inv_rate = serve_tick(
            self, c, mus, lam, arrivals, self.adm_slo[self.level[:, 1]])

        # 7. accounting, normalised by the mean load so rewards are O(1) at any scale.
        # Requests in service per class follow dN/dt = admitted rate - mu s N (an EWMA at
        # rate mu s: instant for short jobs, slow for long ones), capped by the class's
        # servers. Busy servers come from N, not from the fluid queue's drain, which would
        # spread one long request over all of a class's servers for a few ticks.
        ones = self.onesK
        mus_dt = mus * dt
        alpha = np.minimum(mus_dt, 1.0)
        admitted = np.maximum(arrivals - drops, 0.0)  # drops can also come out of the backlog
        self.load_est += alpha * (admitted / mus_dt - self.load_est)
        busy_k = np.minimum(self.load_est, c)  # [S, K] busy servers
        busy = (busy_k @ ones).astype(np.float64) * dt  # [S] busy server-seconds
        work = served * self.inv_mu  # [S, K] server-seconds of work completed, at full speed
        work_s = (work @ ones).astype(np.float64)  # [S]
        servers = self.active[:, 0] if P == 1 else self.active.sum(1)
        pend = self.pending[:, 0] if P == 1 else self.pending.sum(1)
        cost = cfg.idle_power_frac * (servers + pend) * dt \
            + (1.0 - cfg.idle_power_frac) * busy * self.speeds3[lvl_speed]
        revenue = cfg.revenue_per_work * work_s
        drop_pen = cfg.drop_penalty * ((drops * self.inv_mu) @ ones)
        self.win_req += arrivals
        late_req = late * admitted + drops  # [S, K] requests past their SLO this tick (drops count as late)
        self.win_late += late_req
        self.win_work += arrivals * self.inv_mu  # work offered to each class
        win = self.win
        win[0] += busy
        win[1] += servers * dt
        win[2] += cost
        win[3] += drops @ ones
        self.t += 1
        norm = self.mean_load * dt
        violated = None
        if self.t % self.W == 0:
            violated = self.win_late > P99_Q * self.win_req  # [S, K]
            slo_pen = cfg.slo_credit * cfg.revenue_per_work * ((violated * self.win_work) @ ones)
            lw = self.last_window
            lw[:, 0] = win[0] / np.maximum(win[1], 1e-9)
            lw[:, 1] = win[2] / (norm * self.W)
            lw[:, 2] = (violated @ ones) / K
            lw[:, 3] = win[3] / np.maximum(self.win_req @ ones, 1.0)
            for acc in (self.win_req, self.win_late, self.win_work, win):
                acc[...] = 0.0
            reward = (revenue - cost - drop_pen - slo_pen) / norm
        else:
            slo_pen = np.zeros(S)
            reward = (revenue - cost - drop_pen) / norm

        # 8. monitoring ring (averaged, read back with a lag), micro history.
        util = busy / np.maximum(servers * dt, 1e-9)
        offered_k = lam * self.inv_mu  # [S, K] Erlangs offered
        offered = offered_k @ ones
        prev = self.mon_ring[self.mon_ptr]
        self.mon_ptr = (self.mon_ptr + 1) % (self.lag + 1)
        mon = self.mon_ring[self.mon_ptr]
        mon[:, 2:6] = self.last_window
        a_m = self.mon_alpha
        prev_k = self.mon_class[(self.mon_ptr - 1) % (self.lag + 1)]
        self.mon_class[self.mon_ptr] = prev_k + a_m * (offered_k - prev_k)
        mon[:, 0] = (self.mon_class[self.mon_ptr] @ ones) * (1.0 / self.mean_load)
        mon[:, 1] = prev[:, 1] + a_m * (util - prev[:, 1])
        mon[:, 6] = prev[:, 6] + a_m * (((backlog * self.inv_mu) @ ones) * (1.0 / self.mean_load) - prev[:, 6])
        self.hist_ptr = h = (self.hist_ptr + 1) % self.H
        frame = self.frame  # [S, K, Fu]
        frame[..., 0] = arrivals * self.inv_mean_n
        frame[..., 1] = np.minimum(backlog * inv_rate * self.inv_slo, 10.0)
        frame[..., 2] = p99 * self.inv_slo
        frame[..., 3] = drops * self.inv_mean_n
        frame[..., 4] = c * self.inv_class_load
        # Error budget burnt so far in the open accounting window (1 = the 1 % the SLO
        # allows): what an SRE dashboard shows, and what the window's SLO credit depends on.
        frame[..., 5] = np.minimum(self.win_late / (np.maximum(self.win_req, 1.0) * P99_Q), 10.0)
        self.micro_items[:, :, h] = self.frame_items
        self.micro_items[:, :, h + self.H] = self.frame_items

        x = (1.0 - drops / np.maximum(arrivals, 1.0)) * np.minimum(self.slo / p99, 1.0)  # [S, K]
        info = {
            # reward components (normalised like the reward)
            "served": revenue / norm, "cost": cost / norm, "slo_penalty": slo_pen / norm,
            "drop_penalty": drop_pen / norm,
            # preference metrics
            "overload": (((backlog > 0) | (theta <= 0)) @ ones) > 0,
            "fairness": (x @ ones) ** 2 / (K * np.maximum((x * x) @ ones, 1e-12)),
            "slo_violation": ((p99 > self.slo) @ ones) > 0,
            "window_violated": violated,
            # platform state
            "late_requests": late_req,
            "p99_s": p99, "utilisation": util, "servers": servers, "pending": pend,
            "arrivals": arrivals, "served_requests": served, "dropped": drops, "backlog": backlog,
            "offered_erlangs": offered,
        }
        truncated = self.t >= cfg.episode_ticks
        return self._observe(), reward, truncated, info

    def _trace_index(self) -> np.ndarray:
        """Trace tick of each shard now: its phase plus the episode time, wrapped in range."""
        if self._idx_t != self.t:
            self._idx = self.range[0] + (self.offset - self.range[0] + self.t) % self.range_len
            self._idx_t = self.t
        return self._idx

    def _observe(self) -> Observation:
        S, n = self.S, self.n
        macro = np.empty((S, len(MACRO_FEATURES)), dtype=np.float32)
        m = len(MACRO_MONITORED)
        macro[:, :m] = self.mon_ring[(self.mon_ptr - self.lag) % (self.lag + 1)]
        ang = (2.0 * np.pi) * self.rates.time_of_day[self._trace_index()]
        macro[:, m] = np.sin(ang)
        macro[:, m + 1] = np.cos(ang)
        inv = 1.0 / self.mean_load
        if self.P == 1:
            macro[:, m + 2] = self.active[:, 0] * inv
            macro[:, m + 3] = self.pending[:, 0] * inv
            macro[:, m + 4] = self.target[:, 0] * inv
        else:
            macro[:, m + 2] = self.active.sum(1) * inv
            macro[:, m + 3] = self.pending.sum(1) * inv
            macro[:, m + 4] = self.target.sum(1) * inv
        macro[:, m + 5:m + 8] = self.level * (1.0 / (n - 1))
        macro[:, m + 8] = (self.t % self.W) / self.W  # how far the open accounting window is
        p = self.hist_ptr + 1
        micro = self.micro_buf[:, :, p:p + self.H]  # [S, K, H, Fu], oldest first
        return Observation(macro=macro, micro=micro.copy() if self.copy_obs else micro)

    def monitored(self) -> dict:
        """Monitored signals as a metrics system reports them (lagged), for rule-based baselines."""
        mon = self.mon_ring[(self.mon_ptr - self.lag) % (self.lag + 1)]
        return {name: mon[:, i] for i, name in enumerate(MACRO_MONITORED)}
