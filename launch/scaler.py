"""The KEDA external scaler: a trained policy deciding each Deployment's replicas from
Prometheus telemetry, in shadow mode or guarded control.

    python -m launch.scaler --checkpoint runs/train/checkpoint.pt --config deploy/scaler.yaml --mode shadow
    python -m launch.scaler --checkpoint ... --config ... --mode control --host 0.0.0.0

--config: YAML (or JSON) with `telemetry` (apex_bdq.telemetry.TelemetryConfig: Prometheus
URL, class and Deployment names, selectors, metric names) and optional `control`
(apex_bdq.control.ControlConfig: band, rate limits, min / max replicas). The scaler serves
KEDA's externalscaler gRPC API on --host:--port (loopback by default; 0.0.0.0 inside a pod,
TLS with --tls-cert/--tls-key), decides every 15 s even when KEDA does not ask (shadow mode
logs on its own), appends each decision to --log (the input of `launch.shadow_report`) and
exports its metrics for Prometheus on --metrics-port (decision latency histogram,
fallbacks by reason, shadow decisions, guard moves, replicas by source).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Optional


def load_config(path: str) -> dict:
    import yaml
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the scaler config {path!r}: {e}") from e
    if not isinstance(doc, dict) or "telemetry" not in doc:
        raise ValueError(f"scaler config {path!r} needs a `telemetry` section (and optionally `control`)")
    bad = set(doc) - {"telemetry", "control"}
    if bad:
        raise ValueError(f"scaler config {path!r}: unknown sections {sorted(bad)}")
    return doc


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.scaler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--config", required=True, help="YAML/JSON with `telemetry` and optional `control` sections")
    ap.add_argument("--mode", choices=("shadow", "control"), help="overrides control.mode (default shadow)")
    ap.add_argument("--host", default="127.0.0.1", help="gRPC address (0.0.0.0 for KEDA in another pod)")
    ap.add_argument("--port", type=int, default=6000)
    ap.add_argument("--metrics-port", type=int, default=9100, help="Prometheus metrics (0: off)")
    ap.add_argument("--metrics-host", default="127.0.0.1")
    ap.add_argument("--log", default="decisions.jsonl", help="decision log, JSON lines (appended)")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--no-guard", action="store_true", help="the bare network, without its observation guard")
    a = ap.parse_args(argv)
    if bool(a.tls_cert) != bool(a.tls_key):
        ap.error("--tls-cert and --tls-key go together")

    from apex_bdq.checkpoint import CheckpointError, load_checkpoint, train_config_of
    from apex_bdq.config import ConfigError
    from apex_bdq.control import ControlConfig, ControlError, Controller
    from apex_bdq.keda_scaler import ScalerError, ScalerServer
    from apex_bdq.serving import policy_from_checkpoint
    from apex_bdq.telemetry import TelemetryConfig, TelemetryError, TelemetryReader
    try:
        doc = load_config(a.config)
        tel = TelemetryConfig.from_dict(doc["telemetry"])
        ctl_doc = dict(doc.get("control") or {})
        if a.mode:
            ctl_doc["mode"] = a.mode
        ctl_cfg = ControlConfig.from_dict(ctl_doc)
        policy = policy_from_checkpoint(a.checkpoint, guard=not a.no_guard)
        sim = train_config_of(load_checkpoint(a.checkpoint), a.checkpoint).sim
        reader = TelemetryReader(tel, sim)
    except (ValueError, TelemetryError, ControlError, CheckpointError, ConfigError, OSError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ctl = Controller(sim, policy, ctl_cfg, read=reader.read, classes=tel.classes, log_path=a.log)
    try:
        server = ScalerServer(ctl, host=a.host, port=a.port, tls=(a.tls_cert, a.tls_key) if a.tls_cert else None)
    except (ScalerError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(a.metrics_port, addr=a.metrics_host, registry=ctl.metrics.registry)
    print(f"apex-bdq scaler: {ctl_cfg.mode} mode, gRPC {a.host}:{server.port}, metrics "
          f"{a.metrics_host + ':' + str(a.metrics_port) if a.metrics_port else 'off'}, log {a.log}, "
          f"Prometheus {tel.url}, classes {list(tel.classes)}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    reader.close()
    print("apex-bdq scaler: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
