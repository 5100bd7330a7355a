"""`python -m launch.bench feedback-log`: acknowledged feedback pairs per second, fsynced, with
the project's framed log (`apex_bdq.preference.FeedbackLog`) beside SQLite in WAL mode with
`synchronous=FULL` (the mainstream alternative), on the same records and the same disk.

Two mixes, as a run writes them: a pair whose two segments are new (three records: two
segments of the default network's shape, ~6.7 KB each, and the pair), and a pair of segments
already in the log (one small record). Each pair is durable before the next starts: one
fsync'ed append per record for the log, one committed transaction per pair for SQLite.
"""
from __future__ import annotations

import os
import sqlite3
import tempfile
import time

import msgpack
import numpy as np

from apex_bdq.config import NetConfig, SimConfig
from apex_bdq.preference import FeedbackLog, PreferencePair, Segment


def _segments(n: int, rng: np.random.Generator) -> list[Segment]:
    net = NetConfig.for_sim(SimConfig())
    T = 16
    return [Segment(id=Segment.new_id(), macro=rng.normal(size=(T, net.macro_features)).astype(np.float32),
                    micro=rng.normal(size=(T, net.num_classes, net.history, net.micro_features)).astype(np.float32),
                    action=rng.integers(0, net.sub_actions, size=(T, net.num_branches)),
                    metrics={"overload": 0.1, "unfairness": 0.0, "slo_violation": 0.0},
                    series={"load": rng.random(30).astype(np.float32)}, source="bench", version=1)
            for _ in range(n)]


def _pair_record(p: PreferencePair) -> dict:
    return {"kind": "pair", "a": p.a, "b": p.b, "label": p.label, "source": p.source, "time": p.time,
            "heldout": p.heldout}


def _framed(folder: str, pairs: list[PreferencePair], segs: dict, new: bool) -> float:
    log = FeedbackLog(os.path.join(folder, "feedback.log"))
    t0 = time.perf_counter()
    for p in pairs:
        log.append_pair(p, [segs[p.a], segs[p.b]] if new else [])
    dt = time.perf_counter() - t0
    log.close()
    return len(pairs) / dt


def _sqlite(folder: str, pairs: list[PreferencePair], segs: dict, new: bool) -> float:
    db = sqlite3.connect(os.path.join(folder, "feedback.sqlite"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit: durable when acknowledged
    db.execute("CREATE TABLE IF NOT EXISTS records (seq INTEGER PRIMARY KEY, kind TEXT, body BLOB)")
    t0 = time.perf_counter()
    for p in pairs:
        db.execute("BEGIN IMMEDIATE")
        if new:
            for s in (segs[p.a], segs[p.b]):
                db.execute("INSERT INTO records (kind, body) VALUES ('segment', ?)",
                           (msgpack.packb({"kind": "segment", "segment": s.to_record()}, use_bin_type=True),))
        db.execute("INSERT INTO records (kind, body) VALUES ('pair', ?)",
                   (msgpack.packb(_pair_record(p), use_bin_type=True),))
        db.execute("COMMIT")
    dt = time.perf_counter() - t0
    db.close()
    return len(pairs) / dt


def bench_feedback_log(pairs: int = 300, repeats: int = 3, folder: str | None = None) -> dict:
    rng = np.random.default_rng(0)
    segs = {s.id: s for s in _segments(2 * pairs, rng)}
    ids = list(segs)
    plist = [PreferencePair(a=ids[2 * i], b=ids[2 * i + 1], label=1.0, source="bench", time=time.time())
             for i in range(pairs)]
    res: dict = {"pairs": pairs, "repeats": repeats, "folder": folder or tempfile.gettempdir()}
    rows = []
    for mix, new in (("pair_with_2_new_segments", True), ("pair_only", False)):
        for name, fn in (("framed_log", _framed), ("sqlite_wal", _sqlite)):
            rates = []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory(dir=folder) as d:
                    rates.append(fn(d, plist, segs, new))
            res[f"{name}_{mix}_pairs_per_s"] = float(np.median(rates))
            rows.append((mix, name, float(np.median(rates))))
        res[f"framed_over_sqlite_{mix}"] = (res[f"framed_log_{mix}_pairs_per_s"]
                                            / res[f"sqlite_wal_{mix}_pairs_per_s"])
    print(f"acknowledged (fsynced) feedback pairs per second, {pairs} pairs, median of {repeats}, "
          f"on {res['folder']}:")
    print(f"{'mix':<28}{'framed log':>12}{'SQLite WAL':>12}{'ratio':>8}")
    for mix in ("pair_with_2_new_segments", "pair_only"):
        f, s = res[f"framed_log_{mix}_pairs_per_s"], res[f"sqlite_wal_{mix}_pairs_per_s"]
        print(f"{mix:<28}{f:>12,.0f}{s:>12,.0f}{f / s:>7.2f}x")
    return res
