"""Trace loader: every shared trace, the bundled default, normalisation, clear errors."""

import csv

import numpy as np
import pytest

from apex_bdq.config import BUNDLED_SERVICE_TIME_S, SimConfig, TraceConfig
from apex_bdq.sim import make_sim
from apex_bdq.sim.platform import make_rates
from apex_bdq.sim.trace import BUNDLED_COLUMNS, BUNDLED_TRACE, DATA_DIR, TraceError, load_trace, make_tick_rates

from conftest import SHARED_TRACES

EXPECTED_INTERVAL = {
    "alibaba2018_machine_usage_5min.csv": 300.0,  # no time column: from the name
    "azure_functions2019_invitro1000_1min.csv": 60.0,
    "azure_functions2019_invitro1000_top50_1min.csv": 60.0,
    "azure_vm2019_total_usage_5min.csv": 300.0,  # timestamp in seconds
    "google2019_cell_usage_5min.csv": 300.0,
    "nasa_http_1995_1min.csv": 60.0,  # date + minute_of_day
    "nasa_http_1995_1s_1995-07-13.csv": 1.0,
}


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/traces not present")
@pytest.mark.parametrize("name", sorted(EXPECTED_INTERVAL))
def test_every_shared_trace_loads(name):
    tr = load_trace(SHARED_TRACES / name)
    assert tr.interval_s == EXPECTED_INTERVAL[name]
    assert tr.counts.shape[1] == 1 and len(tr.counts) > 1000
    assert np.isfinite(tr.counts).all() and (tr.counts >= 0).all()
    assert ((tr.time_of_day_s >= 0) & (tr.time_of_day_s < 86400)).all()


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/traces not present")
def test_nasa_gap_days_keep_time_of_day():
    tr = load_trace(SHARED_TRACES / "nasa_http_1995_1min.csv")
    rows = list(csv.DictReader(open(SHARED_TRACES / "nasa_http_1995_1min.csv")))
    i = next(i for i, r in enumerate(rows) if r["date"] == "1995-08-01")
    assert tr.time_of_day_s[i] == float(rows[i]["minute_of_day"]) * 60.0


def test_bundled_trace_and_its_service_times():
    tr = load_trace(BUNDLED_TRACE, BUNDLED_COLUMNS)
    assert tr.counts.shape == (1440, 4) and tr.interval_s == 60.0
    meta = list(csv.DictReader(open(DATA_DIR / "azure_functions2019_4class_meta.csv")))
    svc = [float(m["mean_service_ms"]) / 1000.0 for m in meta]
    np.testing.assert_allclose(svc, BUNDLED_SERVICE_TIME_S, rtol=1e-4)
    # The attribution travels with the data.
    readme = (DATA_DIR / "README.md").read_text()
    assert "CC-BY 4.0" in readme and "Shahrad" in readme


def test_normalised_to_target_load_on_training_range():
    cfg = SimConfig(mean_load_erlangs=30.0, class_share=(1, 1, 2, 4))
    r = make_rates(cfg)
    lo, hi = r.train[0], r.eval[0]  # training + validation: what the rates are normalised over
    load = r.rates[lo:hi] * np.asarray(cfg.service_time_s)  # Erlangs per class
    np.testing.assert_allclose(load.mean(0), np.array([1, 1, 2, 4]) / 8 * 30.0, rtol=1e-3)
    assert r.train[1] == r.val[0] and r.val[1] == r.eval[0] and r.eval[1] == len(r.rates)
    # The bundled v2 trace is four whole weeks: 7 held-out days, 3 validation days, 18 training days.
    day = r.ticks_per_day
    assert (r.eval[1] - r.eval[0], r.val[1] - r.val[0], r.train[1]) == (7 * day, 3 * day, 18 * day)


def test_resampling_keeps_the_volume(step_trace, tmp_path):
    p = tmp_path / "minutes_1min.csv"
    counts = np.random.default_rng(0).integers(0, 1000, 120)
    p.write_text("minute,req\n" + "\n".join(f"{i},{c}" for i, c in enumerate(counts)) + "\n")
    tr = load_trace(p)
    r = make_tick_rates(tr, 1.0, 1, (1.0,), (1.0,), 10.0, 0.25)
    scale = 10.0 / (counts[:90].sum() / (90 * 60.0))  # per-second rate normalised to 10 Erlangs
    # Linear interpolation between minute centres keeps the total within the edge effects.
    assert r.rates.sum() / scale == pytest.approx(counts.sum(), rel=0.02)


def test_single_column_split_over_classes_and_many_columns_mapped(tmp_path):
    p = tmp_path / "two_1min.csv"
    p.write_text("minute,a,b\n" + "\n".join(f"{i},{10 + i},{5}" for i in range(100)) + "\n")
    one = make_tick_rates(load_trace(p, ["a"]), 1.0, 4, (1.0,) * 4, (0.25,) * 4, 8.0, 0.25)
    assert one.rates.shape[1] == 4
    np.testing.assert_allclose(one.rates[:, 0], one.rates[:, 3])
    with pytest.raises(TraceError, match="2 rate columns .* cannot map onto 4 classes"):
        make_tick_rates(load_trace(p, ["a", "b"]), 1.0, 4, (1.0,) * 4, (0.25,) * 4, 8.0, 0.25)


@pytest.mark.parametrize("text,match", [
    ("minute,req\n0,1\n1,2,3\n2,4\n", "row 3 has 3 fields"),
    ("minute,req\n0,1\n1,-2\n2,4\n", "row 3 is negative"),
    ("minute,req\n0,1\n1,nan\n2,4\n", "not a finite number"),
    ("minute,req\n0,1\n0,2\n1,4\n", "not increasing"),
    ("minute,name\n0,a\n1,b\n2,c\n", "no numeric rate column"),
    ("minute,req\n0,1\n", "at least 2 data rows"),
    ("minute,req\n0,0\n1,0\n2,0\n", "all zero"),
    ("date,minute_of_day,req\n1995-07-01,0,1\nnot-a-date,1,2\n1995-07-01,2,3\n", "bad date"),
])
def test_malformed_files_name_the_file_and_the_problem(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(TraceError, match=match) as e:
        load_trace(p)
    assert "bad.csv" in str(e.value)


def test_missing_file_unknown_column_and_unknown_interval(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")
    p = tmp_path / "noclock.csv"
    p.write_text("req\n1\n2\n3\n")
    with pytest.raises(TraceError, match="no time column .* pass interval_s"):
        load_trace(p)
    assert load_trace(p, interval_s=5.0).interval_s == 5.0
    q = tmp_path / "x_1min.csv"
    q.write_text("minute,req\n0,1\n1,2\n")
    with pytest.raises(TraceError, match=r"no numeric column \['nope'\]"):
        load_trace(q, ["nope"])


def test_sim_config_with_a_bad_trace_fails_when_built(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("minute,req\n0,1\n1,x\n")
    with pytest.raises(TraceError, match="bad.csv"):
        make_sim(SimConfig(trace=TraceConfig(path=str(p))))


def _write(p, header, rows):
    p.write_text(",".join(header) + "\n" + "".join(",".join(str(x) for x in r) + "\n" for r in rows))
    return p


@pytest.mark.parametrize("header,first,why", [
    (("ts_anon", "requests"), lambda i: 1_700_000_000 + 60 * i, "named like a time"),  # a gateway trace
    (("elapsed_minute", "events"), lambda i: i, "named like a time"),  # a stream trace
    (("n", "requests"), lambda i: 3 * i + 7, "increasing on every row"),  # an unnamed row counter
    (("x", "requests"), lambda i: 1_700_000_000_000 + (i * 7919) % 5000, "epoch-sized"),  # Unix ms, unordered
])
def test_a_time_like_first_column_is_refused_with_the_candidates(tmp_path, header, first, why):
    rng = np.random.default_rng(0)
    rows = [(first(i), int(rng.poisson(50))) for i in range(200)]
    p = _write(tmp_path / "trace_1min.csv", header, rows)
    with pytest.raises(TraceError, match=why) as e:
        load_trace(p)
    msg = str(e.value)
    assert "trace_1min.csv" in msg and repr(header[0]) in msg and "--columns" in msg
    assert f"candidates [{header[1]!r}]" in msg
    tr = load_trace(p, [header[1]])  # named explicitly, the rate column is read
    assert tr.columns == (header[1],) and tr.counts[:, 0].tolist() == [r[1] for r in rows]


def test_rate_columns_that_only_mention_a_unit_are_rates(tmp_path):
    rng = np.random.default_rng(1)
    p = _write(tmp_path / "t_1min.csv", ("requests_per_minute", "cpu"),
               [(int(rng.poisson(40)), 0.5) for _ in range(100)])
    assert load_trace(p).columns == ("requests_per_minute",)


def test_an_all_zero_range_names_the_file_column_and_rows(tmp_path):
    rows = [(i, 10 if i < 150 else 0) for i in range(200)]
    p = _write(tmp_path / "quiet_1min.csv", ("minute", "req"), rows)
    with pytest.raises(TraceError, match=r"quiet_1min\.csv.*column 'req' \(class 0\) is all zero over rows "
                                         r"\d+-\d+, the held-out range"):
        make_tick_rates(load_trace(p), 60.0, 4, (1.0,) * 4, (0.25,) * 4, 8.0, 0.25)
    rows = [(i, 0 if i < 150 else 10) for i in range(200)]
    p = _write(tmp_path / "late_1min.csv", ("minute", "req"), rows)
    with pytest.raises(TraceError, match=r"late_1min\.csv.*column 'req' .*all zero over rows 2-\d+, the training"):
        make_tick_rates(load_trace(p), 60.0, 4, (1.0,) * 4, (0.25,) * 4, 8.0, 0.25)


def test_the_range_of_every_table_names_the_rate_columns(tmp_path):
    rates = make_tick_rates(load_trace(BUNDLED_TRACE, list(BUNDLED_COLUMNS)), 60.0, 4, BUNDLED_SERVICE_TIME_S,
                            (0.25,) * 4, 8.0, 0.25)
    for split in ("train", "eval"):
        text = rates.describe(split)
        assert all(c in text for c in BUNDLED_COLUMNS) and "rate columns" in text
