"""The one driver (apex_bdq/driver.py) with a scripted runner: evaluation, history, checkpoint
saves, resume, rates and error handling, without Ray or a simulator."""

import dataclasses
import time

import pytest

from apex_bdq.driver import Driver, Progress
from apex_bdq.presets import PRESETS

CFG = dataclasses.replace(PRESETS["smoke"], eval_every_s=0.02, minutes=1.0)


class ScriptedRunner:
    """A runner that makes 10 env steps and one update per poll for `polls` polls; every
    call is logged. `none_every`: every k-th advance answers None (a component restarting)."""

    def __init__(self, polls=12, resumed=None, none_every=0, fail_in_advance=None):
        self.cfg = CFG
        self.resumed = resumed or {}
        self.polls, self.none_every, self.fail_in_advance = polls, none_every, fail_in_advance
        self.calls, self.saves = [], []
        self.env = int(self.resumed.get("env_steps", 0))
        self.upd = int(self.resumed.get("updates", 0))
        self.advances = 0

    def start(self, minutes, max_updates, counters):
        self.calls.append(("start", minutes, max_updates))
        self.counters_fn = counters
        self.budget = None if max_updates is None else self.upd + max_updates

    def running(self):
        return self.advances < self.polls and (self.budget is None or self.upd < self.budget)

    def advance(self, deadline):
        self.advances += 1
        time.sleep(max(0.0, min(deadline - time.perf_counter(), 0.01)))
        if self.fail_in_advance == self.advances:
            raise RuntimeError("advance failed")
        if self.none_every and self.advances % self.none_every == 0:
            return None
        self.env += 10
        self.upd += 1
        return Progress(env_steps=self.env, updates=self.upd, version=self.upd, replay_size=self.env,
                        status={"runner_key": self.advances})

    def policy(self):
        return "net", self.upd

    def save(self, path, counters):
        self.saves.append((path, counters))

    def stop(self):
        self.calls.append(("stop",))
        return {"progress": Progress(env_steps=self.env, updates=self.upd, version=self.upd), "runner_only": 7}


def _eval(net, ticks, shards, replicas):
    assert net == "net" and shards == CFG.eval_shards and replicas == 1
    return {"eval_reward": 1.0, "hpa_eval_reward": 0.5, "slo_violation_rate": 0.01, "hpa_slo_violation_rate": 0.02}


def test_driver_evaluates_saves_and_builds_the_result():
    r = ScriptedRunner()
    seen = []
    out = Driver(CFG, r, checkpoint="ck.pt", evaluate=_eval, final_split=None, on_progress=seen.append).run(
        minutes=0.5, max_updates=99)
    assert r.calls[0] == ("start", 0.5, 99) and r.calls[-1] == ("stop",)
    assert out["updates"] == 12 and out["env_steps"] == 120 and out["runner_only"] == 7
    assert out["updates_per_s"] == pytest.approx(12 / out["train_seconds"])
    rows = out["history"]
    assert rows and all(h["split"] == "val" and h["eval_reward"] == 1.0 for h in rows)
    assert [h["t_s"] for h in rows] == sorted(h["t_s"] for h in rows)
    # A checkpoint after every evaluation and one at the end, each with the curve so far.
    assert len(r.saves) == len(rows) + 1 and all(p == "ck.pt" for p, _ in r.saves)
    assert [len(c["history"]) for _, c in r.saves] == list(range(1, len(rows) + 1)) + [len(rows)]
    assert r.counters_fn()["history"] == rows  # what the Ray runner writes into mirrored checkpoints
    # on_progress gets the runner's status with the driver's clock and rates.
    assert len(seen) == 12 and all("t_s" in st and "runner_key" in st for st in seen)
    assert all("env_steps_per_s" in st for st in seen[1:]) and sum("eval" in st for st in seen) == len(rows)


def test_a_skipped_evaluation_adds_no_row_and_none_polls_are_tolerated():
    r = ScriptedRunner(none_every=3)
    out = Driver(CFG, r, evaluate=lambda *a: None, final_split=None).run()
    assert out["history"] == [] and r.saves == []
    assert out["updates"] == 8  # 12 polls, every third answered None


def test_a_resumed_run_continues_the_curve_and_counts_its_own_rates():
    old = [{"t_s": 100.0, "env_steps": 1000, "updates": 50, "split": "eval", "eval_reward": 0.0,
            "hpa_eval_reward": 0.0, "slo_violation_rate": 0.0, "hpa_slo_violation_rate": 0.0}]
    r = ScriptedRunner(resumed={"history": old, "env_steps": 1000, "updates": 50})
    out = Driver(CFG, r, evaluate=_eval, final_split=None).run()
    assert out["history"][0] == old[0] and len(out["history"]) > 1
    assert all(h["t_s"] > 100.0 for h in out["history"][1:])  # the clock goes on from the checkpoint's
    assert out["updates"] == 62 and out["env_steps"] == 1120
    assert out["updates_per_s"] == pytest.approx(12 / out["train_seconds"])  # this run's, not the total's
    assert out["env_steps_per_s"] == pytest.approx(120 / out["train_seconds"])


def test_an_error_in_the_loop_still_stops_the_runner():
    r = ScriptedRunner(fail_in_advance=3)
    with pytest.raises(RuntimeError, match="advance failed"):
        Driver(CFG, r, evaluate=False, final_split=None).run()
    assert r.calls[-1] == ("stop",)

    def boom(st):
        raise KeyError("callback")

    r = ScriptedRunner()
    with pytest.raises(KeyError, match="callback"):
        Driver(CFG, r, evaluate=False, final_split=None, on_progress=boom).run()
    assert r.calls[-1] == ("stop",)


def test_the_update_budget_of_the_config_ends_the_run_and_the_result_says_so():
    cfg = dataclasses.replace(CFG, updates=5)
    r = ScriptedRunner()
    r.cfg = cfg
    out = Driver(cfg, r, evaluate=False, final_split=None).run()
    assert r.calls[0] == ("start", cfg.minutes, 5)
    assert out["updates"] == 5 and out["updates_budget"] == 5 and out["stopped_by"] == "updates"
    # A resumed run's budget counts this invocation's updates.
    r = ScriptedRunner(resumed={"history": [], "env_steps": 100, "updates": 50})
    out = Driver(cfg, r, evaluate=False, final_split=None).run()
    assert out["updates"] == 55 and out["stopped_by"] == "updates"
    # A runner that ends before the budget (here: its script runs out) did not reach it.
    out = Driver(cfg, ScriptedRunner(polls=3), evaluate=False, final_split=None).run()
    assert out["updates"] == 3 and out["stopped_by"] == "other"
    # An explicit max_updates wins over the config's.
    r = ScriptedRunner()
    out = Driver(cfg, r, evaluate=False, final_split=None).run(max_updates=2)
    assert out["updates"] == 2 and out["updates_budget"] == 2


def test_a_bad_update_budget_is_refused_by_name():
    from apex_bdq.config import ConfigError
    for bad in (0, -3, 2.5):
        with pytest.raises(ConfigError, match="train.updates"):
            dataclasses.replace(CFG, updates=bad)
