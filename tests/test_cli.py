"""The real entry points, run as a user runs them, with tiny budgets."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apex_bdq.evaluation import METRIC_KEYS
from launch import bench, evaluate, make_default_trace

from conftest import SHARED_TRACES

ROOT = Path(__file__).resolve().parents[1]


def test_evaluate_policy_list_expands_all_beside_checkpoints():
    """`--policy all,checkpoint:PATH` is every baseline of the platform and the checkpoint,
    each once, in order; v2-only rules are left out on v1."""
    v2 = evaluate.policy_names("all,checkpoint:a.pt,hpa", "v2")
    assert v2[-1] == "checkpoint:a.pt" and v2.count("hpa") == 1
    assert set(v2[:-1]) == set(evaluate.BASELINES) and "oracle" in v2
    v1 = evaluate.policy_names("predictive, all ,,checkpoint-unguarded:b.pt", "v1")
    assert v1[0] == "predictive" and v1[-1] == "checkpoint-unguarded:b.pt"
    assert "oracle" not in v1 and v1.count("predictive") == 1
    assert evaluate.policy_names("hpa,static", "v2") == ["hpa", "static"]


@pytest.mark.slow
def test_evaluate_judges_every_policy_against_the_rules_frontiers(tmp_path, capsys, daily_trace):
    """`--policy all` on a two-day trace: the frontier table, the yardstick keys per policy
    (the oracle included), the headroom lines and the frontier plot."""
    trace = daily_trace(days=2)
    out, png = tmp_path / "eval.json", tmp_path / "frontiers.png"
    rc = evaluate.main(["--trace", str(trace), "--shards", "16", "--replicas", "1", "--json", str(out),
                        "--plot", str(png), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["frontiers"]) == {"hpa", "target", "predictive", "static"}
    for rule, pts in res["frontiers"].items():
        assert len(pts) >= 6 and all({"setting", "cost", "slo_violation_rate"} <= set(p) for p in pts)
    assert len(res["oracle_frontier"]) == 7 and res["headroom"]
    pol = res["policies"]
    assert {"hpa", "target", "predictive", "static", "queue", "random", "oracle", "constant"} == set(pol)
    for m in pol.values():
        assert set(METRIC_KEYS) <= set(m)
        assert {"cost_saving_vs_best_rule", "violation_ratio_vs_best_rule", "oracle_gap_closed",
                "refused_share"} <= set(m)
    assert pol["oracle"]["oracle_gap_closed"] == pytest.approx(1.0)
    assert pol["oracle"]["cost_saving_vs_best_rule"] > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "saving vs best rule" in text and "frontiers (each rule swept" in text and "headroom at" in text
    # The second run takes the frontiers from the cache.
    assert evaluate.main(["--trace", str(trace), "--shards", "16", "--replicas", "1", "--policy", "hpa",
                          "--json", str(out), "--quiet"]) == 0
    again = json.loads(out.read_text())
    assert again["cached"] is True and again["frontiers"] == res["frontiers"]
    assert again["policies"]["hpa"]["cost"] == pol["hpa"]["cost"]
    # `--split val`: the validation days before the held-out ones (judged there in the seed
    # table's test, tests/test_tune.py: this range is too short to resolve the frontiers)
    val = tmp_path / "val.json"
    assert evaluate.main(["--trace", str(trace), "--shards", "16", "--replicas", "1", "--policy", "hpa,predictive",
                          "--split", "val", "--no-frontier", "--json", str(val), "--quiet"]) == 0
    v = json.loads(val.read_text())
    assert res["split"] == "eval" and v["split"] == "val" and v["range"] != res["range"]
    assert v["range"].startswith("val ticks") and res["range"].startswith("eval ticks")
    for name in ("hpa", "predictive"):
        assert v["policies"][name]["cost"] != pol[name]["cost"]


@pytest.mark.slow
def test_train_ends_with_the_yardstick_and_launch_evaluate_agrees(tmp_path, capsys, daily_trace):
    """`make run`'s last lines: the learned policy against the rules' frontiers on the
    held-out range, in the output and the JSON; `launch.evaluate` on the checkpoint, same
    trace and layout, gives the same judged figures."""
    from launch import train
    trace = daily_trace(days=2)
    out, ck = tmp_path / "train.json", tmp_path / "ck.pt"
    assert train.main(["--local", "--preset", "smoke", "--trace", str(trace), "--set", "final_eval_ticks=none",
                       "--set", "eval_shards=16", "--set", "final_eval_replicas=1", "--json", str(out),
                       "--checkpoint", str(ck), "--quiet"]) == 0
    text = capsys.readouterr().out
    y = json.loads(out.read_text())["yardstick"]
    assert "refused" not in y and y["headroom"] is not None
    assert "learned policy (held-out days) under its guard: cost" in text and "without the guard: cost" in text
    assert "cost vs the best rule at that violation rate" in text and "target (issue 25)" in text
    res = json.loads(out.read_text())
    assert res["learned"]["guarded"] and not res["learned_unguarded"]["guarded"] and "unguarded" in y
    if y["cost_saving_vs_best_rule"] is not None:
        verdict = "beats" if y["cost_saving_vs_best_rule"] > 0 else "does not beat"
        assert f"learned policy {verdict} the best rule's frontier" in text
    ev = tmp_path / "eval.json"
    assert evaluate.main(["--trace", str(trace), "--shards", "16", "--replicas", "1", "--policy",
                          f"checkpoint:{ck},checkpoint-unguarded:{ck}", "--json", str(ev), "--quiet"]) == 0
    pol = json.loads(ev.read_text())["policies"]
    m, bare = pol[f"checkpoint:{ck}"], pol[f"checkpoint-unguarded:{ck}"]
    assert m["guard_decisions"] > 0 and "guard_decisions" not in bare
    for k in ("cost_saving_vs_best_rule", "violation_ratio_vs_best_rule", "oracle_gap_closed"):
        assert m[k] == pytest.approx(y[k], rel=1e-9, abs=1e-12), k  # the guarded policy, both ways
        assert bare[k] == pytest.approx(y["unguarded"][k], rel=1e-9, abs=1e-12), k


def test_train_budget_in_updates_from_the_command_line(tmp_path):
    from launch import train
    out = tmp_path / "train.json"
    assert train.main(["--local", "--preset", "smoke", "--updates", "25", "--set", "max_env_ticks=none",
                       "--minutes", "2", "--json", str(out), "--checkpoint", str(tmp_path / "ck.pt"), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["updates"] == 25 and res["updates_budget"] == 25 and res["stopped_by"] == "updates"
    assert res["history"][-1]["updates"] == 25


def test_evaluate_refuses_a_comparison_with_too_few_windows(tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = evaluate.main(["--policy", "hpa,static", "--ticks", "70", "--shards", "2", "--json", str(out), "--quiet"])
    assert rc == 2
    text = capsys.readouterr().out
    assert "comparison refused: the range gives 16 settled class-windows" in text
    assert "saving vs best rule" not in text
    res = json.loads(out.read_text())
    assert "at least 2,000 are needed" in res["refused"] and set(res["policies"]) == {"hpa", "static"}


def test_evaluate_replicas_give_per_copy_rates(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert evaluate.main(["--policy", "hpa,static", "--ticks", "700", "--shards", "2", "--replicas", "3",
                          "--json", str(out), "--no-frontier", "--quiet"]) == 0
    res = json.loads(out.read_text())["policies"]
    for m in res.values():
        per = m["slo_violation_rate_per_replica"]
        assert m["replicas"] == 3 and m["shards"] == 6 and len(per) == 3
        assert m["slo_violation_rate"] == pytest.approx(sum(per) / 3)
        assert len(m["cost_per_segment"]) == 6 and m["cost_se"] >= 0
    text = capsys.readouterr().out
    assert "3 copies with their own arrivals" in text
    with pytest.raises(SystemExit):
        evaluate.main(["--policy", "hpa", "--replicas", "0"])
    with pytest.raises(SystemExit):
        evaluate.main(["--policy", "oracle", "--platform", "v1"])  # the oracle exists on v2 only


def test_evaluate_any_csv_and_clear_errors(tmp_path, capsys):
    p = tmp_path / "web_1min.csv"
    p.write_text("minute,hits,bytes\n" + "\n".join(f"{i},{100 + (i % 60)},{i}" for i in range(600)) + "\n")
    out = tmp_path / "web.json"
    assert evaluate.main(["--policy", "target", "--trace", str(p), "--ticks", "20", "--shards", "2",
                          "--no-frontier", "--quiet", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rate_columns"] == ["hits"] and "rate column hits" in capsys.readouterr().out  # named where used
    gw = tmp_path / "gateway_1min.csv"  # a timestamp first: refused, not read as a rate
    gw.write_text("ts_anon,hits\n" + "\n".join(f"{1_700_000_000 + 60 * i},{100 + i % 7}" for i in range(600)) + "\n")
    assert evaluate.main(["--policy", "hpa", "--trace", str(gw), "--quiet", "--no-frontier"]) == 2
    err = capsys.readouterr().err
    assert "'ts_anon' looks like a time" in err and "candidates ['hits']" in err
    assert evaluate.main(["--policy", "hpa", "--trace", str(gw), "--columns", "hits", "--ticks", "20",
                          "--shards", "2", "--no-frontier", "--quiet"]) == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("minute,hits\n0,1\n1,oops\n2,3\n")
    assert evaluate.main(["--policy", "hpa", "--trace", str(bad), "--quiet"]) == 2
    assert "bad.csv" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--policy", "magic"])


def test_evaluate_platform_v1_still_runs_its_rules(tmp_path):
    out = tmp_path / "v1.json"
    assert evaluate.main(["--platform", "v1", "--policy", "hpa", "--ticks", "60", "--shards", "2",
                          "--no-frontier", "--json", str(out), "--quiet"]) == 0
    m = json.loads(out.read_text())["policies"]["hpa"]
    assert m["warmup_ticks"] == 0 and "busy_cost" not in m  # v1's evaluation as it was


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/traces not present")
@pytest.mark.slow
def test_evaluate_every_shared_trace(tmp_path):
    out = tmp_path / "all.json"
    assert evaluate.main(["--policy", "hpa", "--trace", "shared", "--ticks", "10", "--shards", "1",
                          "--no-frontier", "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert len(res) == 7 and all("hpa" in v["policies"] for v in res.values())


def test_evaluate_as_a_module_subprocess():
    r = subprocess.run([sys.executable, "-m", "launch.evaluate", "--policy", "random", "--ticks", "5",
                        "--shards", "1", "--no-frontier", "--quiet"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "random" in r.stdout


@pytest.mark.slow
def test_bench_sim_writes_the_interface_keys(tmp_path, monkeypatch):
    out = tmp_path / "sim.json"
    assert bench.main(["sim", "--repeats", "1", "--seconds", "0.02", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("vectorised_steps_per_s", "loop_steps_per_s", "ratio"):
        assert res[key] > 0
    assert res["ratio"] == pytest.approx(res["vectorised_steps_per_s"] / res["loop_steps_per_s"])


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/traces not present")
def test_bundled_trace_is_reproducible_from_shared(tmp_path):
    make_default_trace.main(["--src", str(SHARED_TRACES), "--out", str(tmp_path)])
    data = ROOT / "apex_bdq" / "data"
    for name in ("azure_functions2019_4class_1min.csv", "azure_functions2019_4class_meta.csv",
                 "nasa_http_1995_aug_1min.csv.gz"):
        assert (tmp_path / name).read_bytes() == (data / name).read_bytes()
