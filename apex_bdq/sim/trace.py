"""Trace loader: real request-rate series -> per-tick, per-class arrival rates.

A trace is a CSV with a header row: an optional time column plus one or more numeric rate
columns (counts per row interval). The loader resamples to the simulator tick, normalises to
a target mean offered load, and splits train / evaluation time ranges. Phase shift and
Poisson noise are applied per shard by the simulator, which owns the random stream.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import gzip
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
# Platform v1's default: one day of Azure Functions 2019, four classes.
BUNDLED_TRACE = DATA_DIR / "azure_functions2019_4class_1min.csv"
BUNDLED_COLUMNS = ("c0_lt200ms", "c1_200ms_5s", "c2_5s_60s", "c3_ge60s")
# Platform v2's default: four weeks of NASA-HTTP 1995 (multi-day, so daily and weekly
# patterns can be learnt on earlier days and judged on later ones).
BUNDLED_TRACE_V2 = DATA_DIR / "nasa_http_1995_aug_1min.csv.gz"
BUNDLED_COLUMNS_V2 = ("requests",)


BUNDLED_SMOOTH_S_V2 = 300.0  # trace.smooth_s of the bundled v2 trace (see TraceConfig.smooth_s)


def bundled_trace(platform: str) -> tuple[Path, tuple[str, ...]]:
    """The default trace file and its rate columns for a platform ("v1" or "v2")."""
    if platform == "v2":
        return BUNDLED_TRACE_V2, BUNDLED_COLUMNS_V2
    return BUNDLED_TRACE, BUNDLED_COLUMNS


def default_smooth_s(path: str | Path) -> float:
    """TraceConfig.smooth_s when it is None: 300 s for the bundled NASA trace (on either
    platform), 0 for any other file."""
    try:
        same = Path(path).resolve() == BUNDLED_TRACE_V2.resolve()
    except OSError:
        same = False
    return BUNDLED_SMOOTH_S_V2 if same else 0.0

# Time columns understood, with seconds per unit. `date` (YYYY-MM-DD) adds whole days.
TIME_COLUMNS = {"second": 1.0, "seconds": 1.0, "timestamp": 1.0, "time_s": 1.0,
                "minute": 60.0, "minute_of_day": 60.0, "hour": 3600.0}
# A column named like one of these words (alone or between underscores) is a time, not a rate.
_TIME_NAME = re.compile(r"(?:^|_)(?:t|ts|time|times|timestamp|datetime|date|epoch|elapsed|tick|step|index|idx|"
                        r"sec|secs|second|seconds|min|mins|minute|minutes|hour|hours|day|days|week|unix)(?:_|$)",
                        re.IGNORECASE)
# Unix epoch seconds (1992-2100) or milliseconds: a value of this size that barely varies is a clock.
_EPOCH_S = (7.0e8, 4.2e9)
_SUFFIX = re.compile(r"_(\d+(?:\.\d+)?)(s|sec|min|m|h)(?:_|\.|$)")
_SUFFIX_UNIT = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}


class TraceError(ValueError):
    """A trace file is missing, malformed or does not fit the request."""


@dataclass(frozen=True)
class Trace:
    """Per-row rates of one CSV, before resampling."""

    path: str
    columns: tuple[str, ...]
    counts: np.ndarray  # [T, C] float64, events per row interval
    interval_s: float
    time_of_day_s: np.ndarray  # [T] seconds since midnight at the start of each row
    time_of_week_s: Optional[np.ndarray] = None  # [T] seconds since Monday 00:00 (weekday from a `date` column)

    @property
    def rates_per_s(self) -> np.ndarray:  # [T, C]
        return self.counts / self.interval_s


def _interval_from_name(path: Path) -> Optional[float]:
    m = _SUFFIX.search(path.stem + ".")
    return float(m.group(1)) * _SUFFIX_UNIT[m.group(2)] if m else None


def time_like(name: str, values: np.ndarray) -> Optional[str]:
    """Why a numeric column looks like a time axis rather than a rate, or None.

    Named like a time (`ts_anon`, `elapsed_minute`, `unix_time`, ...); a counter (increasing
    from row to row across the whole file, as a time index is and a real load never is); or
    epoch-sized (every value a plausible Unix time in seconds or milliseconds, varying by
    less than 10 %).
    """
    if _TIME_NAME.search(re.sub(r"(?i)(?:^|_)per_[a-z]+", "", name.strip())):  # `requests_per_minute` is a rate
        return "named like a time"
    v = np.asarray(values, dtype=np.float64)
    if len(v) >= 20 and np.isfinite(v).all():  # a few rising rows of a tiny file are not a clock
        d = np.diff(v)
        if (d >= 0).all() and (d > 0).mean() >= 0.99:
            return "increasing on every row (a counter or time index)"
        lo, hi, med = float(v.min()), float(v.max()), float(np.median(v))
        for scale in (1.0, 1000.0):
            if _EPOCH_S[0] * scale <= lo and hi <= _EPOCH_S[1] * scale and (hi - lo) < 0.1 * med:
                return "epoch-sized (a Unix time)"
    return None


def load_trace(path: str | Path, columns: Optional[Sequence[str]] = None,
               interval_s: Optional[float] = None) -> Trace:
    """Read a rate trace.

    columns: the rate columns to keep (default: the first numeric column that is not a time; a
        first column that looks like one, see `time_like`, is refused with the candidates listed
        rather than read as a rate).
    interval_s: seconds per row (default: from the time column, else the file name suffix).
    Raises TraceError naming the file and the problem.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {str(p)!r} does not exist")
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt", newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
        raise TraceError(f"trace file {str(p)!r} cannot be read as CSV: {e}") from e
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if len(rows) < 3:
        raise TraceError(f"trace file {str(p)!r} needs a header and at least 2 data rows, has {len(rows)} rows")
    header = [h.strip() for h in rows[0]]
    body = rows[1:]
    for i, r in enumerate(body):
        if len(r) != len(header):
            raise TraceError(f"trace file {str(p)!r}: row {i + 2} has {len(r)} fields, header has {len(header)}")

    date_col = header.index("date") if "date" in header else None
    time_cols = [h for h in header if h in TIME_COLUMNS]
    numeric: dict[str, np.ndarray] = {}
    for j, h in enumerate(header):
        if j == date_col:
            continue
        try:
            numeric[h] = np.array([float(r[j]) for r in body], dtype=np.float64)
        except ValueError:
            if h in TIME_COLUMNS:
                raise TraceError(f"trace file {str(p)!r}: time column {h!r} is not numeric")
            continue  # non-numeric columns (ids, labels) are not rates
    rate_cols = [h for h in numeric if h not in TIME_COLUMNS]
    if not rate_cols:
        raise TraceError(f"trace file {str(p)!r} has no numeric rate column (header: {header})")
    if columns is None:
        why = time_like(rate_cols[0], numeric[rate_cols[0]])
        if why is not None:
            candidates = [h for h in rate_cols if time_like(h, numeric[h]) is None]
            raise TraceError(f"trace file {str(p)!r}: its first numeric column {rate_cols[0]!r} looks like a time, "
                             f"not a rate ({why}); name the rate column(s) with --columns "
                             f"(trace.columns): candidates {candidates or rate_cols}")
        columns = rate_cols[:1]
    missing = [c for c in columns if c not in rate_cols]
    if missing:
        raise TraceError(f"trace file {str(p)!r} has no numeric column {missing}; rate columns are {rate_cols}")
    counts = np.stack([numeric[c] for c in columns], axis=1)
    bad = ~np.isfinite(counts)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise TraceError(f"trace file {str(p)!r}: column {columns[c]!r} row {r + 2} is not a finite number")
    if (counts < 0).any():
        r, c = np.argwhere(counts < 0)[0]
        raise TraceError(f"trace file {str(p)!r}: column {columns[c]!r} row {r + 2} is negative ({counts[r, c]})")
    if counts.sum() <= 0:
        raise TraceError(f"trace file {str(p)!r}: columns {list(columns)} are all zero")

    # Time axis in seconds, if the file has one.
    t = None
    weekday0 = None  # weekday of the first row's date (Monday = 0), when the file has dates
    if time_cols:
        tc = time_cols[0]
        t = numeric[tc] * TIME_COLUMNS[tc]
        if date_col is not None:
            try:
                days = np.array([np.datetime64(r[date_col].strip(), "D") for r in body])
            except ValueError as e:
                raise TraceError(f"trace file {str(p)!r}: bad date in column 'date': {e}") from e
            t = t + (days - days[0]).astype(np.int64) * 86400.0
            weekday0 = int((days[0] - np.datetime64("1970-01-05", "D")).astype(np.int64) % 7)  # a Monday
    if interval_s is None:
        if t is not None:
            d = np.diff(t)
            if (d <= 0).any():
                raise TraceError(f"trace file {str(p)!r}: time column {time_cols[0]!r} is not increasing "
                                 f"(row {int(np.argmax(d <= 0)) + 3})")
            interval_s = float(np.median(d))
        else:
            interval_s = _interval_from_name(p)
            if interval_s is None:
                raise TraceError(f"trace file {str(p)!r} has no time column ({sorted(TIME_COLUMNS)}) and no "
                                 "interval suffix like _5min in its name: pass interval_s")
    if t is None:
        t = np.arange(len(body), dtype=np.float64) * interval_s
    # Gaps (missing days) are closed up: rows are treated as consecutive, time of day kept.
    # Without dates the weekday is unknown: the day of t = 0 counts as a Monday.
    tow = np.mod(t + (weekday0 or 0) * 86400.0, 7 * 86400.0)
    return Trace(path=str(p), columns=tuple(columns), counts=counts, interval_s=float(interval_s),
                 time_of_day_s=np.mod(t, 86400.0), time_of_week_s=tow)


def smooth_trace(trace: Trace, smooth_s: float) -> Trace:
    """The trace with each rate column replaced by its centred moving average over
    `smooth_s` seconds (rounded to an odd number of rows; edges padded with the first and
    last rows); unchanged when that is one row or fewer."""
    w = int(round(smooth_s / trace.interval_s))
    if w <= 1:
        return trace
    w += 1 - w % 2
    pad = np.pad(trace.counts, ((w // 2, w // 2), (0, 0)), mode="edge")
    cum = np.cumsum(np.vstack([np.zeros((1, pad.shape[1])), pad]), axis=0)
    return dataclasses.replace(trace, counts=(cum[w:] - cum[:-w]) / w)


@dataclass(frozen=True)
class TickRates:
    """Arrival rates resampled to the tick and normalised: what the simulator consumes."""

    rates: np.ndarray  # [T, K] float32, mean arrivals per second per class
    time_of_day: np.ndarray  # [T] float32 in [0, 1)
    train: tuple[int, int]  # [start, end) tick range for training
    eval: tuple[int, int]  # [start, end) tick range held out for evaluation
    source: str
    columns: tuple[str, ...]
    val: tuple[int, int] = (0, 0)  # [start, end) validation range (between the two); empty = none
    time_of_week: Optional[np.ndarray] = None  # [T] float32 in [0, 1), Monday 00:00 = 0
    tick_s: float = 1.0

    @functools.cached_property
    def peak(self) -> np.ndarray:
        """[K] highest rate of each class over the whole trace (computed once)."""
        return self.rates.max(axis=0).astype(np.float64)

    @property
    def ticks_per_day(self) -> int:
        return int(round(86400.0 / self.tick_s))

    def describe(self, split: str) -> str:
        """A split's range in words: ticks, days and where it starts (for tables and logs)."""
        lo, hi = self.split_range(split)
        days = (hi - lo) * self.tick_s / 86400.0
        start = (lo * self.tick_s) / 86400.0
        cols = ", ".join(self.columns)
        return (f"{split} ticks {lo:,}-{hi:,} ({days:.2f} days from day {start:.2f} of the trace; "
                f"rate column{'s' if len(self.columns) > 1 else ''} {cols})")

    def split_range(self, split: str) -> tuple[int, int]:
        """The [start, end) ticks of split "train", "val" or "eval"."""
        if split not in ("train", "val", "eval"):
            raise ValueError(f"split must be 'train', 'val' or 'eval', got {split!r}")
        r = getattr(self, split)
        if r[1] <= r[0]:
            raise ValueError(f"trace {self.source!r} has no {split!r} range"
                             + (" (set trace.validation_fraction > 0)" if split == "val" else ""))
        return r


def resample(trace: Trace, tick_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rates per second at each tick (linear interpolation between row centres), time of
    day and time of week at each tick, both as fractions in [0, 1)."""
    n_ticks = int(math.floor(len(trace.counts) * trace.interval_s / tick_s))
    if n_ticks < 2:
        raise TraceError(f"trace file {trace.path!r} is shorter than two ticks of {tick_s} s")
    centres = (np.arange(len(trace.counts)) + 0.5) * trace.interval_s
    t = (np.arange(n_ticks) + 0.5) * tick_s
    rates = np.stack([np.interp(t, centres, trace.rates_per_s[:, c]) for c in range(trace.counts.shape[1])], 1)
    row = np.minimum((t // trace.interval_s).astype(np.int64), len(trace.counts) - 1)
    into = t - row * trace.interval_s
    tod = np.mod(trace.time_of_day_s[row] + into, 86400.0) / 86400.0
    week = trace.time_of_week_s if trace.time_of_week_s is not None else trace.time_of_day_s
    tow = np.mod(week[row] + into, 7 * 86400.0) / (7 * 86400.0)
    return rates, tod, tow


def _day_aligned(i: int, tod: np.ndarray) -> int:
    """The day boundary (a tick where the time of day wraps) nearest to tick i."""
    starts = np.flatnonzero(np.diff(tod) < 0) + 1
    if len(starts) == 0:
        return i
    return int(starts[np.argmin(np.abs(starts - i))])


def make_tick_rates(trace: Trace, tick_s: float, num_classes: int, service_time_s: Sequence[float],
                    class_share: Sequence[float], mean_load_erlangs: float, eval_fraction: float,
                    validation_fraction: float = 0.0) -> TickRates:
    """Resample, map columns to classes, normalise each class to its share of the mean load.

    One column is split over the K classes by `class_share`; K columns map one-to-one. The
    normalisation uses the training range only, so the held-out range keeps its own level.
    On a trace of at least four days the split points move to the nearest midnight, so
    training, validation and held-out ranges are whole days (earlier days train, later days
    judge).
    """
    rates, tod, tow = resample(trace, tick_s)
    c = rates.shape[1]
    if c == 1:
        rates = np.repeat(rates, num_classes, axis=1)
    elif c != num_classes:
        raise TraceError(f"trace file {trace.path!r}: {c} rate columns {list(trace.columns)} cannot map onto "
                         f"{num_classes} classes (give 1 column, or exactly num_classes)")
    n = len(rates)
    multi_day = n * tick_s >= 4 * 86400.0
    split = int(round(n * (1.0 - eval_fraction)))
    if multi_day:
        split = _day_aligned(split, tod)
    if split < 1 or n - split < 1:
        raise TraceError(f"trace file {trace.path!r}: {n} ticks are too few to split at eval_fraction={eval_fraction}")
    def where(k: int, lo: int, hi: int) -> str:
        col = trace.columns[k if c > 1 else 0]
        r0, r1 = (int(lo * tick_s / trace.interval_s) + 2, int(hi * tick_s / trace.interval_s) + 1)
        return f"column {col!r} (class {k}) is all zero over rows {r0}-{r1}"

    mean_train = rates[:split].mean(axis=0)
    if (mean_train <= 0).any():
        k = int(np.argmax(mean_train <= 0))
        raise TraceError(f"trace file {trace.path!r}: {where(k, 0, split)}, the training range: nothing to "
                         "normalise the load on")
    mean_eval = rates[split:].mean(axis=0)
    if (mean_eval <= 0).any():
        k = int(np.argmax(mean_eval <= 0))
        raise TraceError(f"trace file {trace.path!r}: {where(k, split, n)}, the held-out range: nothing to "
                         "judge a policy on")
    target_rate = np.asarray(class_share) * mean_load_erlangs / np.asarray(service_time_s)  # [K] per second
    rates = rates * (target_rate / mean_train)
    val = int(round(split * (1.0 - validation_fraction)))
    if multi_day and validation_fraction > 0:
        val = _day_aligned(val, tod)
    if validation_fraction > 0 and not (1 <= val < split):
        raise TraceError(f"trace file {trace.path!r}: {split} ticks before the held-out range are too few to "
                         f"split at validation_fraction={validation_fraction}")
    return TickRates(rates=rates.astype(np.float32), time_of_day=tod.astype(np.float32),
                     train=(0, val), eval=(split, n), source=trace.path, columns=trace.columns, val=(val, split),
                     time_of_week=tow.astype(np.float32), tick_s=float(tick_s))
