"""A real `ray start --head` + `ray job submit` of the smoke preset, scraping the node's
Prometheus endpoint for the training metrics while the job runs."""

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _util import wait_for

from apex_bdq import metrics as M

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    vals: dict = {}
    for line in text.splitlines():
        m = re.match(r"^(ray_apex_[a-z_]+?)(?:_total)?(?:\{.*\})? ([-0-9.e+naif]+)$", line)
        if m:
            name = m.group(1)[len("ray_"):]
            vals[name] = max(vals.get(name, 0.0), abs(float(m.group(2))))
    return vals


def _ray_current_cluster_files() -> list:
    import tempfile
    return [p for p in (Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster",) if p.exists()]


@pytest.fixture
def ray_head(own_ray_cluster, tmp_path):
    """A head with Ray token authentication on, as cluster.yaml starts it: the token in a file
    of mode 600 that the head and every client read (RAY_AUTH_TOKEN_PATH here, ~/.ray/auth_token
    on a cluster)."""
    import secrets
    port, dash, mport, agent = _free_port(), _free_port(), _free_port(), _free_port()
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env = {**os.environ, **auth, "RAY_metrics_report_interval_ms": "1000"}
    subprocess.run([RAY, "start", "--head", f"--port={port}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
                    f"--metrics-export-port={mport}",
                    # not the agent's default 52365: another Ray on this machine (a leftover local
                    # cluster, a developer's) may hold it, and then no job can be submitted
                    f"--dashboard-agent-listen-port={agent}", "--num-cpus=4", '--resources={"rollout": 8, "learner": 8}',
                    "--include-dashboard=true", "--disable-usage-stats"], check=True, env=env, capture_output=True,
                   timeout=120)
    try:
        yield {"dashboard": f"http://127.0.0.1:{dash}", "metrics_port": mport, "env": env, "token": token}
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        for p in _ray_current_cluster_files():  # KNOWN.md: a stale file breaks the next ray.init(num_cpus=...)
            p.unlink(missing_ok=True)


def _submit_and_wait(ray_head, entry: str, seen: dict):
    from ray.job_submission import JobStatus, JobSubmissionClient
    def submitted():
        sub = subprocess.run([RAY, "job", "submit", "--address", ray_head["dashboard"], "--working-dir", str(ROOT),
                              "--no-wait", "--", *entry.split()], env=ray_head["env"], capture_output=True, text=True,
                              timeout=180)
        if sub.returncode != 0 and "No available agent to submit job" in sub.stdout + sub.stderr:
            return None  # a head started moments ago: its job agent has not registered yet
        return sub

    sub = wait_for(submitted, 120, "the head's job agent to take a submission", interval=2.0)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = re.search(r"raysubmit_\w+", sub.stdout + sub.stderr).group(0)
    # the token as a header: this test process imported Ray without token authentication
    client = JobSubmissionClient(ray_head["dashboard"],
                                 headers={"Authorization": f"Bearer {ray_head['token'].read_text().strip()}"})

    def finished():  # scraping the metrics while the job runs
        status = client.get_job_status(job_id)
        try:
            for k, v in _scrape(ray_head["metrics_port"]).items():
                seen[k] = max(seen.get(k, 0.0), v)
        except OSError:
            pass
        return status if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) else None

    # A hang guard, not a speed bound: on the 2-core VM a job of the smoke preset took 190-400 s
    # (its 0.4 training minutes, the Train group's start and shutdown, the final evaluation),
    # and the VM's speed drifts 3x between days (the first job of 2026-12-07 evening ran past 400 s).
    status = wait_for(finished, 1200, f"job {job_id} to finish", interval=1.0,
                      detail=lambda: client.get_job_logs(job_id)[-3000:])
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    return logs


def test_job_submit_runs_the_smoke_preset_and_exports_metrics(ray_head, tmp_path):
    from apex_bdq.checkpoint import load_checkpoint
    out_json, ck = tmp_path / "train.json", tmp_path / "ck.pt"
    # token authentication: the dashboard and job API refuse a client without the token
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{ray_head['dashboard']}/api/version", timeout=10)
    assert e.value.code == 401
    bare = {k: v for k, v in ray_head["env"].items() if not k.startswith("RAY_AUTH")}
    r = subprocess.run([RAY, "job", "list", "--address", ray_head["dashboard"]], env=bare, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "token" in (r.stdout + r.stderr).lower()
    entry = (f"{sys.executable} -m launch.train --address auto --preset smoke --minutes 0.4 --num-actors 2 "
             f"--quiet --json {out_json} --checkpoint {ck} --storage-path {tmp_path / 'ray_train'} --resume auto")
    seen: dict = {}
    logs = _submit_and_wait(ray_head, entry, seen)
    assert "no checkpoint yet, starting fresh" in logs
    res = json.loads(out_json.read_text())
    assert res["updates"] > 0 and res["env_steps"] > 0 and res["data_route"] == "shared-memory"
    for key in ("eval_reward", "hpa_eval_reward", "slo_violation_rate", "hpa_slo_violation_rate"):
        assert key in res
    assert ck.exists() and ck.stat().st_size > 0
    missing = [m for m in M.ALL if seen.get(m, 0.0) <= 0]
    assert not missing, f"metrics missing or zero on the Prometheus endpoint: {missing}; seen {sorted(seen)}"
    # Resubmitting the same command continues from the checkpoint the first job left.
    first = load_checkpoint(ck)
    logs = _submit_and_wait(ray_head, entry, {})
    assert f"continuing from {ck}" in logs
    second = load_checkpoint(ck)
    assert second["learner"]["updates"] > first["learner"]["updates"] == res["updates"]
    assert second["counters"]["env_steps"] > first["counters"]["env_steps"]
