"""Resilience on a real local Ray cluster (one for the module): a short fault-injection soak
(rollout actor, replay shard, preference actor and learner worker killed, each recovered,
no feedback lost), a resumed distributed run that continues counters, optimiser, replay and
feedback, and a clear failure when rollout actors die without restarts."""

import dataclasses
import os

import pytest
import torch

from apex_bdq.checkpoint import load_checkpoint
from apex_bdq.presets import PRESETS
from apex_bdq.config import ClusterConfig
from apex_bdq.ray_runner import ApexRun

pytestmark = pytest.mark.ray


def test_short_soak_recovers_every_kill_and_loses_no_feedback(ray_local, tmp_path):
    from apex_bdq.soak import TARGETS, SoakOptions, soak
    # minutes is an upper bound: the run ends a few seconds after the 4th recovery.
    res = soak(SoakOptions(minutes=5.0, kill_every_s=5.0, min_gap_s=3.0, max_kills=4, checkpoint_every_s=5.0,
                           snapshot_every_s=4.0, seed=3, workdir=str(tmp_path)))
    assert res["kills_by_target"] == {t: 1 for t in TARGETS}, res["kill_log"]
    assert res["recovered"] == res["kills"] == 4, res["kill_log"]
    assert res["feedback_accepted"] > 10 and res["feedback_lost"] == 0
    # The learner group came back from its checkpoint and trained on (a few updates lost).
    assert res["learner_restarts"] == 1 and res["updates"] > res["updates_lost"] >= 0
    # The replay shard came back from its snapshot, not empty.
    (rep,) = [k for k in res["kill_log"] if k["target"] == "replay"]
    assert rep["restored_size"] > 0
    assert rep["learner_updates_during"] > 0  # it trained from the other shard meanwhile
    assert 0 <= res["max_rss_growth_mb"] < 150, res["peak_rss_mb"]
    from apex_bdq.preference import load_log
    _, _, pairs = load_log(str(tmp_path / "feedback.log"))
    assert sum(p.source == "soak" for p in pairs) >= res["feedback_accepted"]


def _cfg(tmp_path):
    from apex_bdq.config import apply_overrides
    cfg = apply_overrides(PRESETS["smoke"], ["pref.enabled=true", "pref.segment_decisions=4", "pref.min_pairs=4",
                                                   "pref.batch_pairs=4", "pref.oracle_pairs=40"])
    return dataclasses.replace(cfg, pref=dataclasses.replace(cfg.pref, log_path=None))


def test_resume_continues_weights_optimiser_counters_replay_and_feedback(ray_local, tmp_path, monkeypatch):
    ck = tmp_path / "ck.pt"
    spec = ClusterConfig(num_actors=2, num_replay_shards=1, storage_path=str(tmp_path / "ray_train"),
                       checkpoint_every_s=2.0, checkpoint_path=str(ck), replay_snapshot_dir=str(tmp_path / "replay"),
                       replay_snapshot_every_s=2.0, publish_every=10)
    monkeypatch.chdir(tmp_path)  # the feedback log goes under runs/feedback/ here
    run = ApexRun(_cfg(tmp_path), spec)
    try:
        out1 = run.run(minutes=3.0, max_updates=40)
    finally:
        run.shutdown()
    first = load_checkpoint(ck)
    c = first["counters"]
    assert first["learner"]["updates"] == 40 and c["env_steps"] > 0
    assert c["feedback_log"] == run.feedback_log and os.path.exists(c["feedback_log"])
    assert int(first["learner"]["opt"]["state"][0]["step"]) == 40
    pairs1 = out1["status"]["preference"]["pairs"]
    assert pairs1 > 0 and (tmp_path / "replay" / "replay_shard0.pt").exists()

    run2 = ApexRun(_cfg(tmp_path), spec, resume=first)
    try:
        out2 = run2.run(minutes=3.0, max_updates=20)
    finally:
        run2.shutdown()
    st = out2["status"]
    assert st["learner"]["updates"] == 60 and st["version"] >= 60
    assert st["shards"][0]["restored_size"] > 0  # the replay came back from its snapshot
    assert st["env_steps"] > c["env_steps"]  # counted on from the first run
    assert run2.feedback_log == c["feedback_log"] and st["preference"]["replayed_pairs"] == pairs1
    second = load_checkpoint(ck)
    assert second["learner"]["updates"] == 60
    assert int(second["learner"]["opt"]["state"][0]["step"]) == 60  # the optimiser went on, not afresh
    moved = [not torch.equal(first["learner"]["net"][k], second["learner"]["net"][k]) for k in first["learner"]["net"]]
    assert any(moved)


def test_dead_rollout_actors_without_restarts_stop_the_run_with_the_reason(ray_local, tmp_path):
    import threading
    import ray
    spec = ClusterConfig(num_actors=1, num_replay_shards=1, storage_path=str(tmp_path / "ray_train"), max_restarts=0)
    run = ApexRun(dataclasses.replace(PRESETS["smoke"]), spec)
    box = {}

    def go():
        try:
            box["out"] = run.run(minutes=2.0)
        except BaseException as e:
            box["error"] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    try:
        while not hasattr(run, "actor_runs"):
            th.join(0.2)
        ray.get(run.actors[0].stats.remote())
        ray.kill(run.actors[0], no_restart=False)  # max_restarts=0: it stays dead
        th.join(120)
        assert not th.is_alive()
        assert isinstance(box.get("error"), RuntimeError), box
        assert "every rollout actor died" in str(box["error"]) and "--max-restarts 0" in str(box["error"])
    finally:
        run.shutdown()
