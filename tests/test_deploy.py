"""deploy/: the Serve config, the KubeRay manifests, the KEDA manifests and the scaler's
config, validated with Ray's own schema classes and the project's config classes; the
scaler's command line run for real."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def _yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _check_serve_config(doc: dict, monkeypatch) -> list:
    """ServeDeploySchema accepts it and every application's builder returns an Application
    with the deployment options its args set."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr
    from ray.serve.schema import ServeDeploySchema
    schema = ServeDeploySchema.model_validate(doc)
    monkeypatch.delenv("APEX_BDQ_FEEDBACK_TOKEN", raising=False)
    monkeypatch.delenv("APEX_BDQ_FEEDBACK_TOKEN_FILE", raising=False)
    apps = []
    for app in schema.applications:
        builder = import_attr(app.import_path)
        built = call_user_app_builder_with_args_if_necessary(builder, app.args)
        dep = built._bound_deployment
        assert dep.num_replicas == app.args.get("replicas", 1)
        assert dep.max_queued_requests == app.args.get("max_queued_requests", 1024)
        apps.append(app)
    return apps


def test_serve_config_is_valid_for_ray_serve(monkeypatch):
    apps = _check_serve_config(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()), monkeypatch)
    assert [a.import_path for a in apps] == ["apex_bdq.serve_app:app_builder"]


def test_serve_app_builder_refuses_unknown_args_and_tokens_in_the_config():
    from apex_bdq.serve_app import app_builder
    with pytest.raises(ValueError, match="unknown Serve app args"):
        app_builder({"checkpoint": "x.pt", "replicaz": 2})
    with pytest.raises(ValueError, match="feedback_token"):
        app_builder({"checkpoint": "x.pt", "feedback_token": "a" * 32})


def test_kuberay_rayservice_carries_the_same_serve_application(monkeypatch):
    (svc,) = _yaml_docs(DEPLOY / "kuberay" / "rayservice.yaml")
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    (app,) = _check_serve_config(yaml.safe_load(svc["spec"]["serveConfigV2"]), monkeypatch)
    (local,) = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())["applications"]
    assert app.import_path == local["import_path"] and app.route_prefix == local["route_prefix"]
    assert set(app.args) == set(local["args"])
    import ray
    assert svc["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


def test_kuberay_rayjob_entrypoint_and_runtime_env_are_valid():
    import shlex

    import ray
    from ray.dashboard.modules.job.common import JobSubmitRequest
    (job,) = _yaml_docs(DEPLOY / "kuberay" / "rayjob.yaml")
    spec = job["spec"]
    req = JobSubmitRequest(entrypoint=spec["entrypoint"], runtime_env=yaml.safe_load(spec["runtimeEnvYAML"]))
    assert req.runtime_env["env_vars"]["DS_ACCELERATOR"] == "cpu"
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "launch.train"]
    # the entry point's own parser accepts the arguments (--help on top exits 0 before anything runs)
    out = subprocess.run([sys.executable, "-m", "launch.train", *argv[3:], "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert spec["rayClusterSpec"]["rayVersion"] == ray.__version__


def test_keda_manifests_match_the_scaler_config():
    from apex_bdq.control import ControlConfig
    from apex_bdq.telemetry import TelemetryConfig
    cfg = yaml.safe_load((DEPLOY / "scaler.yaml").read_text())
    tel = TelemetryConfig.from_dict(cfg["telemetry"])
    ControlConfig.from_dict(cfg["control"])
    docs = _yaml_docs(DEPLOY / "keda" / "scaledobjects.yaml")
    assert [d["kind"] for d in docs] == ["ScaledObject"] * len(tel.classes)
    port = {p["name"]: p["port"] for d in _yaml_docs(DEPLOY / "keda" / "scaler.yaml") if d["kind"] == "Service"
            for p in d["spec"]["ports"]}["grpc"]
    for d, cls, dep in zip(docs, tel.classes, tel.deployments):
        (trig,) = d["spec"]["triggers"]
        assert trig["type"] == "external" and trig["metadata"]["class"] == cls
        assert trig["metadata"]["scalerAddress"].endswith(f":{port}")
        assert d["spec"]["scaleTargetRef"]["name"] == dep
        assert d["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
            "stabilizationWindowSeconds"] == 0  # the policy's hold is the only one
    (cm,) = [d for d in _yaml_docs(DEPLOY / "keda" / "scaler.yaml") if d["kind"] == "ConfigMap"]
    inner = yaml.safe_load(cm["data"]["scaler.yaml"])
    assert TelemetryConfig.from_dict(inner["telemetry"]).classes == tel.classes


def _random_checkpoint(path: Path) -> None:
    from apex_bdq.checkpoint import config_to_dict, save_checkpoint
    from apex_bdq.config import AgentConfig, NetConfig, SimConfig
    from apex_bdq.presets import PRESETS
    from learner.learner import Learner
    base = PRESETS["default"]
    net = NetConfig.for_sim(SimConfig())
    cfg = dataclasses.replace(base, sim=SimConfig(), net=net)
    save_checkpoint(path, config_to_dict(cfg), Learner(net, AgentConfig(), seed=0).state_dict(), {})


@pytest.mark.slow
def test_scaler_command_serves_keda_falls_back_when_prometheus_is_down_and_stops_cleanly(tmp_path):
    """`python -m launch.scaler` for real: config, gRPC, metrics endpoint, decision log,
    SIGTERM; Prometheus is unreachable, so every decision falls back (query_failed), counted
    in its metrics, and with no replica count known KEDA is told UNAVAILABLE."""
    import requests

    from apex_bdq.keda_scaler import KedaHpa
    from apex_bdq.replay_platform import free_port
    ck = tmp_path / "ck.pt"
    _random_checkpoint(ck)
    cfg = yaml.safe_load((DEPLOY / "scaler.yaml").read_text())
    cfg["telemetry"]["url"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg["telemetry"]["timeout_s"] = 0.5
    cfg["control"]["sync_s"] = 1.0
    (tmp_path / "scaler.yaml").write_text(yaml.safe_dump(cfg))
    mport, log = free_port(), tmp_path / "decisions.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    bad = subprocess.run([sys.executable, "-m", "launch.scaler", "--checkpoint", str(ck), "--config",
                          str(tmp_path / "missing.yaml")], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "launch.scaler", "--checkpoint", str(ck), "--config",
                             str(tmp_path / "scaler.yaml"), "--port", "0", "--metrics-port", str(mport), "--log", str(log),
                             "--no-guard"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "gRPC 127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.split("gRPC 127.0.0.1:")[1].split(",")[0])
        import grpc
        keda = KedaHpa(f"127.0.0.1:{port}", cfg["telemetry"]["classes"])
        # no telemetry and no replica count known: no decision, so HPA keeps the replicas in place
        with pytest.raises(grpc.RpcError) as e:
            keda.sync(np.array([5, 5, 5, 5]))
        keda.close()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "query_failed" in e.value.details()
        time.sleep(1.5)
        text = requests.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
        assert 'apex_scaler_fallbacks_total{reason="query_failed"}' in text
        n = float(text.split('apex_scaler_fallbacks_total{reason="query_failed"} ')[1].split()[0])
        assert n >= 2  # the loop decides every sync period without KEDA asking
        assert "apex_scaler_decision_seconds_count" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0
    from apex_bdq.control import read_log
    rows = read_log(log)
    assert len(rows) >= 2 and all(r["fallback"] == "query_failed" for r in rows)
