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


def test_evaluate_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    rc = evaluate.main(["--policy", "hpa,static", "--ticks", "70", "--shards", "2", "--json", str(out),
                        "--plot", str(png), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res) == {"hpa", "static"}
    for m in res.values():
        assert set(METRIC_KEYS) <= set(m)
        assert 0 <= m["slo_violation_rate"] <= 1 and 0 < m["utilisation"] <= 1
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "slo_violation_rate" in text and "hpa" in text and "static" in text


def test_evaluate_replicas_give_per_copy_rates_and_a_paired_comparison(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert evaluate.main(["--policy", "hpa,static", "--ticks", "700", "--shards", "2", "--replicas", "3",
                          "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    for m in res.values():
        per = m["slo_violation_rate_per_replica"]
        assert m["replicas"] == 3 and m["shards"] == 6 and len(per) == 3
        assert m["slo_violation_rate"] == pytest.approx(sum(per) / 3)
    text = capsys.readouterr().out
    assert "3 copies with their own arrivals" in text and "vs hpa" in text
    with pytest.raises(SystemExit):
        evaluate.main(["--policy", "hpa", "--replicas", "0"])


def test_evaluate_any_csv_and_clear_errors(tmp_path, capsys):
    p = tmp_path / "web_1min.csv"
    p.write_text("minute,hits,bytes\n" + "\n".join(f"{i},{100 + (i % 60)},{i}" for i in range(600)) + "\n")
    assert evaluate.main(["--policy", "target", "--trace", str(p), "--ticks", "20", "--shards", "2",
                          "--quiet"]) == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("minute,hits\n0,1\n1,oops\n2,3\n")
    assert evaluate.main(["--policy", "hpa", "--trace", str(bad), "--quiet"]) == 2
    assert "bad.csv" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--policy", "magic"])


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/traces not present")
def test_evaluate_every_shared_trace(tmp_path):
    out = tmp_path / "all.json"
    assert evaluate.main(["--policy", "hpa", "--trace", "shared", "--ticks", "10", "--shards", "1",
                          "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert len(res) == 7 and all("hpa" in v for v in res.values())


def test_evaluate_as_a_module_subprocess():
    r = subprocess.run([sys.executable, "-m", "launch.evaluate", "--policy", "random", "--ticks", "5",
                        "--shards", "1", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "random" in r.stdout


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
    for name in ("azure_functions2019_4class_1min.csv", "azure_functions2019_4class_meta.csv"):
        assert (tmp_path / name).read_bytes() == (data / name).read_bytes()
