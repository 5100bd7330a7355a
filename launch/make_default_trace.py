"""Regenerate the bundled default traces from ../shared/traces (kept for provenance).

Platform v2's default, `nasa_http_1995_aug_1min.csv.gz`: HTTP requests per minute at the
NASA Kennedy Space Center web server from Friday 4 August to Thursday 31 August 1995, four
whole weeks (the 1-3 August outage, whose last zeros run to 11:28 on the 3rd, is left out).

Platform v1's default, `azure_functions2019_4class_1min.csv`: the 50 highest-volume Azure
Functions 2019 functions grouped into four request classes by their mean duration; each
class's rate is the sum of its functions' invocations per minute, and its service time is
the invocation-weighted mean duration.

    python -m launch.make_default_trace [--src ../shared/traces] [--out apex_bdq/data]
"""

from __future__ import annotations

import argparse
import csv
import gzip
from pathlib import Path

NASA_DAYS = ("1995-08-04", "1995-08-31")  # first and last day kept, inclusive


def write_nasa(src: Path, out: Path) -> None:
    with open(src / "nasa_http_1995_1min.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if NASA_DAYS[0] <= r["date"] <= NASA_DAYS[1]]
    # mtime=0: the same input gives the same bytes, so the file only changes when the data does.
    with open(out / "nasa_http_1995_aug_1min.csv.gz", "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        text = "date,minute_of_day,requests\n" + "".join(
            f"{r['date']},{r['minute_of_day']},{r['requests']}\n" for r in rows)
        gz.write(text.encode())
    days = len({r["date"] for r in rows})
    print(f"nasa_http_1995_aug_1min.csv.gz: {len(rows)} minutes, {days} days, "
          f"{sum(int(r['requests']) for r in rows)} requests")

import numpy as np

# Upper bounds of mean duration per class, in ms: interactive, API, worker, batch.
CLASS_BOUNDS_MS = (200.0, 5_000.0, 60_000.0, float("inf"))
CLASS_NAMES = ("c0_lt200ms", "c1_200ms_5s", "c2_5s_60s", "c3_ge60s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "traces"))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "apex_bdq" / "data"))
    a = ap.parse_args(argv)
    src, out = Path(a.src), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_nasa(src, out)
    meta = list(csv.DictReader(open(src / "azure_functions2019_invitro1000_top50_meta.csv")))
    dur = {m["class"]: float(m["avg_duration_ms"]) for m in meta}
    with open(src / "azure_functions2019_invitro1000_top50_1min.csv") as f:
        rows = list(csv.reader(f))
    header, data = rows[0], np.array(rows[1:], dtype=np.float64)
    minute = data[:, 0]
    cls_of = {}
    for name, d in dur.items():
        cls_of[name] = next(i for i, b in enumerate(CLASS_BOUNDS_MS) if d < b)
    rates = np.zeros((len(data), len(CLASS_NAMES)))
    work = np.zeros(len(CLASS_NAMES))
    count = np.zeros(len(CLASS_NAMES))
    members: list[list[str]] = [[] for _ in CLASS_NAMES]
    for j, name in enumerate(header[1:], start=1):
        k = cls_of[name]
        rates[:, k] += data[:, j]
        work[k] += data[:, j].sum() * dur[name]
        count[k] += data[:, j].sum()
        members[k].append(name)
    svc_ms = work / count
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "azure_functions2019_4class_1min.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["minute", *CLASS_NAMES])
        for m, r in zip(minute, rates):
            w.writerow([int(m), *(int(x) for x in r)])
    with open(out / "azure_functions2019_4class_meta.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "functions", "mean_service_ms", "invocations_day"])
        for k, name in enumerate(CLASS_NAMES):
            w.writerow([name, " ".join(members[k]), round(svc_ms[k], 1), int(count[k])])
    for k, name in enumerate(CLASS_NAMES):
        print(f"{name}: {len(members[k])} functions, mean service {svc_ms[k]:.1f} ms, {int(count[k])} inv/day")


if __name__ == "__main__":
    main()
