"""Live telemetry -> the observation a platform v2 policy was trained on, from Prometheus.

`TelemetryReader.read(t)` runs a fixed set of PromQL queries over Prometheus' HTTP API
(`/api/v1/query`, `/api/v1/query_range`; concurrently, each with a deadline) and builds the
macro and micro observation with `apex_bdq.features` — the functions the simulator builds
its own with — from
  per class (app metrics, label `class_label`):  request, refusal and SLO-miss counters, busy
    replica-seconds, requests in flight, queue length, the latency histogram (p99 per tick
    by `histogram_quantile`);
  per Deployment (kube-state-metrics, label `deployment_label`): replicas asked for, existing,
    ready;
  the policy's own state (the plan / hold / admission levels it set), from the caller.
What the simulator models, the reader measures: "monitored" signals are averages over the
metrics lag window read one lag late (metrics-server's resolution), the coarse history is
`increase()` over 2-minute blocks on the clock, the seasonal inputs `rate()` a day and a week
earlier (what `offset 1d` gives). Beside the observation each reading carries the predictive
rule's forecast (`baselines.seasonal_forecast`: the peak rate over the next provisioning delay
plus one sync a week back, else a day back, times the level correction over the last 30
minutes), which the controller's predictive rule and the guard's replica floor size. Metric
names and selectors are configurable per service
(`TelemetryConfig`).

Nothing is guessed: a series that is missing for a class, older than `stale_s`, a query that
fails or misses its deadline, or a value that is not finite makes the reading carry a
problem (`Reading.problems`) and no observation; the controller then falls back to the rule
(`apex_bdq.control`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.features import Scales, macro_v2, micro_frame_v2
from apex_bdq.sim.baselines import LEVEL_WINDOW_S, PREDICTIVE_PERIOD_S, seasonal_forecast
from apex_bdq.sim.platform import Observation

DAY_S, WEEK_S = 86400, 7 * 86400
SEASON_WINDOW_S = 60  # rate() window of the seasonal inputs, centred on the lead
PEAK_RATE_S = 300  # rate() window and step of the static ceiling's peak (the traces' 5-min resolution)
EMA_SPAN = 6  # monitored signals: an exponential average over EMA_SPAN x the lag of per-tick samples
COUNTERS = ("busy", "requests", "late", "refused")  # queried raw per series, differenced per series
RULE_INPUTS = ("busy", "ready_mon", "ready", "spec", "series_kube", "series_app", "kube", "app", "age_kube")
# What the predictive rule reads: the monitored requests in flight (the rate of the moment)
# and its forecast's inputs (the coarse history, the peak ahead and the level a day / week back).
PREDICTIVE_INPUTS = ("in_flight", "coarse", "series_app", "app", "age_app")


class TelemetryError(ValueError):
    """A bad telemetry config."""


@dataclass(frozen=True)
class MetricNames:
    """The series the reader queries (defaults: what `ReplayPlatform` exports; kube_* are
    kube-state-metrics' names)."""

    requests: str = "apex_requests_total"
    refused: str = "apex_requests_refused_total"
    late: str = "apex_requests_late_total"
    busy: str = "apex_replica_busy_seconds_total"
    in_flight: str = "apex_requests_in_flight"
    queue: str = "apex_queue_length"
    latency: str = "apex_request_duration_seconds"
    spec: str = "kube_deployment_spec_replicas"
    exist: str = "kube_deployment_status_replicas"
    ready: str = "kube_deployment_status_replicas_ready"


@dataclass(frozen=True)
class TelemetryConfig:
    """Where one service's telemetry lives and how its classes map to series. The micro
    observation is per tick (1 s): its series must be scraped once a tick.

    classes: the `class_label` value of each request class, in the policy's class order;
    deployments: the `deployment_label` value of each class's Deployment (same order);
    selector / kube_selector: extra label matchers (PromQL, without braces);
    clock_offset_s: added to Unix time before the time of day and week are taken (the
    traffic's time zone); stale_s: a series whose newest sample is older is stale;
    timeout_s: deadline of the whole reading."""

    url: str
    classes: tuple[str, ...]
    deployments: tuple[str, ...]
    class_label: str = "class"
    deployment_label: str = "deployment"
    selector: str = ""
    kube_selector: str = ""
    metrics: MetricNames = field(default_factory=MetricNames)
    clock_offset_s: float = 0.0
    stale_s: float = 60.0
    timeout_s: float = 2.0
    workers: int = 6
    peak_window_s: float = 7 * 86400.0
    """The past the guard's static ceiling reads each class's peak 5-min rate over (the
    simulator's reads the training days)."""
    p99_window_s: Optional[int] = None
    """Window of the per-tick latency histogram's increase() (default: one tick, which holds
    two samples under Prometheus 2's closed ranges when it scrapes once a tick; Prometheus 3
    ranges are open on the left: use two ticks there)."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise TelemetryError(f"telemetry url must be http(s)://..., got {self.url!r}")
        if len(self.classes) == 0 or len(self.classes) != len(self.deployments):
            raise TelemetryError(f"classes ({len(self.classes)}) and deployments ({len(self.deployments)}) need one "
                                 f"entry per class")
        if len(set(self.classes)) != len(self.classes) or len(set(self.deployments)) != len(self.deployments):
            raise TelemetryError("class and deployment names must be unique")
        for name in ("stale_s", "timeout_s", "peak_window_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise TelemetryError(f"telemetry {name} must be > 0, got {v!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "TelemetryConfig":
        d = dict(d)
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - allowed
        if unknown:
            raise TelemetryError(f"unknown telemetry keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        if "metrics" in d:
            m = dict(d["metrics"])
            bad = set(m) - {f.name for f in dataclasses.fields(MetricNames)}
            if bad:
                raise TelemetryError(f"unknown metric names {sorted(bad)}")
            d["metrics"] = MetricNames(**m)
        for k in ("classes", "deployments"):
            if k in d:
                d[k] = tuple(d[k])
        if "url" not in d or "classes" not in d or "deployments" not in d:
            raise TelemetryError("telemetry needs url, classes and deployments")
        return cls(**d)


@dataclass
class Reading:
    """One reading at platform time `t`: the observation (None when a problem stops it),
    what HPA's rule reads (utilisation and ready replicas per class), the replicas asked for,
    the problems found, the seconds the queries took, and the monitored requests in flight."""

    t: float
    obs: Optional[Observation]
    utilisation: Optional[np.ndarray]
    ready: Optional[np.ndarray]
    spec: Optional[np.ndarray]
    problems: list[str]
    query_s: float
    in_flight: Optional[np.ndarray] = None  # [K] monitored requests in flight (what the plan sizes for)
    fetch_s: float = 0.0  # of query_s: until every query had answered (the rest builds the features)
    forecast: Optional[np.ndarray] = None  # [K] the predictive rule's forecast peak rate (0: no past day)
    forecast_problems: list = field(default_factory=list)  # why `forecast` / `peak` is None (their queries failed)
    peak: Optional[np.ndarray] = None  # [K] each class's highest 5-min rate over peak_window_s (NaN: no series)

    @property
    def ok(self) -> bool:
        return not self.problems and self.obs is not None


class TelemetryReader:
    """Builds platform v2 observations for `sim`'s layout from `tel`'s Prometheus."""

    def __init__(self, tel: TelemetryConfig, sim: SimConfig) -> None:
        if sim.platform != "v2":
            raise TelemetryError("the telemetry reader builds platform v2 observations")
        if len(tel.classes) != sim.num_classes:
            raise TelemetryError(f"telemetry names {len(tel.classes)} classes, the policy has {sim.num_classes}")
        self.tel, self.sim = tel, sim
        self.sc = Scales(sim)
        self.K, self.H = sim.num_classes, sim.history
        self.step = int(round(sim.tick_s))
        if self.step != sim.tick_s or self.step < 1:
            raise TelemetryError(f"the reader reads one sample per tick: sim.tick_s must be a whole number of seconds, "
                                 f"got {sim.tick_s}")
        self.lag_ticks = max(1, sim.lag_ticks)
        self.lag = self.lag_ticks * self.step
        self.W = int(round(sim.accounting_window_s))
        self.cb = int(round(sim.coarse_block_s))
        self.soon = max(1, sim.delay_ticks // 2) * self.step
        from apex_bdq.sim.platform_v2 import MACRO_GLOBAL_V2, macro_names
        self.n_macro = len(macro_names(sim))
        self.n_per_class = (self.n_macro - len(MACRO_GLOBAL_V2)) // sim.num_classes
        self.cls_index = {c: k for k, c in enumerate(tel.classes)}
        self.dep_index = {d: k for k, d in enumerate(tel.deployments)}
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=tel.workers, thread_name_prefix="promql")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- HTTP --------------------------------------------------------------------------------------
    def _session(self):
        s = getattr(self._local, "s", None)
        if s is None:
            import requests
            s = self._local.s = requests.Session()
        return s

    def _get(self, path: str, params: dict, deadline: float) -> dict:
        import requests
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed before the query was sent")
        try:
            r = self._session().get(f"{self.tel.url}{path}", params=params, timeout=left)
        except requests.Timeout as e:
            raise TimeoutError(str(e)) from e
        doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 200 or doc.get("status") != "success":
            raise RuntimeError(f"HTTP {r.status_code}: {doc.get('error', r.text[:200])}")
        return doc["data"]

    # -- query building ----------------------------------------------------------------------------
    def _sel(self, metric: str, kube: bool = False, extra: str = "") -> str:
        tel = self.tel
        base = tel.kube_selector if kube else tel.selector
        parts = [p for p in (base, extra) if p]
        return f"{metric}{{{', '.join(parts)}}}"

    def _by(self, kube: bool) -> str:
        return self.tel.deployment_label if kube else self.tel.class_label

    def queries(self, t: int) -> dict:
        """name -> (kind, PromQL, kube?, params) for a reading at time t."""
        m, H, st, lag = self.tel.metrics, self.H, self.step, self.lag
        c, d = self._by(False), self._by(True)
        inst = {"time": t}
        hist = {"start": t - (H - 1) * st, "end": t, "step": st}
        mon = {"start": t - lag - EMA_SPAN * lag, "end": t - lag, "step": st}
        back = {"start": t - (H + 2 * self.W) * st, "end": t, "step": st}
        blk_end = (t // self.cb) * self.cb
        coarse = {"start": blk_end - (self.sim.coarse_history - 1) * self.cb, "end": blk_end, "step": self.cb}
        q = {
            "in_flight": ("r", f"sum by ({c}) ({self._sel(m.in_flight)})", False, mon),
            "busy": ("r", self._sel(m.busy), False, mon),
            "ready_mon": ("r", f"sum by ({d}) ({self._sel(m.ready, True)})", True, mon),
            "exist_soon": ("q", f"sum by ({d}) ({self._sel(m.exist, True)} offset {self.soon}s)", True, inst),
            "spec": ("q", f"sum by ({d}) ({self._sel(m.spec, True)})", True, inst),
            "ready": ("r", f"sum by ({d}) ({self._sel(m.ready, True)})", True, hist),
            "exist": ("r", f"sum by ({d}) ({self._sel(m.exist, True)})", True, hist),
            "queue": ("r", f"sum by ({c}) ({self._sel(m.queue)})", False, hist),
            "p99": ("r", f"histogram_quantile(0.99, sum by ({c}, le) (increase({self._sel(m.latency + '_bucket')}"
                         f"[{self.tel.p99_window_s or st}s])))", False, hist),
            "requests": ("r", self._sel(m.requests), False, back),
            "late": ("r", self._sel(m.late), False, back),
            "refused": ("r", self._sel(m.refused), False, back),
            "coarse": ("r", f"sum by ({c}) (increase({self._sel(m.requests)}[{self.cb}s])) / {self.cb}", False, coarse),
            "age_app": ("q", f"max by ({c}) ({t} - timestamp({self._sel(m.requests)}))", False, inst),
            "age_kube": ("q", f"max by ({d}) ({t} - timestamp({self._sel(m.ready, True)}))", True, inst),
        }
        half = SEASON_WINDOW_S // 2
        per, lw = int(PREDICTIVE_PERIOD_S), int(LEVEL_WINDOW_S)
        # static provisioning's peak (the guard's static ceiling): the highest 5-min rate of the past window
        q["fc_history_peak"] = ("q", f"max_over_time((sum by ({c}) (rate({self._sel(m.requests)}[{PEAK_RATE_S}s])))"
                                     f"[{int(self.tel.peak_window_s)}s:{PEAK_RATE_S}s])", False, inst)
        # the forecast's horizon, as the simulator's rule counts it: one provisioning delay and one sync
        hz = (max(1, self.sim.delay_ticks) + max(1, int(round(PREDICTIVE_PERIOD_S / self.sim.tick_s)))) * self.step
        for name, off in (("1d", DAY_S), ("7d", WEEK_S)):
            # The peak of the rate (over SEASON_WINDOW_S, centred) over [t - off, t - off + hz],
            # and the mean rate over the level window ending at t - off.
            rate = f"sum by ({c}) (rate({self._sel(m.requests)}[{SEASON_WINDOW_S}s]))"
            q[f"fc_peak_{name}"] = ("q", f"max_over_time(({rate})[{hz}s:{per}s] offset {off - hz - half}s)", False, inst)
            q[f"fc_then_{name}"] = ("q", f"sum by ({c}) (increase({self._sel(m.requests)}[{lw}s] offset {off}s)) / {lw}",
                                    False, inst)
            for j, lead in enumerate(self.sim.seasonal_leads_s):
                o = int(off - lead - half)
                q[f"season_{name}_{j}"] = ("q", f"sum by ({c}) (rate({self._sel(m.requests)}[{SEASON_WINDOW_S}s] "
                                                f"offset {o}s))", False, inst)
        return q

    # -- reading -----------------------------------------------------------------------------------
    def _run(self, kind: str, expr: str, params: dict, deadline: float) -> dict:
        params = dict(params, query=expr)
        return self._get("/api/v1/query" if kind == "q" else "/api/v1/query_range", params, deadline)

    def _vector(self, data: dict, kube: bool) -> dict:
        idx = self.dep_index if kube else self.cls_index
        label = self._by(kube)
        out = {}
        for r in data.get("result", []):
            k = idx.get(r["metric"].get(label))
            if k is not None:
                out[k] = float(r["value"][1])
        return out

    def read(self, t: Optional[float] = None, levels: Optional[dict] = None) -> Reading:
        """A reading at Unix time t (default: now, whole seconds). levels: the policy's
        sub-actions in force {"plan": [K], "hold": [K], "admission": int} (default: the
        platform's default setting)."""
        from apex_bdq.sim.platform_v2 import default_action_v2
        t0 = time.monotonic()
        t = int(time.time()) if t is None else int(t)
        deadline = t0 + self.tel.timeout_s
        K = self.K
        if levels is None:
            d = default_action_v2(self.sim)
            levels = {"plan": np.asarray(d[:K]), "hold": np.asarray(d[K:2 * K]), "admission": d[-1]}
        qs = self.queries(t)
        futures = {name: self._pool.submit(self._run, kind, expr, params, deadline)
                   for name, (kind, expr, _, params) in qs.items()}
        problems: list[str] = []
        failed: set = set()
        res: dict = {}
        for name, f in futures.items():
            try:
                res[name] = f.result(timeout=max(deadline - time.monotonic(), 0.0) + 0.05)
            except (TimeoutError, Exception) as e:  # noqa: BLE001 - every failure is reported by name
                kind = "timeout" if isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ else "query_failed"
                problems.append(f"{kind}:{name}: {str(e)[:160]}")
                failed.add(name)
        return self._assemble(t, qs, res, levels, problems, t0, time.monotonic() - t0, failed)

    def _series(self, data: dict, kube: bool, times: np.ndarray) -> dict:
        """{class or deployment index: [one row per series]} of a range query's result, each
        row the series' values at `times` (NaN where it has none)."""
        idx = self.dep_index if kube else self.cls_index
        label = self._by(kube)
        pos = {int(round(t)): i for i, t in enumerate(times)}
        out: dict = {}
        for r in data.get("result", []):
            k = idx.get(r["metric"].get(label))
            if k is None:
                continue
            row = np.full(len(times), np.nan)
            for ts, v in r["values"]:
                i = pos.get(int(round(float(ts))))
                if i is not None:
                    row[i] = float(v)
            out.setdefault(k, []).append(row)
        return out

    def _matrix(self, data: dict, kube: bool, times: np.ndarray) -> dict:
        """{index: row} of a range query summed by class / deployment (one series each)."""
        return {k: rows[0] for k, rows in self._series(data, kube, times).items()}

    def _increments(self, data: dict, times: np.ndarray) -> dict:
        """{class: [len(times) - 1] summed per-step increases} from raw counter series: each
        series differenced on its own (a drop is a reset: the value after it is the increase),
        a step where a series has no sample on either side adds nothing for it."""
        raw = self._series(data, False, times)
        out: dict = {}
        for k, rows in raw.items():
            tot = np.zeros(len(times) - 1)
            complete = np.zeros(len(times) - 1, dtype=bool)
            for row in rows:
                d = np.diff(row)
                d = np.where(d < 0, row[1:], d)
                ok = np.isfinite(d)
                tot += np.where(ok, d, 0.0)
                complete |= ok
            out[k] = np.where(complete, tot, np.nan)  # no series of the class at a step: missing
        return out

    def _need(self, vec: dict, name: str, kube: bool, problems: list) -> np.ndarray:
        names = self.tel.deployments if kube else self.tel.classes
        out = np.zeros(self.K)
        if vec is None:  # its query failed: reported already
            return out
        for k in range(self.K):
            v = vec.get(k)
            if v is None:
                problems.append(f"missing:{name}:{names[k]}")
            elif not math.isfinite(v):
                problems.append(f"not_finite:{name}:{names[k]}")
            else:
                out[k] = v
        return out

    def _need_rows(self, mat: dict, name: str, kube: bool, problems: list, n: int) -> np.ndarray:
        names = self.tel.deployments if kube else self.tel.classes
        out = np.zeros((n, self.K))
        if mat is None:  # its query failed: reported already
            return out
        for k in range(self.K):
            row = mat.get(k)
            if row is None or np.isnan(row).any():
                problems.append(f"missing:{name}:{names[k]}")
            else:
                out[:, k] = row
        return out

    def _assemble(self, t: int, qs: dict, res: dict, levels: dict, problems: list, t0: float,
                  fetch_s: float, failed: set) -> Reading:
        K, H, st, W = self.K, self.H, self.step, self.W
        sc = self.sc
        # The forecast's own queries do not stop the observation: a failed one leaves the
        # reading without the forecast (`forecast_problems`), and the policy still decides.
        fc_failed = {n for n in failed if n.startswith("fc_")}
        fc_problems = [p for p in problems if p.split(":")[1] in fc_failed]
        problems = [p for p in problems if p.split(":")[1] not in fc_failed]
        vec = {n: (self._vector(res[n], qs[n][2]) if n in res else None)
               for n, (kind, *_rest) in qs.items() if kind == "q"}
        # Freshness first: a stale series would still answer from the lookback window.
        for name, kube in (("age_app", False), ("age_kube", True)):
            age = self._need(vec[name], name.replace("age_", "series_"), kube, problems)
            names = self.tel.deployments if kube else self.tel.classes
            for k in np.nonzero(age > self.tel.stale_s)[0]:
                problems.append(f"stale:{name.replace('age_', '')}:{names[k]}: newest sample {age[k]:.0f} s old")
        hist_t = np.arange(t - (H - 1) * st, t + 1, st)
        mon_t = np.arange(t - self.lag - EMA_SPAN * self.lag, t - self.lag + 1, st)
        back_t = np.arange(t - (H + 2 * W) * st, t + 1, st)
        blk_end = (t // self.cb) * self.cb
        coarse_t = np.arange(blk_end - (self.sim.coarse_history - 1) * self.cb, blk_end + 1, self.cb)
        grid = {"ready": hist_t, "exist": hist_t, "queue": hist_t, "p99": hist_t, "coarse": coarse_t,
                "in_flight": mon_t, "busy": mon_t, "ready_mon": mon_t}
        mat = {n: (self._matrix(res[n], qs[n][2], grid.get(n, back_t)) if n in res else None)
               for n, (kind, *_rest) in qs.items() if kind == "r" and n not in COUNTERS}
        # Counters come per series (per pod) and are differenced per series before the sum
        # by class: a pod that restarts or goes away is a reset of its own series only.
        inc = {n: (self._increments(res[n], grid.get(n, back_t)) if n in res else None) for n in COUNTERS}
        n_mon = len(mon_t)
        in_flight_h = self._need_rows(mat["in_flight"], "in_flight", False, problems, n_mon)
        busy_inc = self._need_rows(inc["busy"], "busy", False, problems, n_mon - 1)
        ready_m = self._need_rows(mat["ready_mon"], "ready_mon", True, problems, n_mon)
        # What a metrics pipeline reports, one lag late: an exponential average (weight 1/lag
        # per tick) of requests in flight and of the busy share of the ready replicas.
        in_flight = ema(in_flight_h[1:], 1.0 / self.lag_ticks)
        util_now = ema(np.clip(busy_inc / st / np.maximum(ready_m[1:], 1.0), 0.0, 1.0), 1.0 / self.lag_ticks)
        exist_soon = self._need(vec["exist_soon"], "exist_soon", True, problems)
        spec = self._need(vec["spec"], "spec", True, problems)
        ready_h = self._need_rows(mat["ready"], "ready", True, problems, H)
        exist_h = self._need_rows(mat["exist"], "exist", True, problems, H)
        queue_h = self._need_rows(mat["queue"], "queue", False, problems, H)
        n_inc = len(back_t) - 1
        inc_req = self._need_rows(inc["requests"], "requests", False, problems, n_inc)
        inc_late = self._need_rows(inc["late"], "late", False, problems, n_inc)
        inc_ref = self._need_rows(inc["refused"], "refused", False, problems, n_inc)
        coarse = self._need_rows(mat["coarse"], "coarse", False, problems, len(coarse_t))
        p99 = np.full((H, K), np.nan)
        if mat["p99"] is not None:
            for k in range(K):
                if k in mat["p99"]:
                    p99[:, k] = mat["p99"][k]
                elif inc_req[-H:, k].sum() > 0:  # requests arrived, but no latency histogram for the class
                    problems.append(f"missing:p99:{self.tel.classes[k]}")
        # A tick without admitted requests has no latency to read: an idle class's p99 is its service time.
        p99 = np.where(np.isfinite(p99), p99, 1.0 / sc.mu[None, :].astype(np.float64))
        season = {}
        ok = {}
        for name in ("1d", "7d"):
            rows = []
            present = True
            for j in range(len(self.sim.seasonal_leads_s)):
                v = vec[f"season_{name}_{j}"] or {}
                if len(v) < K:
                    present = False
                rows.append([v.get(k, 0.0) for k in range(K)])
            ok[name] = float(present)
            season[name] = np.asarray(rows, dtype=np.float64)[None] * present  # [1, J, K]
        forecast = None if fc_failed - {"fc_history_peak"} else self._forecast(vec, coarse)
        hp = vec.get("fc_history_peak")
        peak = None if hp is None else np.array([hp.get(k, np.nan) for k in range(K)], dtype=np.float64)
        if problems:
            # The rules (HPA on utilisation and ready replicas; the predictive rule on requests
            # in flight and its forecast) may still have their inputs.
            kinds = {p.split(":")[1] for p in problems}
            rule_ok = not kinds & set(RULE_INPUTS)
            pred_ok = not kinds & set(PREDICTIVE_INPUTS)
            return Reading(t, None, util_now if rule_ok else None, ready_h[-1] if rule_ok else None,
                           spec if rule_ok else None, problems, time.monotonic() - t0, fetch_s=fetch_s,
                           in_flight=in_flight if pred_ok else None, forecast=forecast if pred_ok else None,
                           forecast_problems=fc_problems, peak=peak)

        n_back = len(back_t)
        # Window-to-date late and offered requests at each of the last H ticks; the last closed window.
        win_late = np.zeros((H, K))
        win_req = np.zeros((H, K))
        for h, th in enumerate(hist_t):
            ws = (th // W) * W
            i_end, i_ws = n_back - H + h, n_back - 1 - (t - ws) // st
            win_late[h] = inc_late[i_ws:i_end].sum(0)
            win_req[h] = inc_req[i_ws:i_end].sum(0)
        wb = (t // W) * W
        i_b, i_a = n_back - 1 - (t - wb) // st, n_back - 1 - (t - wb + W) // st
        last_violated = (inc_late[i_a:i_b].sum(0) > 0.01 * inc_req[i_a:i_b].sum(0)).astype(np.float32)
        ready_now, exist_now = ready_h[-1], exist_h[-1]
        booting_now = np.maximum(exist_now - ready_now, 0.0)
        launched_recently = np.maximum(exist_now - exist_soon, 0.0)
        booting_soon = np.maximum(booting_now - launched_recently, 0.0)
        clock = t + self.tel.clock_offset_s
        macro = np.empty((1, self.n_macro), dtype=np.float32)  # the layout of platform_v2.macro_names
        cls = np.empty((1, K, self.n_per_class), dtype=np.float32)
        macro_v2(macro, cls, sc, tod=np.array([(clock % DAY_S) / DAY_S]),
                 tow=np.array([((clock - 4 * DAY_S) % WEEK_S) / WEEK_S]),
                 window_phase=np.array([(t % W) / W]), admission_level=np.array([levels["admission"]]),
                 ok_1d=np.array([ok["1d"]]), ok_7d=np.array([ok["7d"]]), in_flight=in_flight[None],
                 utilisation=util_now[None], ready=ready_now[None], booting=booting_now[None],
                 booting_soon=booting_soon[None], target=spec[None], plan_level=np.asarray(levels["plan"])[None],
                 hold_level=np.asarray(levels["hold"])[None], last_violated=last_violated[None],
                 rate_blocks=coarse[:, None, :], rate_1d=season["1d"], rate_7d=season["7d"])
        frames = np.empty((H, K, len(micro_fields())), dtype=np.float32)
        ready_f = ready_h.astype(np.float32)
        micro_frame_v2(frames, sc, arrivals=inc_req[-H:], backlog=queue_h, p99_s=p99, refused=inc_ref[-H:],
                       ready=ready_f, booting=np.maximum(exist_h - ready_h, 0.0), win_late=win_late, win_req=win_req)
        micro = frames.transpose(1, 0, 2)[None].copy()  # [1, K, H, U], oldest tick first
        obs = Observation(macro=macro, micro=micro)
        if not (np.isfinite(macro).all() and np.isfinite(micro).all()):
            return Reading(t, None, None, None, None, ["not_finite:observation"], time.monotonic() - t0)
        return Reading(t, obs, util_now, ready_now, spec, problems, time.monotonic() - t0, in_flight=in_flight,
                       fetch_s=fetch_s, forecast=forecast, forecast_problems=fc_problems, peak=peak)

    def _forecast(self, vec: dict, coarse: np.ndarray) -> np.ndarray:
        """[K] the predictive rule's forecast (`baselines.seasonal_forecast`) from this reading,
        per class: a week back where Prometheus holds that week for the class, else a day
        back, else 0 (no past to forecast from: the rule is then reactive for that class, as
        the simulator's is before a day of history)."""
        blocks = max(1, int(round(LEVEL_WINDOW_S / self.cb)))
        # [K] requests per second over the last level window (the newest blocks, as the simulator's ring reads them)
        seen = coarse[(-1 - np.arange(blocks)) % len(coarse)].mean(0)
        past_peak, then, ok = np.zeros(self.K), np.zeros(self.K), np.zeros(self.K, dtype=bool)
        for name in ("1d", "7d"):  # a week back overrides a day back
            peak, th = vec.get(f"fc_peak_{name}") or {}, vec.get(f"fc_then_{name}") or {}
            for k in range(self.K):
                if k in peak and k in th and math.isfinite(peak[k]) and math.isfinite(th[k]):
                    past_peak[k], then[k], ok[k] = peak[k], th[k], True
        return np.asarray(seasonal_forecast(past_peak, seen, then, ok), dtype=np.float64)


def ema(x: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average of rows x [n, K] (oldest first) at its last row, started
    at the first row (as the simulator's monitor starts at the first value it sees)."""
    m = x[0].astype(np.float64).copy()
    for row in x[1:]:
        m += alpha * (row - m)
    return m


def micro_fields() -> tuple[str, ...]:
    from apex_bdq.sim.platform_v2 import MICRO_FEATURES_V2
    return MICRO_FEATURES_V2
