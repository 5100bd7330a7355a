"""Serving latency and throughput: `python -m launch.bench serve [--json PATH]`.

Side by side in one run, on the default network (weights do not change the cost):
- the in-process forward pass (the floor), 1 and 256 shards;
- behind HAProxy: the default deployment (`@serve.batch`, queue skipped by a lone request),
  the deployment without batching, and two replicas; behind Serve's Python proxy: the default
  deployment. Each over HTTP (msgpack with packed arrays, as `apex_bdq.client` sends; JSON too
  at concurrency 1) and through a deployment handle, at concurrency 1, 16 and 64, with 1-shard
  and 256-shard requests.
Each ingress runs in its own subprocess with its own local Ray: HAProxy is chosen by an
environment variable read when Ray and Serve start. The load generator runs on the same
machine (2 cores here), so the concurrent figures include its cost.

Where a millisecond goes at concurrency 1, 1 shard: `model` (forward in the replica),
`replica` (the handler: parse + queue + model + encode, from the Server-Timing header),
`router` (handle latency minus the replica's time), `ingress` (HTTP latency minus the
replica's time: client, proxy / HAProxy, the replica's HTTP server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

SIZES = (1, 256)
DEFAULT_CHECKPOINT = "runs/train/checkpoint.pt"
CONCURRENCY = (1, 16, 64)


def _stats(lat_s: list[float], wall_s: float, shards: int) -> dict:
    ms = np.asarray(lat_s) * 1e3
    n = len(ms)
    return {"n": n, "p50_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)),
            "req_per_s": n / wall_s, "decisions_per_s": n * shards / wall_s}


def _obs(b: int, seed: int = 0):
    from apex_bdq.config import SimConfig
    from apex_bdq.networks import NetConfig
    cfg = NetConfig.for_sim(SimConfig())
    rng = np.random.default_rng(seed)
    return (rng.random((b, cfg.macro_features), dtype=np.float32),
            rng.random((b, cfg.num_classes, cfg.history, cfg.micro_features), dtype=np.float32))


def write_random_checkpoint(path: Path) -> None:
    import dataclasses

    import torch

    from apex_bdq.checkpoint import config_to_dict, save_checkpoint
    from apex_bdq.networks import BDQNetwork
    from apex_bdq.presets import PRESETS
    cfg = PRESETS["default"]  # the network `make run` trains and users serve
    net_cfg = cfg.net
    torch.manual_seed(0)
    save_checkpoint(path, config_to_dict(dataclasses.replace(cfg, net=net_cfg)),
                    {"net": BDQNetwork(net_cfg).state_dict(), "version": 1}, {"updates": 1})


def forward_floor(checkpoint: str, n: int) -> dict:
    import torch

    from apex_bdq.serving import policy_from_checkpoint
    torch.set_num_threads(1)
    p = policy_from_checkpoint(checkpoint)
    out = {}
    for b in SIZES:
        macro, micro = _obs(b)
        for _ in range(50):
            p.decide(macro, micro)
        lat = []
        t0 = time.perf_counter()
        for _ in range(n if b == 1 else n // 4):
            t = time.perf_counter()
            p.decide(macro, micro)
            lat.append(time.perf_counter() - t)
        out[f"shards_{b}"] = _stats(lat, time.perf_counter() - t0, b)
    return out


# -- load generators ---------------------------------------------------------------------------
def http_c1(url: str, macro, micro, n: int, use_msgpack: bool) -> tuple[dict, dict]:
    from apex_bdq.client import DecisionClient
    with DecisionClient(url, use_msgpack=use_msgpack) as c:
        for _ in range(30):
            c.decide(macro, micro)
        lat, timing = [], []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            d = c.decide(macro, micro)
            lat.append(time.perf_counter() - t)
            timing.append(d.server_timing)
        wall = time.perf_counter() - t0
    return _stats(lat, wall, macro.shape[0]), {k: float(np.median([t[k] for t in timing])) for k in timing[0]}


def http_concurrent(url: str, macro, micro, n: int, conc: int) -> dict:
    import aiohttp
    import msgpack

    from apex_bdq.serving import MSGPACK, pack_array
    body = msgpack.packb({"macro": pack_array(macro), "micro": pack_array(micro)}, use_bin_type=True)

    async def run() -> tuple[list, float]:
        lat: list[float] = []
        left = [0]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as s:
            async def one() -> float:
                t = time.perf_counter()
                async with s.post(url + "/v1/decide", data=body, headers={"Content-Type": MSGPACK}) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
                return time.perf_counter() - t

            async def worker() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    lat.append(await one())
            left[0] = 3 * conc  # warm every connection
            await asyncio.gather(*[worker() for _ in range(conc)])
            lat.clear()
            left[0] = n
            t0 = time.perf_counter()
            await asyncio.gather(*[worker() for _ in range(conc)])
            return lat, time.perf_counter() - t0
    lat, wall = asyncio.run(run())
    return _stats(lat, wall, macro.shape[0])


def handle_run(handle, macro, micro, n: int, conc: int) -> tuple[dict, Optional[dict]]:
    for _ in range(20):
        handle.decide.remote(macro, micro).result()
    if conc == 1:
        lat, rep = [], []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            r = handle.decide.remote(macro, micro).result()
            lat.append(time.perf_counter() - t)
            rep.append(r["timing_ms"]["replica"])
        return _stats(lat, time.perf_counter() - t0, macro.shape[0]), {"replica": float(np.median(rep))}
    lat: list[float] = []
    lock = threading.Lock()
    left = [n]

    def worker() -> None:
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            t = time.perf_counter()
            handle.decide.remote(macro, micro).result()
            with lock:
                lat.append(time.perf_counter() - t)
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return _stats(lat, time.perf_counter() - t0, macro.shape[0]), None


# -- one ingress, in its own process --------------------------------------------------------------
VARIANTS = {  # name -> ServeOptions overrides
    "batched": {},
    "unbatched": {"batching": False},
    "replicas2": {"replicas": 2},
    "userthread": {"user_code_thread": True},  # Serve's default: the handler on a second loop
}
INGRESS_VARIANTS = {"haproxy": ("batched", "unbatched", "replicas2", "userthread"), "proxy": ("batched",)}


def worker_main(ingress: str, checkpoint: str, n: int, out: str) -> None:
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1" if ingress == "haproxy" else "0"
    import ray
    from ray import serve

    from apex_bdq.client import DecisionClient
    from apex_bdq.serve_app import APP_NAME, ServeOptions, start
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = 8000 + (0 if ingress == "haproxy" else 100)
    url = f"http://127.0.0.1:{port}"
    res: dict = {}
    try:
        for variant in INGRESS_VARIANTS[ingress]:
            handle = start(ServeOptions(**{"checkpoint": checkpoint, "replica_cpus": 1.0, **VARIANTS[variant]}),
                           port=port)
            deadline = time.time() + 60
            while True:  # the ingress may need a moment after the app reports running
                try:
                    DecisionClient(url).healthz()
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.3)
            cells: dict = {}
            for b in SIZES:
                macro, micro = _obs(b, seed=b)
                m = n if b == 1 else max(100, n // 4)
                st, timing = http_c1(url, macro, micro, m, use_msgpack=True)
                cells[f"http_msgpack_s{b}_c1"] = {**st, "server_timing_ms": timing}
                st, timing = http_c1(url, macro, micro, m if b == 1 else max(50, m // 4), use_msgpack=False)
                cells[f"http_json_s{b}_c1"] = {**st, "server_timing_ms": timing}
                for c in CONCURRENCY[1:]:
                    cells[f"http_msgpack_s{b}_c{c}"] = http_concurrent(url, macro, micro, max(m, 20 * c), c)
                for c in CONCURRENCY:
                    st, rep = handle_run(handle, macro, micro, m if c == 1 else max(m, 20 * c), c)
                    cells[f"handle_s{b}_c{c}"] = {**st, **({"replica_ms": rep["replica"]} if rep else {})}
            print(f"[{ingress} {variant}] done", flush=True)
            res[variant] = cells
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    Path(out).write_text(json.dumps(res))


def _row(name: str, c: dict) -> str:
    return (f"| {name} | {c['p50_ms']:.2f} | {c['p99_ms']:.2f} | {c['req_per_s']:,.0f} | "
            f"{c['decisions_per_s']:,.0f} |")


def bench_serve(n: int = 1000, ingresses: tuple = ("haproxy", "proxy"), checkpoint: Optional[str] = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    if checkpoint is None and Path(DEFAULT_CHECKPOINT).is_file():
        checkpoint = DEFAULT_CHECKPOINT  # what `make run` trained
    if checkpoint is None:
        checkpoint = str(tmp / "policy.pt")
        write_random_checkpoint(Path(checkpoint))
    print(f"checkpoint: {checkpoint}", flush=True)
    res: dict = {"checkpoint": checkpoint, "forward": forward_floor(checkpoint, n), "ingress": {}}
    for ingress in ingresses:
        out = tmp / f"{ingress}.json"
        t = time.time()
        subprocess.run([sys.executable, "-m", "launch.bench_serve", "--worker", ingress, "--checkpoint", checkpoint,
                        "--requests", str(n), "--out", str(out)], check=True,
                       cwd=Path(__file__).resolve().parents[1])
        res["ingress"][ingress] = json.loads(out.read_text())
        print(f"{ingress}: {time.time() - t:.0f} s", flush=True)
    # the table
    print("\n| path | p50 ms | p99 ms | req/s | decisions/s |\n|---|---|---|---|---|")
    for b in SIZES:
        print(_row(f"in-process forward, {b} shard(s)", res["forward"][f"shards_{b}"]))
    for ingress, by in res["ingress"].items():
        for mode, cells in by.items():
            for key, c in cells.items():
                print(_row(f"{ingress} {mode} {key}", c))
    main_cells = res["ingress"][ingresses[0]]["batched"]
    c1 = main_cells["http_msgpack_s1_c1"]
    st = c1["server_timing_ms"]
    handle_c1 = main_cells["handle_s1_c1"]
    breakdown = {"model_ms": st["model"], "replica_ms": st["replica"],
                 "router_ms": handle_c1["p50_ms"] - handle_c1.get("replica_ms", 0.0),
                 "ingress_ms": c1["p50_ms"] - st["replica"], "http_p50_ms": c1["p50_ms"]}
    best = max(((v, k, cells[k]["decisions_per_s"]) for v, cells in res["ingress"][ingresses[0]].items()
                for k in cells if k.startswith("http_msgpack_s256")), key=lambda x: x[2])
    res.update({
        "http_p99_ms_c1": c1["p99_ms"],
        "handle_p99_ms_c1": handle_c1["p99_ms"],
        "decisions_per_s_batched": best[2],
        "decisions_per_s_batched_where": f"{ingresses[0]} {best[0]} {best[1]}",
        "forward_only_p99_ms": res["forward"]["shards_1"]["p99_ms"],
        "breakdown_c1_ms": breakdown,
        "main_variant": f"{ingresses[0]}, @serve.batch, msgpack client",
    })
    print(f"\nwhere a 1-shard decision's {c1['p50_ms']:.2f} ms (p50, {ingresses[0]}, batched) goes: "
          + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in breakdown.items() if k != "http_p50_ms")
          + f" ms (server stages: {', '.join(f'{k} {v:.2f}' for k, v in st.items())})")
    by = res["ingress"][ingresses[0]]
    s256 = [k for k in main_cells if k.startswith("http_msgpack_s256")]
    ratios = {}
    if len(ingresses) > 1:
        other = res["ingress"][ingresses[1]]["batched"]
        ratios[f"{ingresses[1]}_over_{ingresses[0]}_http_p50_s1_c1"] = other["http_msgpack_s1_c1"]["p50_ms"] / c1["p50_ms"]
        ratios[f"{ingresses[0]}_over_{ingresses[1]}_decisions_per_s_s256"] = (
            max(main_cells[k]["decisions_per_s"] for k in s256) / max(other[k]["decisions_per_s"] for k in s256))
    if "unbatched" in by:
        unb = by["unbatched"]
        ratios["batched_over_unbatched_decisions_per_s_s1_c64"] = (
            main_cells["http_msgpack_s1_c64"]["decisions_per_s"] / unb["http_msgpack_s1_c64"]["decisions_per_s"])
        ratios["batched_over_unbatched_decisions_per_s_s256_c16"] = (
            main_cells["http_msgpack_s256_c16"]["decisions_per_s"] / unb["http_msgpack_s256_c16"]["decisions_per_s"])
    if "replicas2" in by:
        ratios["replicas2_over_1_decisions_per_s_s256"] = (
            max(by["replicas2"][k]["decisions_per_s"] for k in s256) / max(main_cells[k]["decisions_per_s"] for k in s256))
    if "userthread" in by:  # what running the handler on the replica's main loop bought
        ut = by["userthread"]
        ratios["user_thread_over_main_loop_http_p50_s1_c1"] = ut["http_msgpack_s1_c1"]["p50_ms"] / c1["p50_ms"]
        ratios["user_thread_over_main_loop_http_p99_s1_c1"] = ut["http_msgpack_s1_c1"]["p99_ms"] / c1["p99_ms"]
        ratios["main_loop_over_user_thread_decisions_per_s_s256"] = (
            max(main_cells[k]["decisions_per_s"] for k in s256) / max(ut[k]["decisions_per_s"] for k in s256))
    ratios["json_over_msgpack_p50_s256_c1"] = main_cells["http_json_s256_c1"]["p50_ms"] / main_cells["http_msgpack_s256_c1"]["p50_ms"]
    res["ratios"] = ratios
    print("headline: " + ", ".join(f"{k} {res[k]:,.2f}" for k in
                                   ("http_p99_ms_c1", "handle_p99_ms_c1", "decisions_per_s_batched",
                                    "forward_only_p99_ms")))
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in res["ratios"].items()))
    return res


def hostile_bodies() -> list[tuple[str, bytes, str]]:
    """(name, body, content type) of requests a service must refuse without harm: decoders'
    amplifiers, a body near the size limit that fails validation only after it is read, junk."""
    import msgpack
    return [("msgpack_empty_arrays_4MB", msgpack.packb([[[] for _ in range(65536)] for _ in range(64)]),
             "application/msgpack"),
            ("json_empty_arrays_12MB", b"[" + b"[]," * (4 << 20) + b"[]]", "application/json"),
            ("packed_60MiB_wrong_shape", msgpack.packb({"macro": {"dtype": "<f4", "shape": [7],
                                                                  "data": b"\0" * (60 << 20)}, "micro": [0]},
                                                       use_bin_type=True), "application/msgpack"),
            ("malformed_json", b'{"macro": [1, 2', "application/json"),
            ("deep_json", b'{"macro": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json")]


def abuse_load(url: str, seconds: float, valid_clients: int = 2, hostile_clients: int = 4) -> dict:
    """Valid 1-shard decisions from `valid_clients` threads, first alone, then beside
    `hostile_clients` threads sending hostile_bodies() round-robin: the valid requests'
    latency in both phases and every status seen. Nothing is asserted here."""
    from apex_bdq.client import DecisionClient
    macro, micro = _obs(1, seed=3)
    bodies = hostile_bodies()

    def phase(hostile: int) -> dict:
        stop = threading.Event()
        lat: list[float] = []
        valid_status: dict = {}
        hostile_status: dict = {}
        lock = threading.Lock()

        def valid():
            with DecisionClient(url, use_msgpack=True) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    try:
                        c.decide(macro, micro)
                        code = 200
                    except Exception as e:  # noqa: BLE001 - counted, never raised
                        code = getattr(e, "status", None) or type(e).__name__
                    with lock:
                        lat.append(time.perf_counter() - t)
                        valid_status[code] = valid_status.get(code, 0) + 1

        def bad(k: int):
            i = k
            while not stop.is_set():
                name, body, ct = bodies[i % len(bodies)]
                i += 1
                try:
                    with DecisionClient(url) as c:
                        code, _, _ = c.request("POST", "/v1/decide", body, ct, retry=False)
                except Exception as e:  # noqa: BLE001 - a closed connection after a refusal
                    code = f"closed:{type(e).__name__}"
                with lock:
                    hostile_status[f"{name} -> {code}"] = hostile_status.get(f"{name} -> {code}", 0) + 1

        threads = [threading.Thread(target=valid) for _ in range(valid_clients)]
        threads += [threading.Thread(target=bad, args=(k,)) for k in range(hostile)]
        t0 = time.time()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        out = {"valid": _stats(lat, time.time() - t0, 1) if lat else {"n": 0}, "valid_status": valid_status,
               "hostile_status": hostile_status}
        return out

    alone = phase(0)
    beside = phase(hostile_clients)
    res = {"alone": alone, "under_abuse": beside, "seconds_per_phase": seconds, "valid_clients": valid_clients,
           "hostile_clients": hostile_clients}
    if alone["valid"].get("n") and beside["valid"].get("n"):
        res["p99_ratio_under_abuse"] = beside["valid"]["p99_ms"] / alone["valid"]["p99_ms"]
        res["p50_ratio_under_abuse"] = beside["valid"]["p50_ms"] / alone["valid"]["p50_ms"]
    return res


def bench_serve_abuse(seconds: float = 20.0, checkpoint: Optional[str] = None) -> dict:
    """`python -m launch.bench serve-abuse`: a `launch.serve` (HAProxy, its defaults) in a
    subprocess, then abuse_load against it; prints the valid requests' latency alone and
    under abuse and every status seen."""
    import socket
    tmp = Path(tempfile.mkdtemp(prefix="bench_abuse_"))
    if checkpoint is None:
        checkpoint = DEFAULT_CHECKPOINT if Path(DEFAULT_CHECKPOINT).is_file() else str(tmp / "policy.pt")
        if not Path(checkpoint).is_file():
            write_random_checkpoint(Path(checkpoint))

    def free_port() -> int:
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            return so.getsockname()[1]

    port = free_port()
    env = dict(os.environ, RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()))
    log = open(tmp / "serve.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--checkpoint", checkpoint, "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    try:
        from apex_bdq.client import DecisionClient
        deadline = time.time() + 180
        while True:
            try:
                DecisionClient(url).healthz()
                break
            except Exception:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"launch.serve did not come up: {(tmp / 'serve.out').read_text()[-2000:]}")
                time.sleep(0.5)
        res = abuse_load(url, seconds)
    finally:
        import signal
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    res["checkpoint"] = checkpoint
    print("\n| valid 1-shard decisions (msgpack, 2 clients) | n | p50 ms | p99 ms |\n|---|---|---|---|")
    for k in ("alone", "under_abuse"):
        v = res[k]["valid"]
        print(f"| {k.replace('_', ' ')} | {v.get('n', 0):,} | {v.get('p50_ms', float('nan')):.2f} | "
              f"{v.get('p99_ms', float('nan')):.2f} |")
    print(f"valid statuses: alone {res['alone']['valid_status']}, under abuse {res['under_abuse']['valid_status']}")
    print(f"hostile statuses: {res['under_abuse']['hostile_status']}")
    if "p99_ratio_under_abuse" in res:
        print(f"p99 under abuse / alone: {res['p99_ratio_under_abuse']:.2f}; p50: {res['p50_ratio_under_abuse']:.2f}")
    return res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=("haproxy", "proxy"))
    ap.add_argument("--checkpoint")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--out")
    ap.add_argument("--ingress", default="haproxy,proxy")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a.worker, a.checkpoint, a.requests, a.out)
        return 0
    res = bench_serve(a.requests, ingresses=tuple(a.ingress.split(",")), checkpoint=a.checkpoint)
    if a.json:
        from launch._io import write_json
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
