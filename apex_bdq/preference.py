"""Ranked feedback (no Ray): trajectory segments, ranked pairs, the synthetic oracle and the
durable feedback log.

A *segment* is T consecutive decisions of one simulated shard: the observations the agent
saw, the actions it took, and the simulator's preference metrics over those ticks
(overload, unfairness, SLO breaches) plus per-tick series for a person to look at. A
*pair* says segment A is preferred to segment B (label 1.0) or that they are equally good
(0.5) — the Bradley–Terry data of Christiano et al. (NeurIPS 2017).

Feedback is precious: `FeedbackLog` appends every accepted pair (and, the first time it is
referenced, each of its segments) as one framed msgpack record — 4-byte magic, length,
CRC-32 of the payload, CRC-32 of the header, msgpack payload — flushed and fsynced before the pair counts as accepted. Replay on
start-up skips and reports a corrupt record and keeps every intact record after it; a torn
last record (a crash mid-append) is reported and cut off, so appends continue on a record
boundary. One writer at a time (an exclusive lock); readers open it read-only.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import msgpack
import numpy as np

from apex_bdq.durable import fsync_dir

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
FILE_MAGIC = b"APXFBL2\n"  # first 8 bytes of a feedback log (format 2)
_RECORD_MAGIC = b"\xa5FB\x5a"  # starts every record: where a scan picks up again after a corrupt one
_HEADER = struct.Struct("<4sIII")  # record magic, payload length, CRC-32 of the payload, CRC-32 of the 12 before


def _frame(payload: bytes) -> bytes:
    head = struct.pack("<4sII", _RECORD_MAGIC, len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def pair_records(pair: PreferencePair, new_segments: list[Segment]) -> list[dict]:
    """The log records of an accepted pair: its segments not logged yet, then the pair."""
    return [{"kind": "segment", "segment": s.to_record()} for s in new_segments] + [
        {"kind": "pair", "a": pair.a, "b": pair.b, "label": float(pair.label), "source": pair.source,
         "time": float(pair.time or time.time()), "heldout": bool(pair.heldout)}]


def _records_v1(data: bytes, limit: Optional[int] = None) -> list[dict]:
    """The intact prefix of a format-1 log: <length, CRC-32 of the payload> + msgpack payload."""
    out, off = [], 0
    while off + 8 <= len(data) and (limit is None or len(out) < limit):
        n, crc = struct.unpack_from("<II", data, off)
        payload = data[off + 8:off + 8 + n]
        if len(payload) != n or zlib.crc32(payload) != crc:
            break
        try:
            rec = msgpack.unpackb(payload, raw=False)
        except Exception:  # noqa: BLE001 - the end of the intact prefix
            break
        if not isinstance(rec, dict) or "kind" not in rec:
            break
        out.append(rec)
        off += 8 + n
    return out


class FeedbackLog:
    """Append-only, fsynced log of framed msgpack records (see the module docstring).

    Records: {"kind": "meta", "net": {...}} first, then {"kind": "segment", "segment": Segment
    record} and {"kind": "pair", "a", "b", "label", "source", "time", "heldout"}.

    Each record carries a magic, its length and a CRC-32 over both: a corrupt record (a
    flipped byte anywhere) is skipped, reported (`corrupt_records`, `corrupt_bytes`, a
    RuntimeWarning) and every intact record after it is kept; only a torn tail (a record cut
    short by a crash while appending) is cut off, and only by a writer. One writer at a time:
    opening for writing takes an exclusive `flock` and a second writer is refused with a
    FeedbackError. `readonly=True` opens for reading only: no lock, nothing written or cut,
    safe beside a live writer (whose half-written last record is then reported as torn).
    """

    def __init__(self, path: str, readonly: bool = False, lock_wait_s: float = 10.0) -> None:
        """lock_wait_s: how long a writer waits for the lock before refusing (a restarted
        preference actor whose predecessor's process is still exiting gets it then)."""
        self.path = os.path.abspath(path)
        self.readonly = readonly
        self.records_read = 0
        self.torn_bytes = 0
        self.corrupt_records = 0
        self.corrupt_bytes = 0
        self.orphan_pairs = 0  # set by replay_log
        self.migrated_from: Optional[str] = None  # a format-1 log kept beside the converted one
        self._v1: Optional[list] = None  # a format-1 log read in place (read-only)
        self._f = None
        if readonly:
            if not os.path.isfile(self.path):
                raise FeedbackError(f"feedback log {self.path!r} does not exist")
            if self._check_magic() == 1:
                self._v1 = _records_v1(Path(self.path).read_bytes())
                self.records_read = len(self._v1)
                return
            self._scan()
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        created = not os.path.exists(self.path)
        f = open(self.path, "ab")
        deadline = time.monotonic() + lock_wait_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                f.close()
                raise FeedbackError(f"feedback log {self.path!r} is open for writing by another process (a running "
                                    f"run or launch.feedback rank; waited {lock_wait_s:g} s): one writer at a time; "
                                    "read it with launch.feedback --log PATH list, or rank through the run "
                                    "(--address)") from None
        self._f = f
        try:
            if created or os.path.getsize(self.path) == 0:
                f.write(FILE_MAGIC)
                f.flush()
                os.fsync(f.fileno())
                fsync_dir(self.path)  # the new file's directory entry is durable too
            elif self._check_magic() == 1:
                self._migrate_v1()
            good_end = self._scan()
            if self.torn_bytes:  # cut the torn tail so the next append starts on a record boundary
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            self.close()  # and with it the lock
            raise

    def _migrate_v1(self) -> None:
        """A log of format 1 (before record magics and file magic): its intact records are
        rewritten as format 2 in place (atomically), the original kept as PATH.v1."""
        from apex_bdq.durable import atomic_write_bytes
        data = Path(self.path).read_bytes()
        records = _records_v1(data)
        backup = self.path + ".v1"
        atomic_write_bytes(backup, data)
        atomic_write_bytes(self.path, FILE_MAGIC + b"".join(_frame(msgpack.packb(r, use_bin_type=True))
                                                            for r in records))
        self._f.close()  # the old inode: reopen the converted file, and lock it
        self._f = open(self.path, "ab")
        fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.migrated_from = backup
        warnings.warn(f"feedback log {self.path}: format 1 converted to format 2 ({len(records)} records); the "
                      f"original is kept as {backup}", RuntimeWarning, stacklevel=3)

    def _check_magic(self) -> int:
        """The log's format: 2, or 1 (a log of an earlier version); anything else is refused.
        A damaged file magic before an intact first record is reported, not fatal."""
        with open(self.path, "rb") as f:
            head = f.read(len(FILE_MAGIC) + _HEADER.size + (1 << 20))
        if head[:len(FILE_MAGIC)] == FILE_MAGIC:
            return 2
        if len(head) > len(FILE_MAGIC) and self._record_at(head, len(FILE_MAGIC))[0] is not None:
            self.corrupt_bytes += len(FILE_MAGIC)
            warnings.warn(f"feedback log {self.path}: its file magic is damaged; the records after it are intact "
                          "and read", RuntimeWarning, stacklevel=3)
            return 2
        if _records_v1(head, limit=1):
            return 1
        raise FeedbackError(f"feedback log {self.path!r} does not start with {FILE_MAGIC!r} nor with a record of "
                            "format 1: not a feedback log")

    def _scan(self) -> int:
        """Offset just past the last intact record; counts and warns about corrupt records and
        a torn tail."""
        end = len(FILE_MAGIC)
        for _, end in self._iter_with_offsets():
            pass
        size = os.path.getsize(self.path)
        if self.corrupt_records:
            warnings.warn(f"feedback log {self.path}: {self.corrupt_records} corrupt record(s) "
                          f"({self.corrupt_bytes} bytes) skipped; {self.records_read} intact records kept, "
                          "including every one after them", RuntimeWarning, stacklevel=3)
        if self.torn_bytes:
            warnings.warn(f"feedback log {self.path}: the last {self.torn_bytes} bytes are a torn record (a crash, "
                          "or a writer appending right now); "
                          + ("left in place (read-only)" if self.readonly else "cut off")
                          + f" after {self.records_read} intact records", RuntimeWarning, stacklevel=3)
        return min(end, size)

    @staticmethod
    def _record_at(data: bytes, off: int) -> tuple[Optional[dict], int, bool]:
        """(record, offset past it, torn) at `off`; record None when there is none intact.
        torn: the bytes run out before the record does (a write cut short)."""
        if off + _HEADER.size > len(data):
            return None, off, True
        magic, n, crc, head_crc = _HEADER.unpack_from(data, off)
        if magic != _RECORD_MAGIC or zlib.crc32(data[off:off + _HEADER.size - 4]) != head_crc:
            return None, off, False  # a damaged header (its length cannot be trusted): corrupt
        start, stop = off + _HEADER.size, off + _HEADER.size + n
        if stop > len(data):
            return None, off, True  # an intact header whose payload runs past the end: torn
        payload = data[start:stop]
        if zlib.crc32(payload) != crc:
            return None, off, False
        try:
            return msgpack.unpackb(payload, raw=False), stop, False
        except Exception:  # noqa: BLE001 - a CRC-valid but undecodable payload is corrupt
            return None, off, False

    def _iter_with_offsets(self) -> Iterator[tuple[dict, int]]:
        with open(self.path, "rb") as f:
            data = f.read()
        off = len(FILE_MAGIC)
        self.records_read = self.torn_bytes = self.corrupt_records = self.corrupt_bytes = 0
        while off < len(data):
            rec, stop, torn = self._record_at(data, off)
            if rec is not None:
                self.records_read += 1
                off = stop
                yield rec, off
                continue
            nxt = data.find(_RECORD_MAGIC, off + 1)  # resynchronise on the next intact record
            while nxt != -1 and self._record_at(data, nxt)[0] is None:
                nxt = data.find(_RECORD_MAGIC, nxt + 1)
            if nxt == -1:
                if torn:
                    self.torn_bytes = len(data) - off
                else:  # a whole record with a bad byte at the end: corrupt, not torn; left in place
                    self.corrupt_records += 1
                    self.corrupt_bytes += len(data) - off
                return
            self.corrupt_records += 1
            self.corrupt_bytes += nxt - off
            off = nxt

    def records(self) -> Iterator[dict]:
        """Every intact record, in append order."""
        if self._v1 is not None:
            yield from self._v1
            return
        if self._f is not None:
            self._f.flush()
        for rec, _ in self._iter_with_offsets():
            yield rec

    def append(self, *records: dict) -> None:
        """Append records in order with one write and one fsync: durable when this returns. A
        crash part-way leaves a prefix of them intact (each is framed on its own)."""
        if self._f is None:
            raise FeedbackError(f"feedback log {self.path!r} is open read-only")
        self._f.write(b"".join(_frame(msgpack.packb(r, use_bin_type=True)) for r in records))
        self._f.flush()
        os.fsync(self._f.fileno())

    def append_pair(self, pair: PreferencePair, new_segments: list[Segment]) -> None:
        """Segments first, then the pair, in one fsynced append: a pair in the log always
        finds its segments when replayed."""
        self.append(*pair_records(pair, new_segments))

    def close(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()  # closing releases the lock


def replay_log(log: FeedbackLog) -> tuple[dict | None, dict, list[PreferencePair]]:
    """(meta, segments by id, pairs in order) from a log's intact records; meta is the
    first record ({"kind": "meta", "net": shapes of the network the segments fit}). A pair
    whose segments are not in the log (lost to a corrupt record) is left out, counted in
    `log.orphan_pairs` and warned about."""
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
    kept = [p for p in pairs if p.a in segments and p.b in segments]
    log.orphan_pairs = len(pairs) - len(kept)
    if log.orphan_pairs:
        warnings.warn(f"feedback log {log.path}: {log.orphan_pairs} pair(s) left out: their segments are not in "
                      "the log (lost to a corrupt record)", RuntimeWarning, stacklevel=2)
    return meta, segments, kept


def load_log(path: str) -> tuple[dict | None, dict, list[PreferencePair]]:
    """Read a feedback log without opening it for writing (safe beside a live writer)."""
    log = FeedbackLog(path, readonly=True)
    return replay_log(log)


def segment_summary(s: Segment) -> dict:
    return {"id": s.id, "decisions": int(s.macro.shape[0]), "source": s.source, "version": s.version,
            **{m: round(float(s.metrics[m]), 4) for m in PREFERENCE_METRICS}}
