"""Try the KEDA scaler without a cluster: a held-out stretch of the trace replayed as a
platform that a real Prometheus scrapes, the scaler deciding from it, KEDA + HPA's formula
(over the scaler's real gRPC interface) setting the replicas.

    python -m launch.platform_replay --checkpoint runs/train/checkpoint.pt --mode shadow --minutes 30
    python -m launch.shadow_report runs/platform_replay/decisions.jsonl

--mode shadow: the platform runs HPA's rule (what the scaler answers in shadow mode) and the
log holds the policy's replicas beside it; --mode control: the guarded learned replicas
drive the platform. The replay runs in lockstep with Prometheus' scrapes (50 ms a tick), so
30 platform minutes take about two. Needs Debian's `prometheus` (server and promtool).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np


def account(acct: dict, info: dict) -> None:
    acct["cost"] += float(info["cost"][0])
    if info["window_violated"] is not None:
        acct["windows"] += info["window_violated"].shape[1]
        acct["violated"] += int(info["window_violated"][0].sum())


def summary(acct: dict, ticks: int, cfg) -> dict:
    return {"cost": acct["cost"] / max(ticks, 1) / cfg.tick_s, "class_windows": acct["windows"],
            "violated_windows": acct["violated"], "violation_rate": acct["violated"] / max(acct["windows"], 1)}


def compare_sim(cfg, policy, ctl_cfg, seed: int, warm: int, n: int, live: list) -> dict:
    """The same controller deciding on the simulator's own state, same seed (same arrivals),
    same cadence and HPA formula: the replica curve the live loop should follow."""
    from apex_bdq.control import Controller, hpa_desired, reading_from_sim
    from apex_bdq.replay_platform import ReplayPlatform
    from apex_bdq.sim.baselines import Predictive
    q = ReplayPlatform(cfg, seed=seed)
    ctl = Controller(cfg, policy, ctl_cfg, classes=q.classes)
    forecaster = Predictive()  # the forecast a live reading carries, from the simulator's own history
    forecaster.reset(q.sim)
    for _ in range(warm):
        q.step()
    sync = max(1, int(round(ctl_cfg.sync_s / cfg.tick_s)))
    sim_curve, acct = [], {"cost": 0.0, "windows": 0, "violated": 0}
    reps = q.sim.target[0].astype(np.int64)
    for i in range(n):
        if i % sync == 0:
            d = ctl.decide(float(q.tick), reading_from_sim(q.sim, q.obs, forecaster))
            reps = hpa_desired(q.sim.target[0], d.applied.astype(float))
            sim_curve.append(reps.tolist())
        _, info = q.step(actions=ctl.actions(), replicas=reps)
        account(acct, info)
    a, b = np.array([c["replicas"] for c in live]), np.array(sim_curve)
    return {"sim_curve": sim_curve, "exact_share": float((a == b).mean()),
            "mean_abs_rel_diff": float((np.abs(a - b) / np.maximum(b, 1)).mean()),
            "sim_platform": summary(acct, n, cfg)}


def plot_compare(result: dict, path: Path) -> None:
    """Per class the replicas the live loop set (KEDA + HPA on the scaler's answers) and the
    ones the same controller set deciding on the simulator's own state."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from launch._io import save_figure
    live = np.array([c["replicas"] for c in result["curve"]])
    sim = np.array(result["compare_sim"]["sim_curve"])
    t = (np.array([c["t"] for c in result["curve"]]) - result["curve"][0]["t"]) / 60.0
    classes = result["classes"]
    fig, axes = plt.subplots(len(classes), 1, figsize=(9, 2.0 * len(classes)), sharex=True, squeeze=False)
    for k, (ax, c) in enumerate(zip(axes[:, 0], classes)):
        ax.step(t, sim[:, k], where="post", color="tab:gray", label="simulator's own state")
        ax.step(t, live[:, k], where="post", color="tab:blue", linestyle="--",
                label="live: Prometheus -> scaler -> KEDA/HPA")
        ax.set_ylabel(f"{c}\nreplicas", fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="upper left")
    axes[0, 0].set_title(f"{result['mode']} mode: {result['compare_sim']['exact_share']:.0%} of class-decisions equal",
                         fontsize=9)
    axes[-1, 0].set_xlabel("platform minutes")
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.platform_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="runs/train/checkpoint.pt")
    ap.add_argument("--mode", choices=("shadow", "control"), default="shadow")
    ap.add_argument("--minutes", type=float, default=30.0, help="platform minutes replayed after the warm-up")
    ap.add_argument("--warmup-minutes", type=float, default=3.0,
                    help="platform minutes under the platform's default setting before the scaler decides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-guard", action="store_true", help="the bare network (no observation guard)")
    ap.add_argument("--control", help="YAML/JSON file of control settings (apex_bdq.control.ControlConfig)")
    ap.add_argument("--out", default="runs/platform_replay", help="folder for decisions.jsonl and replicas.json")
    ap.add_argument("--compare-sim", action="store_true",
                    help="then run the same controller on the simulator's own state (same arrivals) and report how "
                         "closely the live loop followed it")
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.warmup_minutes < 2.5:
        ap.error("--minutes must be > 0 and --warmup-minutes >= 2.5 (the reader needs two accounting windows)")

    from apex_bdq.checkpoint import CheckpointError, load_checkpoint, train_config_of
    from apex_bdq.control import ControlConfig, ControlError, Controller
    from apex_bdq.keda_scaler import KedaHpa, ScalerServer
    from apex_bdq.replay_platform import PrometheusUnavailable, ReplayLoop, ReplayPlatform
    from apex_bdq.serving import policy_from_checkpoint
    from apex_bdq.telemetry import TelemetryConfig, TelemetryReader
    try:
        policy = policy_from_checkpoint(a.checkpoint, guard=not a.no_guard)
        cfg = train_config_of(load_checkpoint(a.checkpoint), a.checkpoint).sim
        ctl_cfg = ControlConfig(mode=a.mode)
        if a.control:
            import yaml
            ctl_cfg = ControlConfig.from_dict({**yaml.safe_load(Path(a.control).read_text()), "mode": a.mode})
    except (CheckpointError, ControlError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    warm, n = int(a.warmup_minutes * 60 / cfg.tick_s), int(a.minutes * 60 / cfg.tick_s)
    platform = ReplayPlatform(cfg, seed=a.seed)  # from the first held-out tick
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "decisions.jsonl"
    log.unlink(missing_ok=True)
    try:
        loop = ReplayLoop(platform, horizon_ticks=warm + n + 10)
    except PrometheusUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    curve = []
    acct = {"cost": 0.0, "windows": 0, "violated": 0}
    t0 = time.time()
    with loop:
        tel = TelemetryConfig(url=loop.url, classes=tuple(platform.classes),
                              deployments=tuple(f"{platform.service}-{c}" for c in platform.classes),
                              selector=f'service="{platform.service}"', clock_offset_s=platform.clock_offset_s,
                              stale_s=10.0)
        reader = TelemetryReader(tel, cfg)
        ctl = Controller(cfg, policy, ctl_cfg, read=reader.read, classes=platform.classes,
                         clock=lambda: platform.now, log_path=str(log))
        server = ScalerServer(ctl, loop=False)
        keda = KedaHpa(f"127.0.0.1:{server.port}", platform.classes, deployment_prefix=f"{platform.service}-")
        try:
            print(f"prometheus {loop.url}  scaler 127.0.0.1:{server.port}  mode {a.mode}  "
                  f"{a.warmup_minutes:g} + {a.minutes:g} platform minutes")
            for _ in range(warm):
                loop.step()
            sync = max(1, int(round(ctl_cfg.sync_s / cfg.tick_s)))
            reps = platform.sim.target[0].astype(np.int64)
            for i in range(n):
                if i % sync == 0:
                    reps, _, _ = keda.sync(platform.sim.target[0])
                    d = ctl.last
                    curve.append({"t": platform.now, "replicas": reps.tolist(),
                                  "rule": None if d.rule is None else d.rule.tolist(),
                                  "learned": None if d.guarded is None else d.guarded.tolist()})
                _, info = loop.step(actions=ctl.actions(), replicas=reps)
                account(acct, info)
        finally:
            keda.close()
            server.stop()
            reader.close()
    result = {"mode": a.mode, "classes": platform.classes, "minutes": a.minutes, "curve": curve,
              "platform": summary(acct, n, cfg), "counts": ctl.counts}
    counts = {k: v for k, v in ctl.counts.items() if v}
    print(f"{len(curve)} decisions in {time.time() - t0:.0f} s; counts {counts}")
    pl = result["platform"]
    print(f"platform over the {a.minutes:g} minutes: cost {pl['cost']:.3f} (replica-seconds / mean load / s), "
          f"{pl['violated_windows']} of {pl['class_windows']} class-windows broke the SLO "
          f"({pl['violation_rate']:.4f})")
    if a.compare_sim:
        result["compare_sim"] = compare_sim(cfg, policy, ctl_cfg, a.seed, warm, n, curve)
        c = result["compare_sim"]
        print(f"same controller on the simulator's own state: {c['exact_share']:.1%} of class-decisions equal, "
              f"mean |difference| {c['mean_abs_rel_diff']:.1%} of the replicas")
    (out / "replicas.json").write_text(json.dumps(result))
    if a.compare_sim:
        plot_compare(result, out / "replicas.png")
        print(f"plot: {out / 'replicas.png'}")
    print(f"log: {log}\nreport: python -m launch.shadow_report {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
