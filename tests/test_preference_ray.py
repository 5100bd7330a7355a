"""Preferences on a real local Ray cluster: segments from rollout actors to the preference
actor, oracle pairs into the durable log, TD + Bradley-Terry in a 2-worker DDP group, and the
feedback CLI against the running actor (which survives a kill with every accepted pair)."""

import dataclasses
import os

import numpy as np
import pytest
from _util import wait_for

from apex_bdq.presets import PRESETS
from apex_bdq.config import ClusterConfig
from apex_bdq.ray_runner import ApexRun

pytestmark = pytest.mark.ray

SMOKE = PRESETS["smoke"]


def _run(spec: ClusterConfig, tmp_path, cfg, minutes: float = 3.0, max_updates=60) -> dict:
    spec = dataclasses.replace(spec, storage_path=str(tmp_path / "ray_train"), checkpoint_every_s=3.0)
    run = ApexRun(cfg, spec)
    try:
        return run.run(minutes=minutes, max_updates=max_updates)
    finally:
        run.shutdown()


def _pref_smoke():
    from apex_bdq.config import apply_overrides
    return apply_overrides(SMOKE, ["pref.enabled=true", "pref.segment_decisions=4", "pref.min_pairs=4",
                                   "pref.batch_pairs=4", "pref.oracle_pairs=60"])


def test_preferences_flow_through_a_two_learner_run(ray_local, tmp_path):
    """Rollout actors hand segments to the preference actor, the oracle ranks them into the
    durable log, and both DDP learners train TD + Bradley-Terry in one synchronised step."""
    from apex_bdq.config import PreferenceConfig
    from apex_bdq.preference import load_log
    log = str(tmp_path / "feedback.log")
    cfg = _pref_smoke()
    cfg = dataclasses.replace(cfg, pref=dataclasses.replace(cfg.pref, log_path=log))
    assert isinstance(cfg.pref, PreferenceConfig) and cfg.net.preference_ensemble == 3
    out = _run(ClusterConfig(num_actors=2, num_replay_shards=2, num_learners=2, backend="ddp", publish_every=10),
               tmp_path, cfg, max_updates=60)
    st = out["status"]
    assert st["learner"]["updates"] == 60
    pref = st["preference"]
    assert pref["pairs"] >= 4 and pref["log_path"] == log
    assert np.isfinite(st["learner"]["pref_loss"]), st["learner"]  # the learner trained on them
    assert sum(a["segments_sent"] for a in st["actors"]) >= pref["ranked_segments"]
    _, segs, pairs = load_log(log)
    assert len(pairs) == pref["pairs"] and all(p.a in segs and p.b in segs for p in pairs)


def test_feedback_cli_ranks_through_the_running_preference_actor(ray_local, tmp_path):
    import subprocess
    import sys
    import ray
    from actors.preference_actor import NAMESPACE, PREFERENCE_ACTOR_NAME, remote_preference_class
    from apex_bdq.preference import Segment
    cfg = _pref_smoke()
    actor = remote_preference_class().options(name=PREFERENCE_ACTOR_NAME, namespace=NAMESPACE).remote(
        cfg.net, cfg.pref, str(tmp_path / "fb.log"))
    rng = np.random.default_rng(0)
    n = cfg.net
    segs = [Segment(id=f"seg{i}", macro=rng.normal(size=(4, n.macro_features)).astype(np.float32),
                    micro=rng.normal(size=(4, n.num_classes, n.history, n.micro_features)).astype(np.float32),
                    action=rng.integers(0, n.sub_actions, size=(4, n.num_branches)),
                    metrics={"overload": 0.1 * i, "unfairness": 0.0, "slo_violation": 0.0},
                    series={"load": np.arange(8, dtype=np.float32), "capacity": np.full(8, 3, np.float32),
                            "p99_ms": np.full(8, 20, np.float32)}) for i in range(3)]
    ray.get(actor.add_segments.remote(segs))
    addr = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "launch.feedback", "--address", addr, *args],
                              capture_output=True, text=True, env=env, timeout=120)
    try:
        r = cli("list")
        assert r.returncode == 0, r.stderr
        assert all(f"seg{i}" in r.stdout for i in range(3))
        r = cli("show", "seg1", "--out", str(tmp_path / "seg1.png"))
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "seg1.png").stat().st_size > 1000
        r = cli("rank", "seg0", "seg2")
        assert r.returncode == 0 and r.stdout.startswith("accepted"), (r.stdout, r.stderr)
        r = cli("rank", "seg0", "nope")
        assert r.returncode == 2 and "unknown segment id 'nope'" in r.stderr
        st = ray.get(actor.stats.remote())
        assert st.pairs == 1 and st.refused == 1
        # The actor dies between accepting and training: the restarted one has the pair.
        ray.kill(actor, no_restart=False)
        def restarted():  # the kill is asynchronous: wait for the restarted actor
            st = ray.get(actor.stats.remote(), timeout=5)
            return st if st.replayed_pairs == 1 else None

        st = wait_for(restarted, 60, "the restarted preference actor to have replayed the pair",
                      ignore=(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError))
        assert st.pairs == 1 and st.replayed_pairs == 1
    finally:
        ray.kill(actor, no_restart=True)
