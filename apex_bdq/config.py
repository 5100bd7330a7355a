"""One config tree of frozen dataclasses.

Every field has a docstring-style comment; derived values are properties computed from the
fields; bad values fail in ``__post_init__`` with a message that names the field and the
value that was given.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A config value is out of range or inconsistent with another."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class TraceConfig:
    """Where arrival rates come from and how they are shaped."""

    path: Optional[str] = None
    """CSV trace (or .csv.gz); None selects the platform's bundled trace: four weeks of
    NASA-HTTP 1995 on v2, one day of the Azure Functions 2019 4-class trace on v1."""
    columns: Optional[tuple[str, ...]] = None
    """Rate columns to use. None: the bundled trace's class columns, or the first numeric
    column of any other file. One column is split over the classes by `SimConfig.class_share`;
    K columns map one-to-one onto the K classes."""
    interval_s: Optional[float] = None
    """Seconds between rows. None: read from the time column, else from a `_5min` / `_1min` /
    `_1s` suffix in the file name."""
    eval_fraction: float = 0.25
    """The last `eval_fraction` of the trace is held out for evaluation (on a trace of four
    days or more, rounded to whole days: 7 of the bundled v2 trace's 28)."""
    validation_fraction: float = 0.15
    """The last `validation_fraction` of the part before the held-out range becomes a
    validation range (split "val"; whole days on a multi-day trace: 3 of the bundled v2
    trace's 21): trained on by nothing, looked at by whoever chooses settings
    (`evaluate_policy(..., split="val")`), so the held-out range stays a test set. 0 = none.
    The rates' normalisation covers training and validation together, so the held-out range
    is the same trace with or without it."""
    poisson_noise: bool = True
    """Draw per-tick arrivals from Poisson(rate * tick); off gives the fluid mean."""
    smooth_s: Optional[float] = None
    """Centred moving average over this many seconds of the trace's rows before it is
    scaled (0 = none). A small site's per-minute counts carry the noise of its few users,
    which scaled up to a platform's rate would be far larger than that rate's own Poisson
    noise; smoothed, the rate follows the trace's slower structure and the simulator draws
    Poisson arrivals at the scaled rate. None: 300 s for the bundled NASA trace (the v2
    default, on either platform), 0 for any other file."""

    def __post_init__(self) -> None:
        _check(0.0 < self.eval_fraction < 1.0,
               f"trace.eval_fraction must be in (0, 1), got {self.eval_fraction!r}")
        _check(0.0 <= self.validation_fraction < 1.0,
               f"trace.validation_fraction must be in [0, 1), got {self.validation_fraction!r}")
        _check(self.smooth_s is None or self.smooth_s >= 0,
               f"trace.smooth_s must be >= 0 (or none), got {self.smooth_s!r}")
        _check(self.interval_s is None or self.interval_s > 0,
               f"trace.interval_s must be > 0, got {self.interval_s!r}")
        if self.columns is not None:
            _check(len(self.columns) > 0, "trace.columns must name at least one column")


@dataclass(frozen=True)
class AugmentConfig:
    """Training-time reshaping of the trace, so that a policy meets load shapes its training
    days do not hold (platform v2; training episodes only, never an evaluation or the
    validation days). Every episode each shard draws its own: a rate scale, a time warp (how
    many trace seconds pass per platform second: > 1 replays the day faster, so load moves
    more per provisioning delay) and flash-crowd bursts on top. Seeded by the simulator's
    seed: the same seed draws the same shapes."""

    enabled: bool = False
    scale: tuple[float, float] = (0.7, 1.4)
    """Log-uniform range of the per-episode rate multiplier (1 = the trace's own level)."""
    time_warp: tuple[float, float] = (0.5, 2.0)
    """Log-uniform range of trace seconds per platform second."""
    bursts_per_hour: float = 1.0
    """Mean flash crowds per shard and hour of platform time (Poisson)."""
    burst_height: tuple[float, float] = (0.3, 1.5)
    """Uniform range of a burst's peak, as a share of the rate it lands on (0.5: +50 %)."""
    burst_s: tuple[float, float] = (60.0, 900.0)
    """Uniform range of a burst's length; its profile is a half sine (rises, peaks, fades)."""
    traces: tuple[str, ...] = ()
    """More training traces to mix in (CSV paths, read like `sim.trace.path`, normalised to
    the same mean load): every training episode each shard replays the training days of one
    of {the run's trace, these}, drawn with equal chance; only their training ranges are read,
    never their validation or held-out days. Works with or without `enabled` (the reshaping)."""

    def __post_init__(self) -> None:
        for name in ("scale", "time_warp", "burst_height", "burst_s"):
            lo, hi = getattr(self, name)
            low_ok = lo >= 0 if name == "burst_height" else lo > 0
            _check(low_ok and lo <= hi, f"sim.augment.{name} must be (lo, hi) with "
                                        f"{'0 <=' if name == 'burst_height' else '0 <'} lo <= hi, got {(lo, hi)!r}")
        _check(self.bursts_per_hour >= 0, f"sim.augment.bursts_per_hour must be >= 0, got {self.bursts_per_hour!r}")
        _check(all(isinstance(p, str) and p.strip() for p in self.traces),
               f"sim.augment.traces must be CSV paths, got {self.traces!r}")

    @property
    def active(self) -> bool:
        """Whether training episodes differ from the trace's own days (reshaped or mixed)."""
        return self.enabled or bool(self.traces)


# Service times of the bundled trace's four classes: invocation-weighted mean duration of the
# Azure Functions 2019 top-50 functions grouped by mean duration (apex_bdq/data/
# azure_functions2019_4class_meta.csv; a test keeps the two equal).
BUNDLED_SERVICE_TIME_S = (0.0600, 3.3057, 13.3921, 321.1498)


PLATFORMS = ("v1", "v2")


@dataclass(frozen=True)
class SimConfig:
    """The platform simulator: S shards, K request classes, D action branches of n choices.

    Two platforms (README, "The platform"):
    - "v2" (default): one capacity pool per request class, as Kubernetes runs one Deployment
      and one HPA per service. Per class two branches: `capacity_k` plans for
      `plan_factors[a]` x the class's monitored request rate, sized with the queueing model
      (`apex_bdq.sizing`); `hold_k` keeps the highest plan of the last `hold_s[a]` seconds
      (the scale-down hold is the policy's choice). One `admission` branch. Replica-seconds
      of active and booting replicas are billed. Observations add per-class demand history
      (coarse blocks, the same time a day and a week ago), calendar phase and capacity still
      booting.
    - "v1": one shared pool split between classes, capacity tiers on HPA's reactive signal
      with a fixed 300-s scale-down hold, energy-style cost; kept so that checkpoints trained
      on it still evaluate on it (a checkpoint without a `platform` field is v1).
    Fields marked "v1:" or "v2:" apply to that platform only.
    """

    platform: str = "v2"
    """"v2" (default) or "v1" (see above)."""
    num_shards: int = 8
    """S: shards simulated side by side (one vectorised array axis)."""
    num_classes: int = 4
    """K: request classes per shard."""
    sub_actions: int = 5
    """n: choices per action branch."""
    per_class_capacity: bool = False
    """v1: False: branches (capacity, priority, admission, scheduling), D=4. True: one capacity
    branch per class plus admission and scheduling, D=K+2 (priority is then implied)."""
    history: int = 8
    """H: ticks of per-class history in the micro observation."""
    tick_s: float = 1.0
    """Platform seconds per decision tick."""
    monitor_lag_s: float = 15.0
    """Lag of the monitored macro signals (Kubernetes metrics-server resolution, 15 s)."""
    provisioning_delay_s: float = 60.0
    """New capacity serves after this delay (VM start-up of tens of seconds to ~2 minutes:
    Mao & Humphrey, IEEE CLOUD 2012). Removal is immediate."""
    accounting_window_s: float = 60.0
    """SLO compliance is settled, and penalised, once per window (delayed reward)."""
    episode_s: float = 3600.0
    """Platform time per training episode."""
    mean_load_erlangs: float = 48.0
    """Mean offered load per shard, in busy servers, that the trace is normalised to."""
    class_share: Optional[tuple[float, ...]] = None
    """Share of the mean load per class; None = equal shares."""
    service_time_s: tuple[float, ...] = BUNDLED_SERVICE_TIME_S
    """Mean service time per class at full speed (exponential, M/M/c)."""
    slo_factor: tuple[float, ...] = (1.5, 2.0, 3.0, 4.0)
    """p99 latency SLO per class as a multiple of its mean service time."""
    max_servers: int = 256
    """v1: capacity limit per shard (all pools together)."""
    min_servers: int = 1
    """Capacity floor per pool."""
    initial_utilisation: float = 0.6
    """v1: episodes start with capacity = offered load / this (a warm platform). v2 starts
    each pool at the default action's plan for the rate of the moment."""
    headroom_min: float = 1.4
    """v1: capacity tiers: the capacity branch sets target = ceil(monitored demand x headroom),
    with n headroom tiers spaced geometrically from headroom_min to headroom_max. Holding a
    tier tracks the demand; the tier is how much spare capacity to run with. 1.4-2.8 are the
    target utilisations 71 %-36 % that autoscalers are commonly set to (HPA examples use 50 %)."""
    headroom_max: float = 2.8
    scale_down_window_s: float = 300.0
    """v1: scale-down stabilisation of the capacity tiers: the tier multiplies the highest
    monitored demand of this trailing window (in 15-s blocks), so capacity rises at once and
    falls only when a burst is this long past, as the Kubernetes HPA's default
    `behavior.scaleDown.stabilizationWindowSeconds` (300 s) does. 0 tracks the demand as is."""
    priority_tilt: float = 1.0
    """v1: largest log-weight tilt of the capacity shares towards tight-SLO classes."""
    speed_min: float = 0.6
    """v1: slowest service-speed level of the scheduling branch (1.0 is the fastest)."""
    idle_power_frac: float = 0.5
    """v1: server power when idle as a share of peak (Barroso & Hoelzle, IEEE Computer 2007);
    the dynamic part scales with utilisation x speed^3. v2 bills every active or booting
    replica for each second (cloud per-second billing), busy or not."""
    plan_factors: tuple[float, ...] = (1.0, 1.15, 1.3, 1.5, 1.75)
    """v2: the capacity tiers, one per sub-action: tier a provisions the replicas the
    queueing model needs to meet the class's SLO at plan_factors[a] x its monitored request
    rate (1.0 = the rate of the moment; above it = spare room for growth, e.g. ahead of a
    predictable ramp)."""
    hold_s: tuple[float, ...] = (0.0, 30.0, 60.0, 120.0, 300.0)
    """v2: the scale-down holds, one per sub-action: a class's target is the highest plan of
    the last hold_s[a] seconds (in 15-s blocks, the HPA sync period), as HPA's
    `behavior.scaleDown.stabilizationWindowSeconds` (default 300 s) does; 0 releases at once."""
    pool_cap_factor: float = 4.0
    """v2: each class's pool holds at most ceil(pool_cap_factor x the class's peak offered
    load over the whole trace) replicas (plus the floor): large enough that the trace's
    spikes can be served, so no burst is unservable by construction."""
    coarse_block_s: float = 120.0
    """v2: resolution of the per-class demand history in the macro observation."""
    coarse_history: int = 16
    """v2: blocks of that history (16 x 120 s = the last 32 minutes)."""
    seasonal_leads_s: tuple[float, ...] = (0.0, 600.0, 1800.0)
    """v2: the macro observation holds each class's trace rate a day and a week ago, at
    these offsets ahead of the same time of day (what `rate(...) offset 1d` gives in
    Prometheus; a predictive autoscaler's input)."""
    revenue_per_work: float = 2.0
    """Reward per server-second of work served (objective weight, not a platform figure)."""
    drop_penalty: float = 1.0
    """Penalty per server-second of work refused by admission (objective weight)."""
    slo_credit: float = 1.0
    """When a class's SLO breaks in a window, this share of the value of all work offered to
    it in the window is paid back (an SLA credit: serving nothing does not escape it)."""
    latency_cap_factor: float = 20.0
    """Reported latency is capped at this multiple of the class SLO (overload)."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    """Training-time trace augmentation (platform v2; off by default)."""
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.platform in PLATFORMS, f"sim.platform must be one of {PLATFORMS}, got {self.platform!r}")
        _check(self.num_shards >= 1, f"sim.num_shards must be >= 1, got {self.num_shards!r}")
        _check(self.num_classes >= 1, f"sim.num_classes must be >= 1, got {self.num_classes!r}")
        _check(self.sub_actions >= 2, f"sim.sub_actions must be >= 2, got {self.sub_actions!r}")
        _check(self.history >= 1, f"sim.history must be >= 1, got {self.history!r}")
        _check(self.tick_s > 0, f"sim.tick_s must be > 0, got {self.tick_s!r}")
        for name in ("monitor_lag_s", "provisioning_delay_s"):
            _check(getattr(self, name) >= 0, f"sim.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("accounting_window_s", "episode_s", "mean_load_erlangs"):
            _check(getattr(self, name) > 0, f"sim.{name} must be > 0, got {getattr(self, name)!r}")
        k = self.num_classes
        for name in ("service_time_s", "slo_factor") + (("class_share",) if self.class_share else ()):
            val = getattr(self, name)
            _check(len(val) == k, f"sim.{name} needs one value per class (num_classes={k}), got {val!r}")
            _check(all(v > 0 for v in val), f"sim.{name} values must be > 0, got {val!r}")
        _check(self.min_servers >= 0, f"sim.min_servers must be >= 0, got {self.min_servers!r}")
        _check(self.max_servers >= max(1, self.min_servers * self.num_pools),
               f"sim.max_servers={self.max_servers} is below min_servers x pools "
               f"({self.min_servers} x {self.num_pools})")
        _check(0 < self.initial_utilisation <= 1,
               f"sim.initial_utilisation must be in (0, 1], got {self.initial_utilisation!r}")
        _check(0 < self.headroom_min <= self.headroom_max,
               f"sim.headroom_min / headroom_max must satisfy 0 < min <= max, got "
               f"{self.headroom_min!r} / {self.headroom_max!r}")
        _check(self.scale_down_window_s >= 0,
               f"sim.scale_down_window_s must be >= 0, got {self.scale_down_window_s!r}")
        _check(0 < self.speed_min <= 1, f"sim.speed_min must be in (0, 1], got {self.speed_min!r}")
        _check(0 <= self.idle_power_frac <= 1,
               f"sim.idle_power_frac must be in [0, 1], got {self.idle_power_frac!r}")
        _check(self.latency_cap_factor > 1,
               f"sim.latency_cap_factor must be > 1, got {self.latency_cap_factor!r}")
        _check(self.episode_ticks >= 1, f"sim.episode_s={self.episode_s} is shorter than one tick")
        _check(not self.augment.active or self.platform == "v2", "sim.augment is a platform v2 option")
        if self.platform == "v2":
            _check(not self.per_class_capacity, "sim.per_class_capacity is a v1 option: platform v2 always has "
                                                "one pool per class")
            n = self.sub_actions
            for name in ("plan_factors", "hold_s"):
                val = getattr(self, name)
                _check(len(val) == n, f"sim.{name} needs one value per sub-action (sub_actions={n}), got {val!r}")
            _check(all(f > 0 for f in self.plan_factors), f"sim.plan_factors must be > 0, got {self.plan_factors!r}")
            _check(all(h >= 0 for h in self.hold_s), f"sim.hold_s must be >= 0, got {self.hold_s!r}")
            _check(self.pool_cap_factor >= 1, f"sim.pool_cap_factor must be >= 1, got {self.pool_cap_factor!r}")
            _check(self.coarse_block_s >= self.tick_s and self.coarse_history >= 1,
                   f"sim.coarse_block_s must be >= one tick and coarse_history >= 1, got "
                   f"{self.coarse_block_s!r} / {self.coarse_history!r}")
            _check(all(v >= 0 for v in self.seasonal_leads_s),
                   f"sim.seasonal_leads_s must be >= 0, got {self.seasonal_leads_s!r}")
            slo = [f * s for f, s in zip(self.slo_factor, self.service_time_s)]
            _check(all(f > 1 for f in self.slo_factor),
                   f"sim.slo_factor must be > 1 on platform v2 (the SLO must leave a waiting budget above the "
                   f"mean service time), got {self.slo_factor!r} (SLOs {slo} s)")

    # -- derived values ------------------------------------------------------------------
    @property
    def num_pools(self) -> int:
        """Capacity pools: one shared pool, or one per class."""
        return self.num_classes if (self.per_class_capacity or self.platform == "v2") else 1

    @property
    def num_branches(self) -> int:
        """D: action branches."""
        if self.platform == "v2":
            return 2 * self.num_classes + 1
        return self.num_classes + 2 if self.per_class_capacity else 4

    @property
    def branch_names(self) -> tuple[str, ...]:
        if self.platform == "v2":
            k = range(self.num_classes)
            return tuple(f"capacity_{i}" for i in k) + tuple(f"hold_{i}" for i in k) + ("admission",)
        if self.per_class_capacity:
            return tuple(f"capacity_{k}" for k in range(self.num_classes)) + ("admission", "scheduling")
        return ("capacity", "priority", "admission", "scheduling")

    @property
    def episode_ticks(self) -> int:
        return int(round(self.episode_s / self.tick_s))

    @property
    def lag_ticks(self) -> int:
        return int(round(self.monitor_lag_s / self.tick_s))

    @property
    def delay_ticks(self) -> int:
        return int(round(self.provisioning_delay_s / self.tick_s))

    @property
    def window_ticks(self) -> int:
        return max(1, int(round(self.accounting_window_s / self.tick_s)))

    @property
    def shares(self) -> tuple[float, ...]:
        s = self.class_share or (1.0,) * self.num_classes
        tot = float(sum(s))
        return tuple(v / tot for v in s)

    def replace(self, **changes: Any) -> "SimConfig":
        return dataclasses.replace(self, **changes)


def sim_config_from_dict(d: dict) -> SimConfig:
    """Rebuild a SimConfig from `dataclasses.asdict` output (lists back to tuples)."""
    d = dict(d)
    d.setdefault("platform", "v1")  # saved before platform v2 existed
    tr = dict(d.pop("trace", {}) or {})
    if tr.get("columns") is not None:
        tr["columns"] = tuple(tr["columns"])
    aug = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (d.pop("augment", None) or {}).items()}
    for k in ("class_share", "service_time_s", "slo_factor", "plan_factors", "hold_s", "seasonal_leads_s"):
        if d.get(k) is not None:
            d[k] = tuple(d[k])
    d["trace"] = _section(TraceConfig, tr, "sim.trace")
    d["augment"] = _section(AugmentConfig, aug, "sim.augment")
    return _section(SimConfig, d, "sim")


@dataclass(frozen=True)
class AgentConfig:
    """BDQ + prioritized replay + exploration (the learning core)."""

    gamma: float = 0.995
    """Discount per tick (1 s); per decision it is gamma^decision_ticks."""
    decision_ticks: int = 10
    """The agent decides every this many ticks and holds its action in between (Atari's
    frame skip; HPA re-decides every 15 s). A capacity decision pays off 60-120 ticks later
    (provisioning delay + SLO window): per-tick Q-values would differ by far less than their
    noise (the action gap shrinks with the time step, Tallec et al., ICML 2019)."""
    n_step: int = 3
    """n of the n-step return, in decisions (Ape-X: 3)."""
    lr: float = 1e-4
    """Adam learning rate."""
    batch_size: int = 256
    """Transitions per learner update."""
    replay_capacity: int = 200_000
    """Replay ring size."""
    alpha: float = 0.6
    """Priority exponent (Ape-X: 0.6)."""
    beta0: float = 0.4
    """Initial importance-sampling exponent, annealed to 1 (Ape-X: 0.4)."""
    beta_steps: int = 50_000
    """Updates over which beta reaches 1."""
    learning_starts: int = 5_000
    """Transitions in replay before the first update."""
    updates_per_decision: float = 1.0
    """Learner updates per vectorised decision (fractions accumulate)."""
    target_update: int = 250
    """Updates between hard copies of the online network into the target network."""
    reward_scale: float = 0.1
    """Rewards are multiplied by this before learning: the SLO credit (~-30 per broken
    class-window in simulator units) then sits within the Huber loss's quadratic zone
    instead of being clipped to a unit gradient (with huber_delta >= ~3)."""
    slo_penalty: float = 0.0
    """Training-only cost per class-window that breaks its SLO, in simulator reward units,
    on top of the SLA credit the reward already charges (~30 per class-window): the
    multiplier of a Lagrangian relaxation of "maximise reward subject to an SLO violation
    rate" (constrained RL, Altman 1999; Tessler et al., ICLR 2019). Evaluation always
    reports the platform's own reward. 0 = train on the reward as is."""
    slo_burn_penalty: float = 0.0
    """Training-only cost per unit of a class-window's error-budget burn, capped at
    `slo_burn_cap` budgets, charged tick by tick as late or refused requests accumulate: a
    dense surrogate of the per-broken-window `slo_penalty`. A class's burn in an accounting
    window is its late requests over the 1 % the SLO allows of the trace's average window, so
    1 = the budget spent; a window costs slo_burn_penalty x min(burn, slo_burn_cap) in all.
    0 = off."""
    slo_burn_cap: float = 1.0
    """Burn (in error budgets) beyond which a class-window costs no more under `slo_burn_penalty`."""
    grad_clip: float = 10.0
    """Max global gradient norm."""
    huber_delta: float = 1.0
    """Huber loss threshold on TD errors (in scaled reward units). Errors beyond it get a unit
    gradient, which turns the critic's estimate towards the median of the return: a rare SLA
    credit or SLO penalty then barely moves it; a larger delta makes it estimate the mean."""
    eps_base: float = 0.4
    """Ape-X exploration ladder: shard i explores with eps_base^(1 + eps_alpha i/(S-1))."""
    eps_alpha: float = 7.0
    initial_policy: str = "network"
    """What the untrained network does: "network" = whatever its random initialisation's
    argmax is (an arbitrary, nearly constant action that depends on the seed), "default" =
    the platform's default setting (the middle capacity tier, proportional shares, admit
    all, full speed; the advantage branches' output layer starts at zero with that
    sub-action a 0.01 tie-break ahead), so the first replay and the exploration ladder start
    from what an operator would run, not from a random configuration. The local learner,
    the Ray Train learner and the Ape-X driver's version 0 all apply it."""
    priority_rule: str = "mean"
    """Priority = mean (or sum) over branches of |TD|, the same rule in actors and learner."""

    def __post_init__(self) -> None:
        _check(0 <= self.gamma <= 1, f"agent.gamma must be in [0, 1], got {self.gamma!r}")
        _check(self.n_step >= 1, f"agent.n_step must be >= 1, got {self.n_step!r}")
        _check(self.decision_ticks >= 1, f"agent.decision_ticks must be >= 1, got {self.decision_ticks!r}")
        _check(self.lr > 0, f"agent.lr must be > 0, got {self.lr!r}")
        _check(self.batch_size >= 1, f"agent.batch_size must be >= 1, got {self.batch_size!r}")
        _check(self.replay_capacity >= self.batch_size,
               f"agent.replay_capacity={self.replay_capacity} is smaller than batch_size={self.batch_size}")
        _check(self.learning_starts >= self.batch_size,
               f"agent.learning_starts={self.learning_starts} must be >= batch_size={self.batch_size}")
        _check(self.updates_per_decision > 0,
               f"agent.updates_per_decision must be > 0, got {self.updates_per_decision!r}")
        _check(self.target_update >= 1, f"agent.target_update must be >= 1, got {self.target_update!r}")
        _check(self.reward_scale > 0, f"agent.reward_scale must be > 0, got {self.reward_scale!r}")
        _check(self.slo_penalty >= 0, f"agent.slo_penalty must be >= 0, got {self.slo_penalty!r}")
        _check(self.slo_burn_penalty >= 0, f"agent.slo_burn_penalty must be >= 0, got {self.slo_burn_penalty!r}")
        _check(self.slo_burn_cap > 0, f"agent.slo_burn_cap must be > 0 (error budgets), got {self.slo_burn_cap!r}")
        _check(0 < self.eps_base <= 1, f"agent.eps_base must be in (0, 1], got {self.eps_base!r}")
        _check(self.initial_policy in ("network", "default"),
               f"agent.initial_policy must be 'network' or 'default', got {self.initial_policy!r}")
        _check(self.priority_rule in ("mean", "sum"),
               f"agent.priority_rule must be 'mean' or 'sum', got {self.priority_rule!r}")

    def epsilons(self, num: int) -> tuple[float, ...]:
        """The Ape-X exploration ladder for `num` explorers."""
        if num == 1:
            return (self.eps_base,)
        return tuple(self.eps_base ** (1 + self.eps_alpha * i / (num - 1)) for i in range(num))


@dataclass(frozen=True)
class NetConfig:
    """Sizes of the BDQ network."""

    macro_features: int = 16
    """Fm: macro observation width."""
    num_classes: int = 4
    """K: request classes in the micro observation."""
    history: int = 8
    """H: ticks of micro history."""
    micro_features: int = 6
    """Fu: micro features per class and tick."""
    num_branches: int = 4
    """D: action branches."""
    sub_actions: int = 5
    """n: choices per branch."""
    macro_hidden: int = 128
    """Width of the macro MLP."""
    micro_channels: int = 32
    """Channels of the per-class temporal convolution."""
    class_embedding: int = 8
    """Learned per-class embedding, so shared micro weights still know the class."""
    z_dim: int = 256
    """Width of the fused shared representation z."""
    head_hidden: int = 128
    """Hidden width of the value stream and of each advantage branch."""
    scale_shared_grad: bool = True
    """Scale the gradient entering z from the heads by 1/(D+1) (BDQ paper, Sec. 3)."""
    preference_ensemble: int = 0
    """Members of the preference head on z (per-branch utilities u_d(z, a_d), trained with a
    Bradley-Terry loss on ranked segment pairs); 0 = no head. Christiano et al. used 3."""
    preference_hidden: int = 64
    """Hidden width of each preference-head member's branch MLPs."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "preference_ensemble":
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ConfigError(f"net.{f.name} must be an int >= 0, got {v!r}")
                continue
            if isinstance(v, int) and not isinstance(v, bool) and v < 1:
                raise ConfigError(f"net.{f.name} must be >= 1, got {v!r}")
        if self.sub_actions < 2:
            raise ConfigError(f"net.sub_actions must be >= 2, got {self.sub_actions!r}")

    SHAPE_FIELDS = ("macro_features", "num_classes", "history", "micro_features", "num_branches", "sub_actions")
    """The fields fixed by the simulator's observation and action spaces (the rest are sizes)."""

    @classmethod
    def for_sim(cls, sim_cfg, **overrides) -> "NetConfig":
        """Sizes matching a SimConfig's observation and action spaces."""
        from apex_bdq.sim import observation_sizes
        fm, fu = observation_sizes(sim_cfg)
        return cls(macro_features=fm, num_classes=sim_cfg.num_classes, history=sim_cfg.history,
                   micro_features=fu, num_branches=sim_cfg.num_branches,
                   sub_actions=sim_cfg.sub_actions, **overrides)


@dataclass(frozen=True)
class PreferenceConfig:
    """Preference alignment: ranked segment pairs train a Bradley-Terry head on z that
    regularises the representation, steers exploration and (optionally) shapes the reward."""

    enabled: bool = False
    """Record segments, rank them (oracle and/or people) and train the preference head."""
    beta: float = 0.5
    """Weight of the preference loss in the learner's loss: TD + beta * BT (0 = the head is
    not trained by the learner)."""
    explore_softmax: bool = True
    """Exploratory sub-actions are drawn from softmax(u_d / temperature) instead of uniformly."""
    temperature: float = 0.3
    """Temperature of that softmax, in utility units (a segment score is split over T x D
    utility terms, so one term is small)."""
    warmup_updates: int = 2000
    """Exploration and shaping use the utilities only once the learner has made this many
    updates (an untrained head would steer at random)."""
    shaping: float = 0.0
    """lambda: add lambda x (sum over branches of the action-centred utility u_d(z, a_d) -
    mean_a u_d(z, a)) to each decision's (scaled) reward. 0 = no shaping."""
    segment_decisions: int = 8
    """T: decisions per segment (8 x 30 ticks = 4 minutes of platform time by default)."""
    segments_per_emit: int = 2
    """Shards of each rollout worker that hand a segment to the preference actor every T
    decisions (the rest are not recorded: the store only needs a sample)."""
    store_segments: int = 2048
    """Unranked segments the preference actor keeps (oldest dropped first); ranked ones stay."""
    oracle_pairs: int = 400
    """Pairs the synthetic oracle ranks over a run (0 = people only)."""
    oracle_every: int = 4
    """Pairs the oracle ranks at most per call (one call per emitted batch of segments)."""
    oracle_pairs_per_min: float = 100.0
    """The oracle's pace, like a labeller's: after a first `min_pairs`, at most this many pairs
    per minute of the run, so late segments of the changing policy get ranked too; 0 = as
    fast as segments arrive."""
    oracle_error_rate: float = 0.1
    """Share of oracle answers given at random, as real labellers err."""
    oracle_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """Weights of (overload, unfairness, slo_violation) in the oracle's cost."""
    oracle_tie_margin: float = 0.01
    """Costs closer than this are a tie (label 0.5): most segments have no overload and no
    SLO breach, and a labeller does not tell fairness 0.9991 from 0.9993."""
    overload_utilisation: float = 0.9
    """A tick counts as overload when the shard's utilisation is above this."""
    query_candidates: int = 32
    """With an ensemble, the oracle is asked about the most disputed of this many random
    candidate pairs (ensemble disagreement); without one, about a random pair."""
    batch_pairs: int = 16
    """Pairs per preference batch."""
    update_every: int = 4
    """The learner adds the preference loss on every k-th update (it costs an encoder pass
    over 2 x batch_pairs x T decisions). A smaller k trains the head on its few ranked pairs
    more often: it steers harder and overfits them sooner."""
    min_pairs: int = 16
    """Ranked pairs needed before the learner adds the preference loss."""
    eval_pairs: int = 500
    """At the end of a run, random pairs of unranked segments the oracle labels only to
    measure the head's ranking accuracy precisely (not logged, not trained on; 0 = skip)."""
    log_path: Optional[str] = None
    """Durable feedback log (framed msgpack); None: runs/feedback/<run>.log by the launcher."""

    def __post_init__(self) -> None:
        _check(self.beta >= 0, f"pref.beta must be >= 0, got {self.beta!r}")
        _check(self.temperature > 0, f"pref.temperature must be > 0, got {self.temperature!r}")
        _check(self.shaping >= 0, f"pref.shaping must be >= 0, got {self.shaping!r}")
        for name in ("segment_decisions", "segments_per_emit", "store_segments", "oracle_every",
                     "query_candidates", "batch_pairs", "min_pairs", "update_every", "warmup_updates"):
            _check(getattr(self, name) >= 1, f"pref.{name} must be >= 1, got {getattr(self, name)!r}")
        _check(self.oracle_pairs >= 0, f"pref.oracle_pairs must be >= 0, got {self.oracle_pairs!r}")
        _check(self.eval_pairs >= 0, f"pref.eval_pairs must be >= 0, got {self.eval_pairs!r}")
        _check(isinstance(self.oracle_pairs_per_min, (int, float)) and 0 <= self.oracle_pairs_per_min < float("inf"),
               f"pref.oracle_pairs_per_min must be a finite number >= 0, got {self.oracle_pairs_per_min!r}")
        _check(self.oracle_tie_margin >= 0, f"pref.oracle_tie_margin must be >= 0, got {self.oracle_tie_margin!r}")
        _check(0 <= self.oracle_error_rate <= 1,
               f"pref.oracle_error_rate must be in [0, 1], got {self.oracle_error_rate!r}")
        _check(len(self.oracle_weights) == 3 and all(w >= 0 for w in self.oracle_weights),
               f"pref.oracle_weights must be 3 non-negative weights (overload, unfairness, slo_violation), "
               f"got {self.oracle_weights!r}")
        _check(0 < self.overload_utilisation <= 1,
               f"pref.overload_utilisation must be in (0, 1], got {self.overload_utilisation!r}")


def check_snapshot_settings(on_restart: str, every_s: float, directory: Optional[str]) -> None:
    """The replay durability settings (ClusterConfig, and each replay shard's ShardConfig);
    a ConfigError names the flag."""
    _check(on_restart in ("snapshot", "empty"),
           f"replay on-restart (--replay-on-restart) must be 'snapshot' or 'empty', got {on_restart!r}")
    _check(every_s >= 0, f"replay snapshot interval (--replay-snapshot-every) must be >= 0, got {every_s}")
    _check(every_s == 0 or bool(directory), "replay snapshots every few seconds (--replay-snapshot-every) need a "
                                            "snapshot directory (--replay-snapshot-dir)")


BACKENDS = ("ddp", "deepspeed", "accelerate")
"""Learner-group backends under Ray Train (learner/backends.py)."""


@dataclass(frozen=True)
class GuardConfig:
    """The guard around the learned policy on platform v2 (apex_bdq/guard.py): part of the
    policy, on in evaluation and serving, off while it explores. It bounds each learned
    decision in two ways: its sub-actions relative to the platform's default setting (plan
    1.3 x the monitored load, 300-s hold, admit everything), which needs only the
    observation and so runs behind Serve too; and, where replicas are computed (the
    simulator, the KEDA controller), its replicas relative to the best rules': the predictive rule's at margins
    `floor_margin` and `ceiling_margin` (its own default is 1.2), and static provisioning's at
    `static_ceiling` (docs/learning_v2.md §20). On a shard whose observation
    lies outside what training covered it falls back to the rules: the default setting's
    sub-actions and, where replicas are computed, the predictive rule's replicas."""

    enabled: bool = True
    plan_below: int = 1
    """Plan-factor levels the learned plan may sit below the default's (1: 1.15 vs 1.3)."""
    plan_above: int = 2
    """Plan-factor levels it may sit above (2: up to 1.75)."""
    max_admission: int = 0
    """Highest admission level allowed (0: admit everything, as the rule does)."""
    ood_margin: float = 0.25
    """A feature is outside training's coverage beyond [lo - m (hi - lo), hi + m (hi - lo)]."""
    floor_margin: float = 1.1
    """Each class keeps at least the replicas the predictive rule asks for at this margin (one
    step of its sweep below its default 1.2); 0: no floor."""
    ceiling_margin: float = 0.0
    """... and at most the replicas it asks for at this margin; 0: no ceiling."""
    static_ceiling: float = 0.75
    """Each class keeps at most the replicas static provisioning asks for at this target
    utilisation: the per-class peak offered load of the training days (the platform's past,
    in serving) over it, while the class's monitored load lies within that peak, and never
    below the floor; 0: no such ceiling. (A `ceiling_margin` ceiling wins over the floor.)"""

    def __post_init__(self) -> None:
        _check(self.plan_below >= 0 and self.plan_above >= 0,
               f"guard.plan_below / plan_above must be >= 0, got {self.plan_below!r} / {self.plan_above!r}")
        _check(self.max_admission >= 0, f"guard.max_admission must be >= 0, got {self.max_admission!r}")
        _check(self.ood_margin >= 0, f"guard.ood_margin must be >= 0, got {self.ood_margin!r}")
        for name in ("floor_margin", "ceiling_margin"):
            v = getattr(self, name)
            _check(not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0,
                   f"guard.{name} must be a number >= 0 (0: off), got {v!r}")
        v = self.static_ceiling
        _check(not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v) and 0 <= v <= 1,
               f"guard.static_ceiling must be a target utilisation in (0, 1] (0: off), got {v!r}")
        _check(not (self.floor_margin and self.ceiling_margin) or self.ceiling_margin >= self.floor_margin,
               f"guard.ceiling_margin ({self.ceiling_margin!r}) must not be below guard.floor_margin "
               f"({self.floor_margin!r})")


@dataclass(frozen=True)
class ClusterConfig:
    """How a distributed run is laid out on Ray: how many of each component, what each asks
    the scheduler for, how they talk, and how they recover. `launch.train`'s distributed
    flags set these (or `--set cluster.FIELD=VALUE`); a checkpoint records them."""

    num_actors: int = 2
    """Rollout actors."""
    num_replay_shards: int = 1
    num_learners: int = 1
    """Ray Train workers in the learner group."""
    backend: str = "ddp"
    """ddp | deepspeed | accelerate."""
    use_gpu: bool = False
    """Learners (and replay storage, replay_gpus per shard) on GPUs."""
    shards_per_actor: Optional[int] = None
    """Simulated shards per rollout actor (None: sim.num_shards split between the actors)."""
    actor_cpus: float = 1.0
    learner_cpus: float = 1.0
    """CPUs per learner worker (also its torch threads)."""
    replay_cpus: float = 0.0
    replay_gpus: float = 0.0
    """Fractional GPU per replay shard when use_gpu (storage and sum tree on the device)."""
    max_in_flight: int = 4
    """Unacknowledged replay inserts per actor before it waits (back-pressure)."""
    weight_pull_every: int = 10
    """Rollout actors ask the weight store for newer weights every this many decisions."""
    publish_every: int = 50
    """The learner publishes its weights every this many updates."""
    checkpoint_every_s: float = 60.0
    """Seconds between learner checkpoints (each copied to checkpoint_path as it lands)."""
    samples_per_insert: Optional[float] = None
    """Rate limiter: transitions sampled per transition inserted (None: off, Ape-X style)."""
    error_buffer: Optional[float] = None
    """Rate-limiter slack in sampled transitions (None: 4096 x samples_per_insert)."""
    use_placement_resources: bool = True
    """Ask for `rollout` / `learner` resource units (cluster.yaml's node types)."""
    max_restarts: int = 3
    """Restarts of each rollout actor, replay shard and the weight store, and learner-group
    failures Ray Train recovers from its last checkpoint (-1: no limit)."""
    storage_path: Optional[str] = None
    """Ray Train storage (checkpoints): a folder, or a URI (s3://, gs://, ...) taken as it is;
    None: a temp dir (refused on a multi-node cluster: apex_bdq/cluster_storage.py)."""
    storage_is_shared: bool = False
    """Vouch that storage_path and pref.log_path are on a filesystem every node mounts at the
    same path, when the multi-node check does not recognise its type."""
    checkpoint_path: Optional[str] = None
    """Each new learner checkpoint is copied here as it lands (the file --resume reads)."""
    replay_snapshot_dir: Optional[str] = None
    """Replay shards snapshot their memory here (and a resume loads the snapshots)."""
    replay_snapshot_every_s: float = 0.0
    """Seconds between replay snapshots (0: none)."""
    replay_on_restart: str = "snapshot"
    """What a restarted replay shard comes back with: its last snapshot ("snapshot", else
    empty) or "empty"."""

    def __post_init__(self) -> None:
        for k in ("num_actors", "num_replay_shards", "num_learners", "max_in_flight", "weight_pull_every",
                  "publish_every"):
            _check(getattr(self, k) >= 1, f"--{k.replace('_', '-')} must be >= 1 (cluster.{k}), got {getattr(self, k)}")
        _check(self.backend in BACKENDS, f"unknown backend {self.backend!r}: choose from {', '.join(BACKENDS)}")
        _check(self.shards_per_actor is None or self.shards_per_actor >= 1,
               f"--shards-per-actor must be >= 1 (cluster.shards_per_actor), got {self.shards_per_actor}")
        _check(self.max_restarts >= -1,
               f"--max-restarts must be >= -1 (-1: no limit; cluster.max_restarts), got {self.max_restarts}")
        _check(self.samples_per_insert is None or self.samples_per_insert > 0,
               f"--samples-per-insert must be > 0 (cluster.samples_per_insert), got {self.samples_per_insert}")
        _check(self.checkpoint_every_s > 0,
               f"--checkpoint-every must be > 0 (cluster.checkpoint_every_s), got {self.checkpoint_every_s}")
        check_snapshot_settings(self.replay_on_restart, self.replay_snapshot_every_s, self.replay_snapshot_dir)

    @property
    def limiter_slack(self) -> float:
        """The rate limiter's error buffer in sampled transitions."""
        if self.error_buffer is not None:
            return float(self.error_buffer)
        return 4096.0 * (self.samples_per_insert or 0.0)

    def replace(self, **kw) -> "ClusterConfig":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; a checkpoint stores it whole."""

    sim: SimConfig = field(default_factory=lambda: SimConfig(num_shards=64, seed=1))
    net: Optional[NetConfig] = None
    """None: sized from `sim`."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    pref: PreferenceConfig = field(default_factory=PreferenceConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The learned policy's guard in evaluation and serving (platform v2)."""
    """The distributed layout (ignored by `--local` runs)."""
    minutes: float = 9.0
    """Wall-clock budget for collection, learning and the periodic evaluations (the final
    evaluation comes after). With `updates` set it is only a cap: the run ends at whichever
    comes first, and its result says which (`stopped_by`)."""
    updates: Optional[int] = None
    """The run's budget of record: learner updates of this invocation (None: the time budget
    alone). A figure measured at N updates reproduces on a machine of any speed; one measured
    in minutes moves with the machine (this VM's speed drifts +-3x between days)."""
    max_env_ticks: Optional[int] = None
    """Stop after this many simulator ticks (None: only the time budget)."""
    eval_every_s: float = 120.0
    """Seconds between evaluations on a slice of the held-out range during training."""
    eval_ticks: int = 600
    """Ticks per shard of those periodic evaluations (the final one covers the whole range)."""
    eval_shards: int = 64
    """Segments of the held-out range in every evaluation (each starts at its own phase)."""
    final_eval_ticks: Optional[int] = None
    """Ticks per shard of the final evaluation (None: the whole held-out range)."""
    final_eval_replicas: int = 2
    """Copies of the held-out range in the final evaluation, each with its own Poisson
    arrivals. On v2 the 7 held-out days give 40,320 settled class-windows per copy; the
    final evaluation uses the yardstick's layout (64 segments x 2 copies), so the learned
    policy meets the same arrivals as every point of the rules' frontiers. (Platform v1's
    one-day trace gives 1,440 per copy: it used 8 segments x 64 copies.)"""
    seed: int = 0
    torch_threads: int = 2

    def __post_init__(self) -> None:
        _check(self.minutes > 0, f"train.minutes must be > 0, got {self.minutes!r}")
        _check(self.updates is None or (isinstance(self.updates, int) and self.updates >= 1),
               f"train.updates must be an int >= 1 (or none), got {self.updates!r}")
        _check(self.eval_ticks >= 1 and self.eval_shards >= 1, "train.eval_ticks and eval_shards must be >= 1")
        _check(self.final_eval_replicas >= 1, f"train.final_eval_replicas must be >= 1, got {self.final_eval_replicas!r}")
        _check(self.sim.episode_ticks % self.agent.decision_ticks == 0,
               f"train: episode length {self.sim.episode_ticks} ticks is not a multiple of "
               f"agent.decision_ticks={self.agent.decision_ticks} (the last held block would be cut short)")
        _check(self.sim.sub_actions <= 256, f"train: sub_actions={self.sim.sub_actions} does not fit the uint8 "
                                            "action field of replay (at most 256)")
        if self.net is None:
            object.__setattr__(self, "net", NetConfig.for_sim(self.sim))
        if self.pref.enabled and self.net.preference_ensemble == 0:  # the head the feedback trains
            object.__setattr__(self, "net", dataclasses.replace(self.net, preference_ensemble=3))
        want = NetConfig.for_sim(self.sim)
        for f in NetConfig.SHAPE_FIELDS:
            _check(getattr(self.net, f) == getattr(want, f),
                   f"train.net.{f}={getattr(self.net, f)} does not match the simulator ({getattr(want, f)})")


# Fields of experiments removed from the code (docs/removed_experiments.md), per section:
# name -> (the value that meant "off", or _ANY for a setting read only when its switch was on;
# the last commit that had it). A saved config (checkpoint) still loads when they are off; one
# that turned a removed experiment on is refused, since this code would no longer do what it
# was trained with.
_ANY = object()
_A1 = "a1f8305"
REMOVED_FIELDS: dict[str, dict[str, tuple[Any, str]]] = {
    "net": {"quantiles": (0, "cf3bf41"), "action_band": ((), "84ed603")},
    "agent": {"warmup_uniform": (False, _A1),
              "slo_target_vs_hpa": (None, _A1), "slo_penalty_step": (_ANY, _A1), "slo_penalty_bounds": (_ANY, _A1),
              "explore_hold_mu": (0.0, _A1), "explore_max_hold": (_ANY, _A1),
              "policy_ema": (0.0, "43b3d27")},
    "pref": {"greedy_tolerance": (0.0, "c166e8d"), "oracle_slo": ("tick", "87e2800"),
             "steer_greedy": (0.0, "15b07fd")},
    "guard": {"in_training": (False, "84ed603")},
    "train": {"constraint_every_s": (_ANY, _A1), "constraint_shards": (_ANY, _A1), "constraint_replicas": (_ANY, _A1),
              "constraint_ticks": (_ANY, _A1), "select_every_s": (None, _A1), "select_violation_vs_hpa": (_ANY, _A1)},
}


def drop_removed_fields(section: str, d: Any) -> dict:
    """`d` (a saved config section: "net", "agent", "pref", "guard" or "train") without the
    fields of removed experiments; ConfigError if one of them was switched on."""
    if not isinstance(d, dict):
        raise ConfigError(f"config section {section!r} is {type(d).__name__}, expected a mapping")
    out = dict(d)
    for name, (off, commit) in REMOVED_FIELDS[section].items():
        if name not in out:
            continue
        val = out.pop(name)
        if off is not _ANY and (tuple(val) if isinstance(val, list) else val) != off:
            prefix = "" if section == "train" else f"{section}."
            raise ConfigError(f"this config sets {prefix}{name}={val!r}, an experiment removed after commit {commit} "
                              "(docs/removed_experiments.md): restore it from that commit with git to use it")
    return out


def _section(cls: type, d: Any, section: str) -> Any:
    """`cls(**d)` for one saved config section, with a ConfigError naming the section and the
    keys this version does not know (a config saved by a newer version, or by an experiment
    that has since been removed) instead of a bare TypeError."""
    if not isinstance(d, dict):
        raise ConfigError(f"config section {section!r} is {type(d).__name__}, expected a mapping")
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        where = "the top level" if section == "train" else f"section {section!r}"
        raise ConfigError(f"unknown config keys at {where}: {unknown}; saved by another (older or newer) version "
                          "of apex-bdq")
    return cls(**d)


def net_config_from_dict(d: dict) -> NetConfig:
    """A NetConfig from `dataclasses.asdict` output (a checkpoint's "net")."""
    return _section(NetConfig, drop_removed_fields("net", d), "net")


def train_config_from_dict(d: dict) -> TrainConfig:
    """A TrainConfig from `dataclasses.asdict` output (a checkpoint's "config"); ConfigError
    naming what does not fit (a removed experiment switched on, a key this version does not
    know, a value its checks refuse)."""
    if not isinstance(d, dict):
        raise ConfigError(f"a saved config is a mapping, got {type(d).__name__}")
    d = drop_removed_fields("train", d)
    for need in ("sim", "net", "agent"):
        if need not in d:
            raise ConfigError(f"a saved config has no {need!r} section")
    sim = sim_config_from_dict(d.pop("sim"))
    net = net_config_from_dict(d.pop("net"))
    agent = _section(AgentConfig, drop_removed_fields("agent", d.pop("agent")), "agent")
    pref = drop_removed_fields("pref", d.pop("pref", None) or {})
    if "oracle_weights" in pref:
        pref["oracle_weights"] = tuple(pref["oracle_weights"])
    cluster = _section(ClusterConfig, d.pop("cluster", None) or {}, "cluster")  # none before 2026-12-02
    guard = _section(GuardConfig, drop_removed_fields("guard", d.pop("guard", None) or {}), "guard")  # none before
    # 2026-12-02 (evening)
    return _section(TrainConfig, {**d, "sim": sim, "net": net, "agent": agent, "cluster": cluster, "guard": guard,
                                  "pref": _section(PreferenceConfig, pref, "pref")}, "train")


def _parse_override(key: str, raw: str, hint: Any) -> Any:
    """`raw` parsed as the declared type of the field `key` names: bool, int, float, str,
    Optional[X] ("none" = None) or a tuple of them (comma separated, e.g. 1,10,1)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if raw.strip().lower() == "none":
            return None
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    if typing.get_origin(hint) is tuple:
        elems = typing.get_args(hint)
        parts = [x.strip() for x in raw.split(",")]
        if len(elems) == 2 and elems[1] is Ellipsis:
            elems = (elems[0],) * len(parts)
        if len(parts) != len(elems):
            raise ConfigError(f"override {key!r}: {raw!r} has {len(parts)} comma-separated values, the field "
                              f"takes {len(elems)}")
        return tuple(_parse_override(key, x, e) for x, e in zip(parts, elems))
    try:
        if hint is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if hint in (int, float):
            return hint(raw)
        if hint is str:
            return raw
    except ValueError:
        raise ConfigError(f"override {key!r}: {raw!r} is not a valid {hint.__name__}") from None
    raise ConfigError(f"override {key!r}: a field of type {hint} cannot be set from the command line")


def apply_overrides(cfg: TrainConfig, items: list[str]) -> TrainConfig:
    """Apply `section.key=value` overrides (sections: sim, agent, net, pref, cluster,
    sim.trace, or none for the top level), parsing each value as the type of the field it replaces.
    Unknown keys and values that do not parse raise ConfigError naming them."""
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. agent.lr=3e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        sections, name = parts[:-1], parts[-1]
        if sections not in ([], ["sim"], ["agent"], ["net"], ["pref"], ["cluster"], ["sim", "trace"],
                            ["sim", "augment"], ["guard"]):
            raise ConfigError(f"override key {key!r}: use NAME or sim.NAME, agent.NAME, net.NAME, pref.NAME, "
                              "cluster.NAME, guard.NAME, sim.trace.NAME, sim.augment.NAME")
        chain = [cfg]  # the dataclasses from the top down to the one holding `name`
        for sec in sections:
            chain.append(getattr(chain[-1], sec))
        target = chain[-1]
        names = {f.name for f in dataclasses.fields(target)}
        if name not in names:
            raise ConfigError(f"override {key!r}: {type(target).__name__} has no field {name!r} "
                              f"(fields: {', '.join(sorted(names))})")
        val = _parse_override(key, raw, typing.get_type_hints(type(target))[name])
        new = dataclasses.replace(target, **{name: val})
        for parent, sec in zip(reversed(chain[:-1]), reversed(sections)):  # rebuild upwards
            new = dataclasses.replace(parent, **{sec: new})
        cfg = new
    return cfg
