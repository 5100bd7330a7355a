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
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.warmup_minutes < 2.5:
        ap.error("--minutes must be > 0 and --warmup-minutes >= 2.5 (the reader needs two accounting windows)")

    from apex_bdq.checkpoint import CheckpointError, load_checkpoint
    from apex_bdq.config import train_config_from_dict
    from apex_bdq.control import ControlConfig, ControlError, Controller
    from apex_bdq.keda_scaler import KedaHpa, ScalerServer
    from apex_bdq.replay_platform import PrometheusUnavailable, ReplayLoop, ReplayPlatform
    from apex_bdq.serving import policy_from_checkpoint
    from apex_bdq.telemetry import TelemetryConfig, TelemetryReader
    try:
        policy = policy_from_checkpoint(a.checkpoint, guard=not a.no_guard)
        cfg = train_config_from_dict(load_checkpoint(a.checkpoint)["config"]).sim
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
                loop.step(replicas=reps)
        finally:
            keda.close()
            server.stop()
            reader.close()
    (out / "replicas.json").write_text(json.dumps({"mode": a.mode, "classes": platform.classes, "curve": curve}))
    counts = {k: v for k, v in ctl.counts.items() if v}
    print(f"{len(curve)} decisions in {time.time() - t0:.0f} s; counts {counts}")
    print(f"log: {log}\nreport: python -m launch.shadow_report {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
