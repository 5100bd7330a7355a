"""Ranked feedback (no Ray): trajectory segments, ranked pairs, the synthetic oracle and the
durable feedback log.

A *segment* is T consecutive decisions of one simulated shard: the observations the agent
saw, the actions it took, and the simulator's preference metrics over those ticks
(overload, unfairness, SLO breaches) plus per-tick series for a person to look at. A
*pair* says segment A is preferred to segment B (label 1.0) or that they are equally good
(0.5) — the Bradley–Terry data of Christiano et al. (NeurIPS 2017).

Feedback is precious: `FeedbackLog` appends every accepted pair (and, the first time it is
referenced, each of its segments) as one framed msgpack record — 4-byte length, 4-byte
CRC-32, msgpack payload — flushed and fsynced before the pair counts as accepted. Replay on
start-up reads records until the end; a torn or corrupt last record (a crash mid-append) is
reported with a warning and cut off, so appends continue from the last good record.
"""

from __future__ import annotations

import os
import struct
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import msgpack
import numpy as np

PREFERENCE_METRICS = ("overload", "unfairness", "slo_violation")
"""Per-segment metrics the simulator reports and the oracle ranks by (lower is better):
share of ticks above the utilisation threshold, 1 - mean Jain fairness of per-class service
quality, share of ticks on which some class's p99 latency broke its SLO."""

SERIES = ("load", "capacity", "p99_ms")
"""Per-tick series kept with a segment for `launch.feedback show` (offered Erlangs, active
servers, traffic-weighted p99 latency)."""


class FeedbackError(ValueError):
    """A ranked pair or segment that cannot be accepted (the message says why)."""


class UnknownSegment(FeedbackError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _arr_pack(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _arr_unpack(d: dict) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


@dataclass
class Segment:
    """T decisions of one shard. macro [T, Fm] float32, micro [T, K, H, Fu] float32,
    action [T, D] int64; metrics: PREFERENCE_METRICS -> float; series: SERIES -> [ticks]."""

    id: str
    macro: np.ndarray
    micro: np.ndarray
    action: np.ndarray
    metrics: dict
    series: dict = field(default_factory=dict)
    source: str = ""
    version: int = -1

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:12]

    def check(self, macro_features: int, micro_shape: tuple, num_branches: int, sub_actions: int) -> None:
        """Raise FeedbackError naming what is wrong with this segment."""
        sid = f"segment {self.id!r}"
        if not isinstance(self.id, str) or not self.id:
            raise FeedbackError(f"segment id must be a non-empty string, got {self.id!r}")
        T = self.macro.shape[0] if self.macro.ndim == 2 else -1
        if self.macro.ndim != 2 or self.macro.shape[1] != macro_features or T < 1:
            raise FeedbackError(f"{sid}: macro must be [T, {macro_features}], got {list(self.macro.shape)}")
        if self.micro.shape != (T,) + tuple(micro_shape):
            raise FeedbackError(f"{sid}: micro must be [T={T}, {', '.join(map(str, micro_shape))}], "
                                f"got {list(self.micro.shape)}")
        if self.action.shape != (T, num_branches) or self.action.dtype.kind not in "iu":
            raise FeedbackError(f"{sid}: action must be integers [T={T}, D={num_branches}], got "
                                f"{self.action.dtype} {list(self.action.shape)}")
        if self.action.size and (self.action.min() < 0 or self.action.max() >= sub_actions):
            raise FeedbackError(f"{sid}: action values must be in 0..{sub_actions - 1}")
        for name, a in (("macro", self.macro), ("micro", self.micro)):
            if not np.all(np.isfinite(a)):
                raise FeedbackError(f"{sid}: {name} holds NaN or inf")
        missing = [m for m in PREFERENCE_METRICS if m not in self.metrics]
        if missing:
            raise FeedbackError(f"{sid}: metrics {missing} missing (need {list(PREFERENCE_METRICS)})")
        bad = [m for m in PREFERENCE_METRICS if not np.isfinite(float(self.metrics[m]))]
        if bad:
            raise FeedbackError(f"{sid}: metrics {bad} are not finite")

    def to_record(self) -> dict:
        return {"id": self.id, "macro": _arr_pack(self.macro.astype(np.float32)),
                "micro": _arr_pack(self.micro.astype(np.float32)), "action": _arr_pack(self.action.astype(np.int64)),
                "metrics": {k: float(v) for k, v in self.metrics.items()},
                "series": {k: _arr_pack(np.asarray(v, dtype=np.float32)) for k, v in self.series.items()},
                "source": self.source, "version": int(self.version)}

    @classmethod
    def from_record(cls, r: dict) -> "Segment":
        return cls(id=r["id"], macro=_arr_unpack(r["macro"]), micro=_arr_unpack(r["micro"]),
                   action=_arr_unpack(r["action"]), metrics=dict(r["metrics"]),
                   series={k: _arr_unpack(v) for k, v in r.get("series", {}).items()},
                   source=r.get("source", ""), version=int(r.get("version", -1)))


@dataclass(frozen=True)
class PreferencePair:
    """`a` compared with `b`: label 1.0 = A preferred, 0.0 = B preferred, 0.5 = equally good."""

    a: str
    b: str
    label: float = 1.0
    source: str = "human"
    time: float = 0.0
    heldout: bool = False
    """Kept out of training to measure the head's ranking accuracy."""

    def key(self) -> tuple[str, str]:
        """Two rankings of the same two segments are duplicates, in either order."""
        return (self.a, self.b) if self.a < self.b else (self.b, self.a)

    def check(self) -> None:
        if not isinstance(self.a, str) or not isinstance(self.b, str) or not self.a or not self.b:
            raise FeedbackError(f"a pair names two segment ids, got a={self.a!r} b={self.b!r}")
        if self.a == self.b:
            raise FeedbackError(f"a pair needs two different segments, got {self.a!r} twice")
        if self.label not in (0.0, 0.5, 1.0):
            raise FeedbackError(f"pair label must be 1.0 (A preferred), 0.0 (B preferred) or 0.5 (tie), "
                                f"got {self.label!r}")


@dataclass
class PreferenceBatch:
    """P pairs of T-decision segments, ready for the Bradley–Terry loss.
    macro_a/b [P, T, Fm], micro_a/b [P, T, K, H, Fu], action_a/b [P, T, D], label [P]."""

    macro_a: np.ndarray
    micro_a: np.ndarray
    action_a: np.ndarray
    macro_b: np.ndarray
    micro_b: np.ndarray
    action_b: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return int(self.label.shape[0])

    @classmethod
    def from_pairs(cls, pairs: list[PreferencePair], segments: dict) -> "PreferenceBatch":
        sa = [segments[p.a] for p in pairs]
        sb = [segments[p.b] for p in pairs]
        T = min(s.macro.shape[0] for s in sa + sb)  # segments of one run share T; cut to the shortest
        return cls(macro_a=np.stack([s.macro[:T] for s in sa]), micro_a=np.stack([s.micro[:T] for s in sa]),
                   action_a=np.stack([s.action[:T] for s in sa]), macro_b=np.stack([s.macro[:T] for s in sb]),
                   micro_b=np.stack([s.micro[:T] for s in sb]), action_b=np.stack([s.action[:T] for s in sb]),
                   label=np.array([p.label for p in pairs], dtype=np.float32))


def oracle_label(a: Segment, b: Segment, weights: tuple[float, float, float], error_rate: float,
                 rng: np.random.Generator, tie_margin: float = 1e-6) -> float:
    """The synthetic labeller: the segment with the lower weighted sum of overload,
    unfairness and SLO breaches is preferred; with probability `error_rate` it answers at
    random instead (people err; Christiano et al. model a 10 % error rate)."""
    if rng.random() < error_rate:
        return float(rng.integers(0, 2))
    ca = sum(w * float(a.metrics[m]) for w, m in zip(weights, PREFERENCE_METRICS))
    cb = sum(w * float(b.metrics[m]) for w, m in zip(weights, PREFERENCE_METRICS))
    if abs(ca - cb) <= tie_margin:
        return 0.5
    return 1.0 if ca < cb else 0.0


def label_ceiling(given: list[float], rule: list[float]) -> float:
    """What a perfect ranker scores against labels `given`, knowing the rule's labels of the
    same pairs: the share of the strict given labels the rule agrees with, a tie under the rule
    counting 1/2 (random answers cap any ranker's accuracy there). NaN with no strict label."""
    hits = [0.5 if r == 0.5 else float(r == g) for g, r in zip(given, rule) if g != 0.5]
    return float(np.mean(hits)) if hits else float("nan")


def random_pairs(ids: list, n: int, rng: np.random.Generator) -> list[PreferencePair]:
    """Up to n distinct unordered pairs of different ids, drawn uniformly (unlabelled: 1.0);
    fewer when the ids do not make n pairs (4n draws at most)."""
    out, seen = [], set()
    for _ in range(4 * n):
        if len(out) >= n or len(ids) < 2:
            break
        i, j = rng.choice(len(ids), 2, replace=False)
        p = PreferencePair(ids[i], ids[j])
        if p.key() not in seen:
            seen.add(p.key())
            out.append(p)
    return out


# ----------------------------------------------------------------------------------------
_HEADER = struct.Struct("<II")  # payload length, CRC-32 of the payload


class FeedbackLog:
    """Append-only, fsynced log of framed msgpack records (see the module docstring).

    Records: {"kind": "meta", "net": {...}} first, then {"kind": "segment", "segment": Segment
    record} and {"kind": "pair", "a", "b", "label", "source", "time", "heldout"}.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.records_read = 0
        self.torn_bytes = 0
        good_end = self._scan()
        self._f = open(self.path, "ab")
        if self.torn_bytes:  # cut the torn tail so the next append starts on a record boundary
            self._f.truncate(good_end)
            self._f.flush()
            os.fsync(self._f.fileno())

    def _scan(self) -> int:
        """Offset just past the last intact record (and count/warn about a torn tail)."""
        if not os.path.exists(self.path):
            return 0
        end = 0
        for _, end in self._iter_with_offsets():
            pass
        size = os.path.getsize(self.path)
        if size > end:
            self.torn_bytes = size - end
            warnings.warn(f"feedback log {self.path}: the last {self.torn_bytes} bytes are a torn or corrupt "
                          f"record (a crash while appending?); skipped and cut off after "
                          f"{self.records_read} intact records", RuntimeWarning, stacklevel=3)
        return end

    def _iter_with_offsets(self) -> Iterator[tuple[dict, int]]:
        with open(self.path, "rb") as f:
            data = f.read()
        off = 0
        self.records_read = 0
        while off + _HEADER.size <= len(data):
            n, crc = _HEADER.unpack_from(data, off)
            start, stop = off + _HEADER.size, off + _HEADER.size + n
            if stop > len(data) or zlib.crc32(data[start:stop]) != crc:
                return
            try:
                rec = msgpack.unpackb(data[start:stop], raw=False)
            except Exception:  # noqa: BLE001 - a CRC-valid but undecodable payload ends the good prefix
                return
            self.records_read += 1
            off = stop
            yield rec, off

    def records(self) -> Iterator[dict]:
        """Every intact record, in append order."""
        self._f.flush()
        for rec, _ in self._iter_with_offsets():
            yield rec

    def append(self, record: dict) -> None:
        payload = msgpack.packb(record, use_bin_type=True)
        self._f.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        self._f.flush()
        os.fsync(self._f.fileno())

    def append_pair(self, pair: PreferencePair, new_segments: list[Segment]) -> None:
        """Segments first, then the pair, all before returning: a pair in the log always
        finds its segments when replayed."""
        for s in new_segments:
            self.append({"kind": "segment", "segment": s.to_record()})
        self.append({"kind": "pair", "a": pair.a, "b": pair.b, "label": float(pair.label),
                     "source": pair.source, "time": float(pair.time or time.time()), "heldout": bool(pair.heldout)})

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def replay_log(log: FeedbackLog) -> tuple[dict | None, dict, list[PreferencePair]]:
    """(meta, segments by id, pairs in order) from a log's intact records; meta is the
    first record ({"kind": "meta", "net": shapes of the network the segments fit})."""
    meta = None
    segments: dict[str, Segment] = {}
    pairs: list[PreferencePair] = []
    for rec in log.records():
        kind = rec.get("kind")
        if kind == "meta" and meta is None:
            meta = rec
        elif kind == "segment":
            s = Segment.from_record(rec["segment"])
            segments[s.id] = s
        elif kind == "pair":
            pairs.append(PreferencePair(a=rec["a"], b=rec["b"], label=float(rec["label"]),
                                        source=rec.get("source", ""), time=float(rec.get("time", 0.0)),
                                        heldout=bool(rec.get("heldout", False))))
    return meta, segments, pairs


def load_log(path: str) -> tuple[dict | None, dict, list[PreferencePair]]:
    log = FeedbackLog(path)
    try:
        return replay_log(log)
    finally:
        log.close()


def segment_summary(s: Segment) -> dict:
    return {"id": s.id, "decisions": int(s.macro.shape[0]), "source": s.source, "version": s.version,
            **{m: round(float(s.metrics[m]), 4) for m in PREFERENCE_METRICS}}
