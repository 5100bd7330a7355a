"""Ray Tune sweep of the distributed trainer (launch.tune): a real 2-trial ASHA sweep of the
smoke preset on a real local cluster, its results and best config, `launch.train --config`
on that config, and `--resume` of the finished experiment. One cluster for the module."""

import csv
import json
import math
import os

import pytest

from apex_bdq.checkpoint import load_checkpoint
from apex_bdq.config import ConfigError
from launch import train
from launch import tune as sweep


# -- pure parts (no Ray cluster) ------------------------------------------------------------------
def test_space_specs_parse_and_bad_ones_fail_naming_the_key():
    from ray.tune.search.sample import Categorical, Float
    sp = sweep.parse_space({"agent.lr": "loguniform:1e-4,1e-3", "backend": "choice:ddp,accelerate",
                            "agent.n_step": "3", "num_actors": "grid:1,2"})
    assert isinstance(sp["agent.lr"], Float) and isinstance(sp["backend"], Categorical)
    assert sp["agent.n_step"] == 3 and sp["num_actors"] == {"grid_search": [1, 2]}
    for bad in ({"agent.lr": "loguniform:1e-4"}, {"agent.lr": "normal:0,1"}, {"a.b.c": "1"}):
        with pytest.raises(ConfigError, match=list(bad)[0].replace(".", r"\.")):
            sweep.parse_space(bad)


def test_cli_refuses_a_bad_space_or_override_before_starting_ray(capsys):
    assert sweep.main(["--preset", "smoke", "--space", "agent.no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert sweep.main(["--preset", "smoke", "--set", "agent.lr=abc"]) == 2


def test_train_config_file_args(tmp_path, capsys):
    p = tmp_path / "best.json"
    p.write_text(json.dumps({"train_args": ["--preset", "smoke", "--set", "agent.lr=0.002"]}))
    assert train.config_file_args(["--config", str(p), "--local"]) == ["--preset", "smoke", "--set", "agent.lr=0.002",
                                                                       "--local"]
    assert train.config_file_args(["--local"]) == ["--local"]
    p.write_text(json.dumps({"args": []}))
    assert train.main(["--config", str(p)]) == 2
    assert "train_args" in capsys.readouterr().err


# -- a real sweep -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local_options():  # the module's cluster (conftest's ray_local) at this size
    return {"num_cpus": 4, "resources": {"rollout": 8, "learner": 4}}


ARGS = ["--preset", "smoke", "--trials", "2", "--minutes", "0.25", "--eval-every", "5", "--name", "smoke",
        "--space", "backend=ddp", "--space", "agent.lr=choice:3e-4,1e-3", "--quiet"]


@pytest.fixture(scope="module")
def swept(ray_local, tmp_path_factory):
    storage = tmp_path_factory.mktemp("tune")
    assert sweep.main(ARGS + ["--storage", str(storage)]) == 0
    return storage / "smoke"


@pytest.mark.ray
def test_sweep_runs_two_trials_and_reports_reward_against_hpa(swept):
    rows = json.loads((swept / "results.json").read_text())["trials"]
    assert len(rows) == 2
    assert len({r["trial_id"] for r in rows}) == 2
    for r in rows:
        assert r["status"] in ("completed", "stopped early"), r  # ASHA may stop the second one
        assert r["iterations"] >= 1
        for k in ("eval_reward", "hpa_eval_reward", "reward_minus_hpa"):
            assert isinstance(r[k], float) and math.isfinite(r[k]), (k, r)
        assert r["reward_minus_hpa"] == pytest.approx(r["eval_reward"] - r["hpa_eval_reward"])
        if r["hpa_eval_reward"] > 0:  # the ratio is defined only then (v2's HPA earns less than it pays)
            assert r["reward_ratio_hpa"] == pytest.approx(r["eval_reward"] / r["hpa_eval_reward"])
        else:
            assert r["reward_ratio_hpa"] is None or math.isnan(r["reward_ratio_hpa"])
        assert r["backend"] == "ddp" and r["agent.lr"] in (3e-4, 1e-3) and r["updates"] > 0
    assert any(r["status"] == "completed" for r in rows)  # the first trial always runs to the end
    with open(swept / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["trial_id"] for t in table] == [r["trial_id"] for r in rows]
    assert all(math.isfinite(float(t["eval_reward"])) for t in table)


@pytest.mark.ray
def test_best_config_is_the_best_completed_trial_and_launch_train_reads_it(swept, tmp_path):
    rows = json.loads((swept / "results.json").read_text())["trials"]
    best = json.loads((swept / "best_config.json").read_text())
    done = [r for r in rows if r["status"] == "completed"]
    assert best["trial_id"] == max(done, key=lambda r: r["eval_reward"])["trial_id"]
    assert best["checkpoint"] and os.path.isdir(best["checkpoint"])  # the trial's final checkpoint
    args = best["train_args"]
    assert args[:2] == ["--preset", "smoke"] and f"agent.lr={best['agent.lr']!r}" in args
    ck = tmp_path / "from_best.pt"
    rc = train.main(["--config", str(swept / "best_config.json"), "--local", "--quiet", "--checkpoint", str(ck),
                     "--json", str(tmp_path / "out.json")])
    assert rc == 0
    cfg = load_checkpoint(ck)["config"]
    assert cfg["agent"]["lr"] == best["agent.lr"]  # the winner's settings reached the trainer
    assert cfg["agent"]["n_step"] == best["agent.n_step"] and cfg["agent"]["alpha"] == best["agent.alpha"]
    assert cfg["agent"]["eps_base"] == best["agent.eps_base"]


@pytest.mark.ray
def test_resume_finds_the_finished_experiment_and_trains_nothing_again(swept, capsys):
    before = json.loads((swept / "results.json").read_text())["trials"]
    dirs = sorted(p.name for p in swept.iterdir() if p.name.startswith("run_trial"))
    capsys.readouterr()
    assert sweep.main(ARGS + ["--storage", str(swept.parent), "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resuming {swept}" in out
    after = json.loads((swept / "results.json").read_text())["trials"]
    assert [(r["trial_id"], r["eval_reward"]) for r in after] == [(r["trial_id"], r["eval_reward"]) for r in before]
    assert sorted(p.name for p in swept.iterdir() if p.name.startswith("run_trial")) == dirs


# -- seed tables (launch.seeds) ------------------------------------------------------------------
def test_seed_summary_counts_the_seeds_that_meet_the_target():
    from apex_bdq.tuning import seed_summary
    rows = [{"oracle_gap_closed": 0.6, "cost_saving_vs_best_rule": 0.2, "unguarded_oracle_gap_closed": 0.1,
             "unguarded_cost_saving_vs_best_rule": -0.01},
            {"oracle_gap_closed": 0.4, "cost_saving_vs_best_rule": 0.1, "unguarded_oracle_gap_closed": None,
             "unguarded_cost_saving_vs_best_rule": None},
            {"oracle_gap_closed": None, "cost_saving_vs_best_rule": None}]
    s = seed_summary(rows, 0.5)
    assert s["seeds"] == 3 and s["seeds_meeting_gap_target"] == 1 and s["seeds_beating_best_rule"] == 2
    assert s["mean_cost_saving_vs_best_rule"] == pytest.approx(0.15)
    assert s["unguarded_seeds_meeting_gap_target"] == 0 and s["unguarded_seeds_beating_best_rule"] == 0
    assert s["selected_seed"] is None  # no seed was judged on the validation days


def test_the_seed_to_deploy_is_picked_on_the_validation_days_alone():
    from apex_bdq.tuning import pick_seed, seed_summary
    rows = [{"seed": 0, "val_cost_saving_vs_best_rule": 0.02, "val_slo_violation_rate": 0.001,
             "cost_saving_vs_best_rule": 0.09, "oracle_gap_closed": 0.3},
            {"seed": 1, "val_cost_saving_vs_best_rule": 0.05, "val_slo_violation_rate": 0.004,
             "cost_saving_vs_best_rule": -0.04, "oracle_gap_closed": -0.2},
            {"seed": 2, "val_cost_saving_vs_best_rule": 0.05, "val_slo_violation_rate": 0.002,
             "cost_saving_vs_best_rule": 0.01, "oracle_gap_closed": 0.05},
            {"seed": 3, "val_cost_saving_vs_best_rule": None, "cost_saving_vs_best_rule": 0.5},
            {"seed": 4, "val_cost_saving_vs_best_rule": float("nan"), "cost_saving_vs_best_rule": 0.4}]
    # the largest validation saving, ties to the lower validation violation rate; the held-out
    # figures (seed 0's +9 % here) play no part
    assert pick_seed(rows)["seed"] == 2
    s = seed_summary(rows)
    assert s["selected_seed"] == 2 and s["selected_val_cost_saving_vs_best_rule"] == 0.05
    assert s["selected_cost_saving_vs_best_rule"] == 0.01 and s["selected_oracle_gap_closed"] == 0.05
    assert pick_seed(rows[3:]) is None


def test_seeds_cli_refuses_bad_seeds_before_starting_ray(capsys):
    from launch import seeds
    assert seeds.main(["--preset", "smoke", "--seed-list", "1,1"]) == 2
    assert "distinct" in capsys.readouterr().err
    assert seeds.main(["--preset", "smoke", "--updates", "0"]) == 2
    assert seeds.main(["--preset", "smoke", "--set", "agent.nope=1"]) == 2


@pytest.mark.ray
def test_a_seed_table_runs_each_seed_to_its_update_budget(ray_local, tmp_path, daily_trace, capsys):
    """Two smoke seeds on a two-day trace (the layout of test_cli's yardstick tests, whose
    held-out frontiers the session's cache may hold), judged on the whole held-out range and
    on the validation days, where the seed to deploy is picked."""
    import json

    import torch

    from apex_bdq.tuning import pick_seed
    from launch import seeds
    out = tmp_path / "seeds.json"
    assert seeds.main(["--preset", "smoke", "--seed-list", "3,4", "--updates", "30", "--minutes", "2",
                       "--trace", str(daily_trace(days=2)), "--set", "final_eval_ticks=none", "--set", "eval_shards=16",
                       "--set", "final_eval_replicas=1",  # 10 h of validation days: enough class-windows to judge
                       "--set", "sim.trace.validation_fraction=0.28", "--storage", str(tmp_path), "--json", str(out), "--quiet",
                       "--no-dashboard"]) == 0
    doc = json.loads(out.read_text())
    rows = doc["seeds"]
    assert [r["seed"] for r in rows] == [3, 4] and not doc["errors"]
    for r in rows:  # the budget in updates, reached; the policy under its guard and without it
        assert r["updates"] == 30 and r["stopped_by"] == "updates"
        assert 0.0 <= r["guard_clipped_share"] <= 1.0 and 0.0 <= r["guard_fallback_share"] <= 1.0
        assert r["cost"] > 0 and r["unguarded_cost"] > 0
        # the same guarded policy on the validation days: another range, its own figures
        assert r["val_cost"] > 0 and r["val_cost"] != r["cost"] and 0.0 <= r["val_slo_violation_rate"] <= 1.0
    best = pick_seed(rows)
    assert doc["summary"]["selected_seed"] == (None if best is None else best["seed"])
    assert "picked on the validation days" in capsys.readouterr().out
    a, b = (torch.load(r["checkpoint"], map_location="cpu", weights_only=False) for r in rows)
    assert a["config"]["seed"] == 3 and b["config"]["seed"] == 4
    # the kept checkpoint is the final one; the name it trained under (.partial) is gone
    assert a["counters"]["updates"] == 30 and b["counters"]["updates"] == 30
    assert sorted(p.name for p in (tmp_path / "apex_bdq_seeds" / "checkpoints").iterdir()) == ["seed_3.pt", "seed_4.pt"]
    wa, wb = a["learner"]["net"], b["learner"]["net"]
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)  # two seeds, two policies
    assert doc["summary"]["seeds"] == 2
