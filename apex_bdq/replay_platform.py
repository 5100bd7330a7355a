"""A platform to point the Prometheus reader and the KEDA scaler at: platform v2's dynamics
for one service of K request classes (one Deployment each) replaying a trace, exporting what
a real service and kube-state-metrics export, and a real Prometheus server that scrapes it.

`ReplayPlatform` steps `PlatformSimV2` with one shard and serves, with `prometheus_client`,
  apex_requests_total{class}                counter: arrivals
  apex_requests_refused_total{class}        counter: requests refused by admission
  apex_requests_late_total{class}           counter: requests that missed the p99 SLO (refused included)
  apex_request_duration_seconds{class}      histogram of the admitted requests' latency, per tick from
                                            the queueing model (service + Erlang-C wait + backlog drain)
  apex_requests_in_flight{class}            gauge: requests in service + queued
  apex_queue_length{class}                  gauge: requests queued beyond what the replicas serve
  apex_replica_busy_seconds_total{class}    counter: busy replica-seconds (as container CPU seconds)
  kube_deployment_spec_replicas{deployment} gauge: the replicas asked for
  kube_deployment_status_replicas{deployment}        gauge: replicas that exist (ready + starting)
  kube_deployment_status_replicas_ready{deployment}  gauge: ready replicas
  apex_platform_tick                        gauge: ticks simulated (lets a driver wait for a scrape)
every sample stamped with the platform's clock (`T0 + tick`, seconds): the platform runs in
lockstep with the scrapes (`ReplayLoop.step` waits until Prometheus holds the tick), faster
than real time, in the past, so a test replays an hour in a minute and every tick is one sample.

The clock starts 45 minutes before the wall clock (Prometheus takes samples within the hour
before its newest one); `clock_offset_s` maps it onto the trace's time of day and week (the
reader's time zone setting); `backfill` writes the trace's history before T0 (the last
`coarse_history` blocks, a day and a week ago around the replayed span and the predictive
rule's 30-minute level window before it, one sample a second; the rest of the week one a
minute) as OpenMetrics and
turns it into TSDB blocks with `promtool tsdb create-blocks-from openmetrics`, so the reader
sees a platform with history from the first tick. `PrometheusServer` runs Debian's
`prometheus` binary (or $APEX_BDQ_PROMETHEUS) on loopback with that data.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.sim.baselines import LEVEL_WINDOW_S
from apex_bdq.sim.platform import make_rates

DAY_S, WEEK_S = 86400, 7 * 86400
JOB = "platform"  # the scrape job of the replay platform
BLOCK_S = 120  # the clock's T0 is on a multiple of it (coarse blocks, accounting windows)
BUCKET_SLOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0)
"""Latency histogram bucket bounds in SLOs of the class (a bound at the SLO itself)."""


class PrometheusUnavailable(RuntimeError):
    pass


def prometheus_binaries() -> tuple[str, str]:
    """(prometheus, promtool) paths, or PrometheusUnavailable saying how to install them."""
    prom = os.environ.get("APEX_BDQ_PROMETHEUS") or shutil.which("prometheus")
    tool = os.environ.get("APEX_BDQ_PROMTOOL") or shutil.which("promtool")
    if not prom or not tool:
        raise PrometheusUnavailable("no prometheus / promtool binary on PATH (Debian: apt-get install prometheus; "
                                    "or set APEX_BDQ_PROMETHEUS and APEX_BDQ_PROMTOOL)")
    return prom, tool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReplayPlatform:
    """One shard of platform v2 replaying `cfg`'s trace from trace tick `start`, on a clock
    whose time of day / week is the trace's; see the module docstring.

    start: a trace tick at or before the held-out range (default: where the held-out days
    begin). `now`: the wall clock (the replay starts 45 minutes in its past)."""

    def __init__(self, cfg: SimConfig, start: Optional[int] = None, seed: int = 0, service: str = "shop",
                 classes: Optional[list[str]] = None, now: Optional[float] = None) -> None:
        from apex_bdq.sim.platform_v2 import PlatformSimV2
        if cfg.platform != "v2":
            raise ValueError("the replay platform runs platform v2")
        self.cfg = cfg = cfg.replace(num_shards=1, seed=seed)
        self.rates = make_rates(cfg)
        lo, hi = self.rates.split_range("eval")
        start = lo if start is None else int(start)
        if not 0 <= start <= lo:
            raise ValueError(f"start must be a trace tick in [0, {lo}] (the held-out days begin at {lo}), got {start}")
        if cfg.tick_s != 1.0:
            raise ValueError("the replay platform stamps one sample per second: it needs sim.tick_s = 1")
        self.sim = PlatformSimV2(cfg, split="eval", rates=self.rates, phases="even", warmup_ticks=lo - start)
        self.start = start
        self.K = cfg.num_classes
        self.service = service
        self.classes = list(classes) if classes is not None else [f"class{k}" for k in range(self.K)]
        if len(self.classes) != self.K:
            raise ValueError(f"{len(self.classes)} class names for {self.K} classes")
        # The clock: live samples must lie within the hour before the newest sample Prometheus
        # holds (its head block), so T0 is 45 minutes before the wall clock, on a 2-minute
        # boundary (coarse blocks and accounting windows start there, as at the episode's
        # start). `clock_offset_s` shifts the clock onto the trace's time of day and week (as
        # a time zone would): the reader adds it before taking them.
        tow = self.rates.time_of_week if self.rates.time_of_week is not None else self.rates.time_of_day
        tow0_s = int(float(tow[0]) * (WEEK_S if self.rates.time_of_week is not None else DAY_S))  # trace tick 0
        now = time.time() if now is None else now
        self.T0 = int((now - 45 * 60) // BLOCK_S) * BLOCK_S
        self.W0 = self.T0 - start  # platform clock of trace tick 0
        # 1970-01-01 was a Thursday (a Monday 00:00 is 4 days on): W0 + offset has the trace's
        # time of week at tick 0 (the tick's start, to the second).
        self.clock_offset_s = int((4 * DAY_S + tow0_s - self.W0) % WEEK_S)
        self.tick = 0
        self._lock = threading.Lock()
        sc = self.sim.scales
        self.slo = sc.slo.astype(np.float64)
        self.bounds = np.asarray(BUCKET_SLOS)[None, :] * self.slo[:, None]  # [K, B]
        zeros = np.zeros(self.K)
        self.counters = {"requests": zeros.copy(), "refused": zeros.copy(), "late": zeros.copy(),
                         "busy": zeros.copy(), "lat_sum": zeros.copy()}
        self.buckets = np.zeros((self.K, self.bounds.shape[1] + 1))  # cumulative, +Inf last
        self.obs = self.sim.reset(seed=seed)
        self.info: Optional[dict] = None
        self._snapshot()

    # -- the clock ---------------------------------------------------------------------------------
    def time_of(self, tick: int) -> int:
        """Platform clock (Unix seconds) of the state after `tick` ticks."""
        return self.T0 + int(tick)

    @property
    def now(self) -> int:
        return self.time_of(self.tick)

    # -- stepping ----------------------------------------------------------------------------------
    def step(self, actions: Optional[np.ndarray] = None, replicas: Optional[np.ndarray] = None):
        """One tick: the policy's sub-actions [D] (the simulator plans and holds), or the
        replicas [K] each Deployment is set to (what an autoscaler writes)."""
        from apex_bdq.sim.baselines import default_actions
        sim = self.sim
        a = default_actions(sim) if actions is None else np.asarray(actions, dtype=np.int64).reshape(1, -1)
        ct = None if replicas is None else np.asarray(replicas, dtype=np.int64).reshape(1, self.K)
        idx = sim.trace_index()  # the tick being simulated (its rate shapes the latency histogram)
        obs, _, _, info = sim.step(a, capacity_target=ct)
        self._account(info, idx)
        with self._lock:
            self.obs, self.info = obs, info
            self.tick += 1
            self._snapshot()
        return obs, info

    def _account(self, info: dict, idx: np.ndarray) -> None:
        sim, c = self.sim, self.counters
        arrivals = info["arrivals"][0].astype(np.float64)
        drops = info["dropped"][0].astype(np.float64)
        admitted = np.maximum(arrivals - drops, 0.0)
        c["requests"] += arrivals
        c["refused"] += drops
        c["late"] += info["late_requests"][0]
        ready = sim.active[0].astype(np.float64)
        c["busy"] += np.minimum(sim.load_est[0], ready) * sim.dt
        # The latency distribution of this tick's admitted requests, as serve_tick models it:
        # L = service + backlog drain + W, P(W > x) = P(wait) exp(-(c mu - lambda) x), capped.
        mu = sim.mu.astype(np.float64)
        lam = sim.lam_table[idx][0].astype(np.float64)
        rate = np.maximum(ready * mu, 1e-9)
        drain = sim.backlog[0] / rate
        pw = sim.erlang(ready, lam / rate).astype(np.float64)
        theta = rate - lam
        floor = 1.0 / mu + drain  # [K]
        x = self.bounds - floor[:, None]  # [K, B]
        with np.errstate(over="ignore", invalid="ignore"):
            tail = np.where(theta[:, None] > 0, np.minimum(pw[:, None] * np.exp(-theta[:, None] * np.maximum(x, 0)), 1.0),
                            1.0)
        tail = np.where(x < 0, 1.0, tail)
        tail = np.where(self.bounds >= sim.lat_cap[:, None], 0.0, tail)  # latencies are capped
        self.buckets[:, :-1] += admitted[:, None] * (1.0 - tail)
        self.buckets[:, -1] += admitted
        c["lat_sum"] += admitted * info["p99_s"][0]  # not a mean: the sum keeps the histogram well-formed

    def _snapshot(self) -> None:
        sim = self.sim
        self.snap = {
            "t": self.now, "tick": self.tick,
            "counters": {k: v.copy() for k, v in self.counters.items()}, "buckets": self.buckets.copy(),
            "in_flight": (sim.load_est[0] + sim.backlog[0]).astype(np.float64),
            "queue": sim.backlog[0].astype(np.float64),
            "spec": sim.target[0].astype(np.float64), "ready": sim.active[0].astype(np.float64),
            "exist": (sim.active[0] + sim.pending[0]).astype(np.float64),
        }

    # -- exposition --------------------------------------------------------------------------------
    def collect(self):
        """prometheus_client collector protocol: the newest tick's samples, stamped."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        with self._lock:
            s = self.snap
        ts = float(s["t"])
        app = ["service", "class"]
        kube = ["namespace", "deployment"]

        def per_class(fam, values, labels):
            for k, name in enumerate(self.classes):
                lv = [self.service, name] if labels is app else ["default", f"{self.service}-{name}"]
                fam.add_metric(lv, float(values[k]), timestamp=ts)
            return fam

        c = s["counters"]
        yield per_class(CounterMetricFamily("apex_requests", "Requests arrived", labels=app), c["requests"], app)
        yield per_class(CounterMetricFamily("apex_requests_refused", "Requests refused by admission", labels=app),
                        c["refused"], app)
        yield per_class(CounterMetricFamily("apex_requests_late", "Requests that missed the p99 SLO (refused "
                                            "included)", labels=app), c["late"], app)
        yield per_class(CounterMetricFamily("apex_replica_busy_seconds", "Busy replica-seconds", labels=app),
                        c["busy"], app)
        yield per_class(GaugeMetricFamily("apex_requests_in_flight", "Requests in service or queued", labels=app),
                        s["in_flight"], app)
        yield per_class(GaugeMetricFamily("apex_queue_length", "Requests queued beyond the replicas' rate",
                                          labels=app), s["queue"], app)
        h = HistogramMetricFamily("apex_request_duration_seconds", "Latency of admitted requests", labels=app)
        for k, name in enumerate(self.classes):
            b = [(repr(float(le)), float(v)) for le, v in zip(self.bounds[k], s["buckets"][k, :-1])]
            b.append(("+Inf", float(s["buckets"][k, -1])))
            h.add_metric([self.service, name], b, float(c["lat_sum"][k]), timestamp=ts)
        yield h
        yield per_class(GaugeMetricFamily("kube_deployment_spec_replicas", "Replicas asked for", labels=kube),
                        s["spec"], kube)
        yield per_class(GaugeMetricFamily("kube_deployment_status_replicas", "Replicas that exist", labels=kube),
                        s["exist"], kube)
        yield per_class(GaugeMetricFamily("kube_deployment_status_replicas_ready", "Ready replicas", labels=kube),
                        s["ready"], kube)
        g = GaugeMetricFamily("apex_platform_tick", "Ticks simulated", labels=["service"])
        g.add_metric([self.service], float(s["tick"]), timestamp=ts)
        yield g

    def serve(self, port: int = 0) -> tuple[int, object]:
        """Serve the metrics on 127.0.0.1:port (0: a free one); returns (port, server)."""
        from prometheus_client import CollectorRegistry, start_http_server
        reg = CollectorRegistry(auto_describe=False)
        reg.register(self)
        port = port or free_port()
        server, _ = start_http_server(port, addr="127.0.0.1", registry=reg)
        return port, server

    # -- history before T0 -------------------------------------------------------------------------
    def history_ranges(self, horizon_ticks: int) -> list[tuple[int, int]]:
        """[start, end) platform-clock ranges the reader looks back into over `horizon_ticks`
        ticks: the coarse history before T0, and a day and a week before the replayed span
        (with the seasonal leads), merged."""
        cfg = self.cfg
        back = int(cfg.coarse_history * cfg.coarse_block_s + 2 * cfg.coarse_block_s)
        lead = int(max(cfg.seasonal_leads_s, default=0)) + 120
        T0, T1 = self.T0, self.T0 + int(horizon_ticks)
        spans = [(T0 - back, T0)]
        for off in (DAY_S, WEEK_S):
            # from before the forecast's level window to the end of the span, with the leads
            spans.append((T0 - off - int(LEVEL_WINDOW_S) - 300, min(T1 - off + lead, T0)))
        spans = sorted((a, b) for a, b in ((max(a, self.W0), b) for a, b in spans) if b > a)
        merged: list[list[int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return [(a, b) for a, b in merged]

    def backfill(self, data_dir: str | Path, horizon_ticks: int, labels: Optional[dict] = None) -> int:
        """Write the trace's request history before T0 (expected arrivals) as TSDB blocks under
        `data_dir` (promtool); returns the samples written: one a second over the ranges the
        reader's features look into (`history_ranges`), one a minute over the rest of the week
        before T0 (what the guard's static ceiling reads its peak 5-min rate from). The live
        counter continues from the history's last value. labels: the target labels Prometheus
        adds to the live samples (job, instance), so history and live samples are one series."""
        _, promtool = prometheus_binaries()
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        lam = self.rates.rates
        extra = "".join(f',{k}="{v}"' for k, v in sorted((labels or {}).items()))
        fine = self.history_ranges(horizon_ticks)
        lo = max(self.W0, min([self.T0 - WEEK_S - 600] + [a for a, _ in fine]))
        cum = np.cumsum(lam[lo - self.W0:self.T0 - self.W0].astype(np.float64), axis=0)  # arrivals up to each second
        times = set(range(lo + (-lo) % 60, self.T0, 60))
        for a, b in fine:
            times.update(range(a, b))
        lines = ["# TYPE apex_requests counter"]
        for T in sorted(times):
            for k, name in enumerate(self.classes):
                lines.append(f'apex_requests_total{{service="{self.service}",class="{name}"{extra}}} '
                             f'{float(cum[T - lo, k])!r} {T}')
        n = len(times) * self.K
        total = cum[-1] if len(cum) else np.zeros(self.K)
        lines.append("# EOF")
        src = data_dir / "history.om"
        src.write_text("\n".join(lines) + "\n")
        out = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(src), str(data_dir)],
                             capture_output=True, text=True, timeout=300)
        src.unlink()
        if out.returncode != 0:
            raise PrometheusUnavailable(f"promtool backfill failed: {out.stderr.strip()[-500:]}")
        self.counters["requests"] += total
        self._snapshot()
        return n


class PrometheusServer:
    """A real Prometheus on 127.0.0.1 scraping `targets` every `scrape_s` seconds, with its
    data in `data_dir` (backfilled blocks allowed). Stop with `stop()` (or use as a context)."""

    def __init__(self, targets: list[str], data_dir: str | Path, scrape_s: float = 0.05,
                 port: int = 0, extra_args: tuple = ()) -> None:
        prom, _ = prometheus_binaries()
        self.dir = Path(data_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        interval = f"{int(round(scrape_s * 1000))}ms"
        cfg = self.dir / "prometheus.yml"
        tg = ", ".join(f"'{t}'" for t in targets)
        cfg.write_text(f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n"
                       f"scrape_configs:\n  - job_name: {JOB}\n    honor_timestamps: true\n"
                       f"    static_configs:\n      - targets: [{tg}]\n")
        self.log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [prom, f"--config.file={cfg}", f"--storage.tsdb.path={self.dir}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=60d", "--log.level=warn", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        import requests
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.log.close()
                raise PrometheusUnavailable(f"prometheus exited with {self.proc.returncode}: "
                                            f"{(self.dir / 'prometheus.log').read_text()[-800:]}")
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise PrometheusUnavailable(f"prometheus not ready within {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class ReplayLoop:
    """The platform, its exporter and a Prometheus scraping it, stepped in lockstep: `step`
    advances one tick and returns once Prometheus holds it. `workdir`: where Prometheus keeps
    its data (a temporary folder by default, removed by `close`)."""

    def __init__(self, platform: ReplayPlatform, horizon_ticks: int, workdir: Optional[str] = None,
                 scrape_s: float = 0.05) -> None:
        self.platform = platform
        self._tmp = None if workdir else tempfile.mkdtemp(prefix="apex-prom-")
        self.dir = Path(workdir or self._tmp)
        self.prom = self.server = self.http = None
        try:
            self.port, self.server = platform.serve()
            platform.backfill(self.dir, horizon_ticks, labels={"job": JOB, "instance": f"127.0.0.1:{self.port}"})
            self.prom = PrometheusServer([f"127.0.0.1:{self.port}"], self.dir, scrape_s=scrape_s)
            import requests
            self.http = requests.Session()
            self.wait_scraped()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return self.prom.url

    def wait_scraped(self, timeout_s: float = 30.0) -> None:
        """Block until Prometheus holds the platform's newest tick."""
        p = self.platform
        want, at = p.tick, p.now
        end = time.monotonic() + timeout_s
        while True:
            r = self.http.get(f"{self.url}/api/v1/query", params={"query": "apex_platform_tick", "time": at},
                              timeout=5).json()
            res = r.get("data", {}).get("result", [])
            if res and float(res[0]["value"][1]) >= want and float(res[0]["value"][0]) == at:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"Prometheus did not scrape tick {want} within {timeout_s} s")
            time.sleep(0.005)

    def step(self, actions=None, replicas=None):
        out = self.platform.step(actions=actions, replicas=replicas)
        self.wait_scraped()
        return out

    def close(self) -> None:
        if self.prom is not None:
            self.prom.stop()
        if self.server is not None:
            self.server.shutdown()
        if self.http is not None:
            self.http.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
