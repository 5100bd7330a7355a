"""Ray Serve for real: `python -m launch.serve` in a subprocess (its own local Ray, HAProxy
ingress, as a user starts it) answering over HTTP, and, in-process, a deployment that follows
a weight store through a deployment handle."""

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from _util import wait_for

from apex_bdq.checkpoint import config_to_dict, save_checkpoint
from apex_bdq.client import DecisionClient, ServiceError
from apex_bdq.config import SimConfig, TrainConfig
from apex_bdq.networks import BDQNetwork, NetConfig
from apex_bdq.preference import PREFERENCE_METRICS, load_log

ROOT = Path(__file__).resolve().parents[1]
CFG = TrainConfig()
NET = NetConfig.for_sim(CFG.sim)
TOKEN = "test-token-0123456789abcdef"


def write_checkpoint(path: Path, version: int, seed: int) -> BDQNetwork:
    torch.manual_seed(seed)
    net = BDQNetwork(NET)
    cfg = config_to_dict(dataclasses.replace(CFG, net=NET))
    save_checkpoint(path, cfg, {"net": net.state_dict(), "version": version}, {"updates": version})
    return net.eval()


def obs(b: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.random((b, NET.macro_features), dtype=np.float32),
            rng.random((b, NET.num_classes, NET.history, NET.micro_features), dtype=np.float32))


def q_of(net: BDQNetwork, macro, micro) -> np.ndarray:
    with torch.no_grad():
        return net(torch.from_numpy(macro), torch.from_numpy(micro)).numpy()


def guarded(macro, q) -> np.ndarray:
    """The actions the server answers: the greedy ones under the checkpoint's guard."""
    from apex_bdq.guard import guard_for
    return guard_for(dataclasses.replace(CFG, net=NET)).apply(macro, q.argmax(-1))[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(d: Path, *args: str):
    """`python -m launch.serve` in a subprocess, as a user starts it (HAProxy ingress, its own
    local Ray), until it answers /healthz."""
    ck, log = d / "policy.pt", d / "feedback.log"
    nets = {7: write_checkpoint(ck, 7, seed=1)}
    port, stats_port, metrics_port = free_port(), free_port(), free_port()
    env = dict(os.environ, APEX_BDQ_FEEDBACK_TOKEN=TOKEN, PYTHONUNBUFFERED="1",
               # HAProxy's stats and metrics listeners (8404, 9101 by default) must not collide with a
               # Serve already running on this machine
               RAY_SERVE_HAPROXY_STATS_PORT=str(stats_port), RAY_SERVE_HAPROXY_METRICS_PORT=str(metrics_port))
    env.pop("RAY_AUTH_MODE", None)  # launch.serve's default: Ray token authentication on
    out = open(d / "serve.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve", "--checkpoint", str(ck), "--port", str(port),
                             "--replica-cpus", "0.5", "--reload-s", "0.5", "--feedback-log", str(log), *args],
                            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    client = DecisionClient(url)
    try:
        def up():
            if proc.poll() is not None:
                raise RuntimeError("launch.serve exited:\n" + (d / "serve.out").read_text()[-3000:])
            return client.healthz()["status"] == "ok"

        wait_for(up, 180, "launch.serve to answer /healthz", interval=0.5,
                 ignore=(OSError, ServiceError, http.client.HTTPException),
                 detail=lambda: (d / "serve.out").read_text()[-3000:])
        yield {"url": url, "ck": ck, "log": log, "nets": nets, "proc": proc, "dir": d, "port": port,
               "stats_port": stats_port, "metrics_port": metrics_port}
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)  # the CLI shuts Serve down and its Ray with it
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve")) as s:
        yield s


def post(url: str, body: bytes, content_type: str = "application/json", headers=None):
    c = DecisionClient(url)
    try:
        status, h, raw = c.request("POST", "/v1/decide", body, content_type, headers)
    finally:
        c.close()
    return status, (json.loads(raw) if raw and h.get("content-type", "").startswith("application/json") else raw)


@pytest.mark.ray
def test_decide_over_json_and_msgpack_matches_the_checkpoint(server):
    net = server["nets"][7]
    macro, micro = obs(5, seed=3)
    want_q = q_of(net, macro, micro)
    with DecisionClient(server["url"], use_msgpack=True) as c:
        d = c.decide(macro, micro)
        assert d.version == 7 and d.actions.shape == (5, NET.num_branches) and d.q.shape == want_q.shape
        np.testing.assert_allclose(d.q, want_q, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(d.actions, guarded(macro, want_q))
        assert {"parse", "queue", "model", "replica"} <= set(d.server_timing)
        assert d.branches == list(SimConfig().branch_names)  # v2: capacity_k, hold_k per class, admission
    with DecisionClient(server["url"], use_msgpack=False) as c:  # one shard, JSON, no batch axis
        d1 = c.decide(macro[0], micro[0])
        np.testing.assert_allclose(d1.q[0], want_q[0], rtol=1e-5, atol=1e-5)
        assert c.decide(macro, micro, include_q=False).q is None
        assert c.healthz() == {"status": "ok", "version": 7}  # nothing else without a token
    with DecisionClient(server["url"], token=TOKEN) as c:
        h = c.status()
        assert h["version"] == 7 and h["batching"]["enabled"] and h["net"]["macro_features"] == NET.macro_features
        g = h["guard"]  # the replica's own count of what its guard did
        assert g["decisions"] >= 11 and 0 <= g["clipped"] + g["fallback"] <= g["decisions"]
        assert h["user_code_thread"] is False  # the deployment's runtime env reached the replica
        status, hdr, raw = c.request("GET", "/openapi.json")
        spec = json.loads(raw)
        assert status == 200 and {"/v1/decide", "/v1/feedback", "/healthz"} <= set(spec["paths"])
        assert "application/msgpack" in spec["paths"]["/v1/decide"]["post"]["requestBody"]["content"]


@pytest.mark.ray
def test_bad_requests_get_a_4xx_naming_the_problem(server):
    url = server["url"]
    macro, micro = obs(2)
    good = {"macro": macro.tolist(), "micro": micro.tolist()}
    nan_macro = macro.copy()
    nan_macro[1, 3] = np.nan
    packed = {"dtype": "<f4", "shape": [2, NET.macro_features], "data": macro.tobytes()[:-4]}
    cases = [
        (b'{"macro": [1, 2', "application/json", 400, "not valid JSON"),
        (json.dumps(good).replace("]]]]", "]]]], \"micro2\": NaN").encode(), "application/json", 400, "not valid JSON"),
        (json.dumps({**good, "macro": [["1.5"] * NET.macro_features] * 2}).encode(), "application/json", 422, "floats only"),
        (json.dumps({**good, "macro": [[None] * NET.macro_features] * 2}).encode(), "application/json", 422, "floats only"),
        (msgpack.packb({"macro": {**packed, "shape": [1] * 70}, "micro": good["micro"]}, use_bin_type=True),
         "application/msgpack", 422, "at most 8 sizes"),
        (msgpack.packb({"macro": {**packed, "shape": [float("inf")]}, "micro": good["micro"]}, use_bin_type=True),
         "application/msgpack", 422, "packed shape"),
        (b"\xc1\xc1", "application/msgpack", 400, "msgpack"),
        (b"{}", "text/plain", 415, "not supported"),
        (json.dumps({**good, "priority": 1}).encode(), "application/json", 422, "unknown field(s) ['priority']"),
        (json.dumps({"micro": good["micro"]}).encode(), "application/json", 422, "'macro' is missing"),
        (json.dumps({**good, "macro": macro[:, :10].tolist()}).encode(), "application/json", 422, f"macro must be [B, {NET.macro_features}]"),
        (json.dumps({**good, "micro": micro[:, :3].tolist()}).encode(), "application/json", 422, "micro must be"),
        (json.dumps({**good, "macro": [[1.0] * NET.macro_features, [1.0] * 3]}).encode(), "application/json", 422, "rectangular"),
        (json.dumps({**good, "macro": macro[:1].tolist()}).encode(), "application/json", 422, "macro has 1 shards"),
        (json.dumps({**good, "include_q": "yes"}).encode(), "application/json", 422, "include_q"),
        (msgpack.packb({"macro": nan_macro.tolist(), "micro": micro.tolist()}), "application/msgpack", 422,
         "macro holds NaN or inf (first at index [1, 3])"),
        (msgpack.packb({"macro": packed, "micro": good["micro"]}, use_bin_type=True), "application/msgpack", 422,
         f"packed data has {2 * NET.macro_features * 4 - 4} bytes"),
        (b"[1, 2]", "application/json", 422, "must be an object"),
    ]
    for body, ct, status, needle in cases:
        got, doc = post(url, body, ct)
        assert got == status, (needle, got, doc)
        assert needle in doc["error"], (needle, doc)
    status, doc = post(url, json.dumps(good).encode())  # the service is still fine
    assert status == 200 and len(doc["actions"]) == 2


def _segment(sid: str, seed: int, T: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return {"id": sid, "macro": rng.random((T, NET.macro_features)).tolist(),
            "micro": rng.random((T, NET.num_classes, NET.history, NET.micro_features)).tolist(),
            "action": rng.integers(0, NET.sub_actions, (T, NET.num_branches)).tolist(),
            "metrics": {m: float(rng.random()) for m in PREFERENCE_METRICS}}


@pytest.mark.ray
def test_feedback_needs_the_token_and_lands_durably(server):
    url = server["url"]
    with DecisionClient(url) as c:
        st, _, raw = c.request("POST", "/v1/feedback", b'{"pairs": [{"a": "x", "b": "y"}]}')
        assert st == 401 and "Bearer" in json.loads(raw)["error"]
        st, _, raw = c.request("POST", "/v1/feedback", b'{"pairs": [{"a": "x", "b": "y"}]}',
                               headers={"Authorization": "Bearer wrong"})
        assert st == 403 and "wrong feedback token" in json.loads(raw)["error"]
        st, hdr, raw = c.request("GET", "/v1/status")
        assert st == 401 and hdr.get("www-authenticate", "").startswith("Bearer")
    segs = [_segment("seg-a", 1), _segment("seg-b", 2), _segment("seg-c", 3)]
    with DecisionClient(url, token=TOKEN) as c:
        r = c.feedback([("seg-a", "seg-b", 1.0), {"a": "seg-c", "b": "seg-b", "label": "tie"}], segments=segs)
        assert r["results"] == ["accepted", "accepted"]
        assert c.feedback([("seg-b", "seg-a", 0.0)])["results"] == ["duplicate"]
        with pytest.raises(ServiceError) as e:  # the whole request is refused: seg-a / seg-c stays unranked
            c.feedback([("seg-a", "seg-c", 1.0), ("seg-a", "nope", 1.0)])
        assert e.value.status == 404 and "pairs[1]" in e.value.message and "'nope'" in e.value.message
        with pytest.raises(ServiceError) as e:
            c.feedback([("seg-a", "seg-c", 2.0)])
        assert e.value.status == 422 and "label" in e.value.message
        bad = _segment("seg-d", 4)
        bad["micro"] = bad["micro"][:, :1] if isinstance(bad["micro"], np.ndarray) else [m[:1] for m in bad["micro"]]
        with pytest.raises(ServiceError) as e:
            c.feedback([("seg-a", "seg-d", 1.0)], segments=[bad])
        assert e.value.status == 422 and "segments[0]" in e.value.message and "micro" in e.value.message
    _, segments, pairs = load_log(str(server["log"]))  # fsynced before the answer
    assert [(p.a, p.b, p.label, p.source) for p in pairs] == [("seg-a", "seg-b", 1.0, "http"),
                                                               ("seg-c", "seg-b", 0.5, "http")]
    assert set(segments) == {"seg-a", "seg-b", "seg-c"}
    np.testing.assert_allclose(segments["seg-a"].macro, np.asarray(segs[0]["macro"], dtype=np.float32))


@pytest.mark.ray
def test_a_new_checkpoint_is_swapped_in_without_dropping_requests(server):
    url, ck = server["url"], server["ck"]
    macro, micro = obs(3, seed=9)
    with DecisionClient(url) as c:
        v0 = c.healthz()["version"]
    per_thread, errors, stop = [[], [], []], [], threading.Event()
    seen = []

    def hammer(mine: list):
        with DecisionClient(url) as cc:
            while not stop.is_set():
                try:
                    d = cc.decide(macro, micro)
                    mine.append((d.version, d.actions.copy()))
                    seen.append(mine[-1])
                except Exception as e:  # noqa: BLE001 - any failure is a dropped request
                    errors.append(repr(e))

    threads = [threading.Thread(target=hammer, args=(mine,)) for mine in per_thread]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: errors or all(per_thread), 30, "every client's first answer")
        new = write_checkpoint(ck, v0 + 1, seed=2)  # atomic replace; the server polls every 0.5 s
        server["nets"][v0 + 1] = new
        wait_for(lambda: errors or all(mine[-1][0] == v0 + 1 for mine in per_thread), 30,
                 f"every client to get version {v0 + 1}")
    finally:
        stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    for mine in per_thread:  # each client sees the old version, then the new one, and never back
        versions = [v for v, _ in mine]
        assert versions[0] == v0 and versions[-1] == v0 + 1, (versions[:3], versions[-3:])
        assert versions == sorted(versions)
    want = guarded(macro, q_of(new, macro, micro))
    assert all(np.array_equal(a, want) for v, a in seen if v == v0 + 1)
    with DecisionClient(url, token=TOKEN) as c:
        h = c.status()
    assert h["swaps"] >= 1 and h["last_reload_error"] is None


def test_cli_refuses_a_missing_checkpoint_before_starting_ray(tmp_path, capsys):
    from launch.serve import main
    assert main(["--checkpoint", str(tmp_path / "nope.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert main(["--checkpoint", str(tmp_path / "junk.pt")]) == 2
    assert "corrupt or not a checkpoint" in capsys.readouterr().err


@pytest.mark.ray
def test_handle_path_follows_a_weight_store(own_ray_cluster, tmp_path):
    """In-process: a named weight store (as a distributed run registers it), a deployment
    with --follow, decisions through a deployment handle; a newer version is picked up."""
    import ray
    from ray import serve
    from actors.preference_actor import NAMESPACE
    from apex_bdq.serve_app import ServeOptions, start
    from apex_bdq.messages import StoreMeta
    from learner.weight_store import WEIGHT_STORE_NAME, remote_store_class, state_to_numpy
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        store = remote_store_class().options(name=WEIGHT_STORE_NAME, namespace=NAMESPACE).remote(
            StoreMeta(net=NET, branches=tuple(CFG.sim.branch_names)))
        torch.manual_seed(5)
        net3, net5 = BDQNetwork(NET).eval(), BDQNetwork(NET).eval()
        ray.get(store.put.remote(3, state_to_numpy(net3)))
        port = free_port()
        handle = start(ServeOptions(follow=True, replica_cpus=0.5, reload_s=0.3, feedback_token=TOKEN), port=port)
        macro, micro = obs(4, seed=11)
        r = handle.decide.remote(macro, micro).result()
        assert r["version"] == 3
        with DecisionClient(f"http://127.0.0.1:{port}", token=TOKEN) as c:  # Serve's own proxy here
            wait_for(c.healthz, 30, "Serve's proxy to answer /healthz", interval=0.3,
                     ignore=(OSError, ServiceError, http.client.HTTPException))
            assert c.status()["source"] == "weight-store"
            with pytest.raises(ServiceError) as e:  # no training run with preferences on this cluster
                c.feedback([("a", "b", 1.0)])
            assert e.value.status == 503 and "no preference actor" in e.value.message
        np.testing.assert_allclose(r["q"], q_of(net3, macro, micro), rtol=1e-5, atol=1e-5)
        with pytest.raises(Exception, match="micro must be"):
            handle.decide.remote(macro, micro[:, :2]).result()
        ray.get(store.put.remote(5, state_to_numpy(net5)))

        def decided(version: int):
            r = handle.decide.remote(macro, micro).result()
            return r if r["version"] == version else None

        r = wait_for(lambda: decided(5), 30, "the deployment to decide with version 5")
        np.testing.assert_array_equal(r["actions"], q_of(net5, macro, micro).argmax(-1))
        # the run ends (its store is killed) and a new run registers a store starting at v1
        ray.kill(store, no_restart=True)
        wait_for(lambda: not _named_actor_exists(WEIGHT_STORE_NAME, NAMESPACE), 30,
                 "the killed store's name to be free")
        store2 = remote_store_class().options(name=WEIGHT_STORE_NAME, namespace=NAMESPACE).remote(
            StoreMeta(net=NET))
        ray.get(store2.put.remote(1, state_to_numpy(net3)))
        r = wait_for(lambda: decided(1), 30, "the deployment to follow the new store to version 1", interval=0.3)
        np.testing.assert_allclose(r["q"], q_of(net3, macro, micro), rtol=1e-5, atol=1e-5)
        # redeployed without a feedback token: every feedback call is refused, whatever it sends
        start(ServeOptions(follow=True, replica_cpus=0.5, reload_s=0.3), port=port)
        with DecisionClient(f"http://127.0.0.1:{port}", token="t") as c:
            def refused():
                with pytest.raises(ServiceError) as e:
                    c.feedback([("a", "b", 1.0)])
                return None if e.value.status == 503 else e.value  # 503: the old replica still answers

            err = wait_for(refused, 30, "the redeployed replica (no feedback token) to answer /v1/feedback",
                           interval=0.3, ignore=(OSError, http.client.HTTPException))
            assert err.status == 403 and "route is disabled" in err.message
        serve.shutdown()
    finally:
        ray.shutdown()


def _named_actor_exists(name: str, namespace: str) -> bool:
    import ray
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


@pytest.mark.ray
def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server):
    """8 clients at once: some requests share a forward pass (X-Batch-Requests > 1), and every
    answer is the checkpoint's Q for that request's own observations."""
    url = server["url"]
    results, errors = [], []

    def client(i: int):
        macro, micro = obs(1 + i % 3, seed=100 + i)
        c = DecisionClient(url)
        try:
            for _ in range(15):
                body = msgpack.packb({"macro": macro.tolist(), "micro": micro.tolist()})
                st, h, raw = c.request("POST", "/v1/decide", body, "application/msgpack")
                doc = msgpack.unpackb(raw)
                q = np.frombuffer(doc["q"]["data"], dtype=doc["q"]["dtype"]).reshape(doc["q"]["shape"])
                results.append((int(h["x-batch-requests"]), doc["version"], q, macro, micro))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert max(r[0] for r in results) > 1
    for batch, version, q, macro, micro in results:
        np.testing.assert_allclose(q, q_of(server["nets"][version], macro, micro), rtol=1e-5, atol=1e-5)


@pytest.mark.ray
def test_fuzzed_bodies_over_http_never_get_a_5xx_or_take_the_service_down(server):
    """Random documents, adversarial packed-array metadata and bytes against the live endpoints
    (both content types, with and without the token): every answer is below 500, the service
    still decides after, and the replica's memory stays bounded. Examples:
    APEX_BDQ_FUZZ_HTTP_EXAMPLES (default 60; 300 in the recorded run, docs/hardening.md)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_serving_fuzz import adversarial_packed
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1), st.floats(width=32),
                     st.text(max_size=4), adversarial_packed)
    docs = st.recursive(leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(["macro", "micro", "include_q", "pairs", "segments", "a", "b", "label", "x", "id",
                         "action", "metrics"]), inner, max_size=4), max_leaves=30)
    c = DecisionClient(server["url"])
    before = _replica_rss_mb(server["url"])

    @settings(max_examples=int(os.environ.get("APEX_BDQ_FUZZ_HTTP_EXAMPLES", "60")), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(doc=docs, raw=st.binary(max_size=64), path=st.sampled_from(["/v1/decide", "/v1/feedback"]),
           kind=st.sampled_from(["json", "msgpack", "raw"]), auth=st.booleans())
    def probe(doc, raw, path, kind, auth):
        if kind == "raw":
            body, ct = raw, "application/msgpack"
        elif kind == "msgpack":
            try:
                body = msgpack.packb(doc, use_bin_type=True)
            except (OverflowError, ValueError, TypeError):  # beyond 64-bit integers: no client can send it
                body = raw
            ct = "application/msgpack"
        else:
            body, ct = json.dumps(doc, allow_nan=False).encode() if _json_ok(doc) else b"{", "application/json"
        headers = {"Authorization": f"Bearer {TOKEN}"} if auth else None
        status, _, raw_out = c.request("POST", path, body, ct, headers)
        assert status < 500, (path, kind, doc, raw_out[:200])

    try:
        probe()
        macro, micro = obs(2, seed=5)
        assert c.decide(macro, micro).actions.shape == (2, NET.num_branches)
    finally:
        c.close()
    grown = _replica_rss_mb(server["url"]) - before
    assert grown < 200, f"the replica grew by {grown:.0f} MB over the fuzzed requests"


def _json_ok(doc) -> bool:
    try:
        json.dumps(doc, allow_nan=False)
        return True
    except (ValueError, TypeError):
        return False


def test_a_guard_without_its_training_trace_is_refused_naming_the_way_out(tmp_path, capsys):
    from apex_bdq import serving as S
    from apex_bdq.config import TraceConfig
    from launch.serve import main
    trace = tmp_path / "gone_1min.csv"
    trace.write_text("minute,rate\n" + "".join(f"{i},{10 + i % 7}\n" for i in range(3000)))
    ck = tmp_path / "policy.pt"
    sim = CFG.sim.replace(trace=TraceConfig(path=str(trace)))
    torch.manual_seed(0)
    net = BDQNetwork(NET)
    save_checkpoint(ck, config_to_dict(dataclasses.replace(CFG, sim=sim, net=NET)),
                    {"net": net.state_dict(), "version": 1}, {"updates": 1})
    trace.unlink()  # served on a machine without the trace it was trained on
    assert main(["--checkpoint", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "training trace" in err and "--no-guard" in err
    p = S.policy_from_checkpoint(ck, guard=False)  # what --no-guard serves: the bare network
    macro, micro = obs(3)
    a, q = p.decide(macro, micro)
    np.testing.assert_array_equal(a, q.argmax(-1)) and p.guard is None


def test_the_served_policy_decides_under_its_guard_and_counts(tmp_path):
    from apex_bdq import serving as S
    ck = tmp_path / "policy.pt"
    net = write_checkpoint(ck, 3, seed=2)
    p = S.policy_from_checkpoint(ck)
    assert p.guard is not None
    macro, micro = obs(6, seed=4)
    a, q = p.decide(macro, micro)
    np.testing.assert_allclose(q, q_of(net, macro, micro), rtol=1e-5, atol=1e-5)
    want, clipped, capped, back = p.guard.apply(macro, q.argmax(-1))
    np.testing.assert_array_equal(a, want)
    assert p.guard_counts == {"decisions": 6, "clipped": int(clipped.sum()), "fallback": int(back.sum()),
                              "admission_capped": int(capped.sum())}


def _replica_rss_mb(url: str) -> float:
    import psutil
    with DecisionClient(url, token=TOKEN) as c:
        return psutil.Process(c.status()["pid"]).memory_info().rss / 2 ** 20


def _send_chunked(url: str, path: str, total: int, chunk: int = 1 << 20) -> int:
    """POST `total` bytes with Transfer-Encoding: chunked (no Content-Length); the status, or 0
    when the server closed the connection after refusing (it may not wait for the rest)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/msgpack")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        block = b"\x00" * chunk
        try:
            for _ in range(total // chunk):
                conn.send(b"%x\r\n" % chunk + block + b"\r\n")
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            return conn.getresponse().status
        except (http.client.HTTPException, ConnectionResetError, BrokenPipeError):
            return 0
    finally:
        conn.close()


@pytest.mark.ray
def test_hostile_bodies_get_a_4xx_and_leave_the_replica_memory_bounded(server):
    """The issue's cases over live HTTP: a chunked 96 MiB body without Content-Length, 4 MB of
    msgpack empty arrays, 12 MB of JSON empty arrays, a packed shape [0, 2**63-1], dtype null,
    300 feedback pairs: every answer a 4xx, the replica's RSS bounded, the service still fine."""
    url = server["url"]
    micro = np.zeros((1, NET.num_classes, NET.history, NET.micro_features), np.float32).tolist()
    before = _replica_rss_mb(url)
    status = _send_chunked(url, "/v1/decide", 96 << 20)
    assert status in (413, 0), status  # 0: refused and the connection closed mid-upload
    cases = [
        ("/v1/decide", msgpack.packb([[[] for _ in range(65536)] for _ in range(64)]), "application/msgpack", 413),
        ("/v1/decide", b"[" + b"[]," * (4 << 20) + b"[]]", "application/json", 413),
        ("/v1/decide", msgpack.packb({"macro": {"dtype": "<f4", "shape": [0, 2 ** 63 - 1], "data": b""},
                                      "micro": micro}, use_bin_type=True), "application/msgpack", 422),
        ("/v1/decide", msgpack.packb({"macro": {"dtype": None, "shape": [1, NET.macro_features],
                                                "data": b"\0" * 8 * NET.macro_features}, "micro": micro},
                                     use_bin_type=True), "application/msgpack", 422),
        ("/v1/feedback", json.dumps({"pairs": [{"a": f"s{i}", "b": f"t{i}"} for i in range(300)]}).encode(),
         "application/json", 413),
    ]
    with DecisionClient(url) as c:
        for path, body, ct, want in cases:
            st, _, raw = c.request("POST", path, body, ct, {"Authorization": f"Bearer {TOKEN}"})
            assert st == want, (path, want, st, raw[:200])
        st, _, _ = c.request("POST", "/v1/decide", b"{}", "application/json", {"Content-Length": "abc"})
        assert 400 <= st < 500
    grown = _replica_rss_mb(url) - before
    assert grown < 300, f"the replica grew by {grown:.0f} MB"
    macro, m = obs(2, seed=7)
    with DecisionClient(url) as c:
        assert c.decide(macro, m).actions.shape == (2, NET.num_branches)


@pytest.mark.ray
def test_the_service_and_haproxy_listen_on_loopback_and_the_admin_socket_is_private(server):
    import psutil
    from apex_bdq.haproxy_ingress import private_folder
    ports = {server["port"]: "service", server["stats_port"]: "HAProxy stats", server["metrics_port"]: "exporter"}
    listening = {}
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
            listening.setdefault(ports[c.laddr.port], set()).add(c.laddr.ip)
    assert set(listening) == set(ports.values()), listening  # all three are up ...
    assert all(ips == {"127.0.0.1"} for ips in listening.values()), listening  # ... on loopback only
    d = private_folder(server["port"])
    assert (d.stat().st_mode & 0o777) == 0o700 and (d.parent.stat().st_mode & 0o777) == 0o700
    (sock,) = d.rglob("admin.sock")  # Ray puts it in a per-node folder inside the private one
    assert (sock.stat().st_mode & 0o777) == 0o600
    assert all("mode 600" in cfg.read_text() for cfg in d.rglob("haproxy.cfg"))


@pytest.mark.ray
def test_past_the_queue_limit_requests_get_503_with_retry_after(tmp_path):
    """One request at a time and one queued: a burst of slow requests gets 200s and 503s with
    Retry-After, nothing else."""
    with serving(tmp_path, "--max-ongoing", "1", "--max-queued", "1", "--no-batching") as s:
        rng = np.random.default_rng(0)
        big = 8192
        body = msgpack.packb({
            "macro": {"dtype": "<f4", "shape": [big, NET.macro_features],
                      "data": rng.random((big, NET.macro_features), dtype=np.float32).tobytes()},
            "micro": {"dtype": "<f4", "shape": [big, NET.num_classes, NET.history, NET.micro_features],
                      "data": rng.random((big, NET.num_classes, NET.history, NET.micro_features),
                                         dtype=np.float32).tobytes()}, "include_q": False}, use_bin_type=True)
        answers = []

        def one():
            with DecisionClient(s["url"]) as c:
                st, h, _ = c.request("POST", "/v1/decide", body, "application/msgpack", retry=False)
                answers.append((st, h.get("retry-after")))

        threads = [threading.Thread(target=one) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = sorted({a for a, _ in answers})
        assert len(answers) == 24 and set(statuses) <= {200, 503}, answers
        assert 200 in statuses and 503 in statuses, answers
        assert all(r is not None and int(r) >= 1 for st, r in answers if st == 503), answers


@pytest.mark.ray
def test_valid_requests_beside_hostile_ones_all_answered_and_no_5xx(server):
    """The load test of issue 26 at small size: valid decisions from 2 clients beside 3
    clients sending amplifiers, a 60 MiB body that fails validation, malformed and deep JSON.
    Every valid request gets a 200; every hostile one a 4xx, a 503 with back-pressure, or a
    closed connection after its refusal; never another 5xx. (The latency figures alone and
    under abuse: `python -m launch.bench serve-abuse`, docs/hardening.md.)"""
    from launch.bench_serve import abuse_load
    res = abuse_load(server["url"], seconds=6.0, valid_clients=2, hostile_clients=3)
    for phase in ("alone", "under_abuse"):
        assert set(res[phase]["valid_status"]) == {200} and res[phase]["valid"]["n"] > 20, res[phase]
    codes = {k.split(" -> ")[1] for k in res["under_abuse"]["hostile_status"]}
    assert codes and all(c.startswith("closed") or c == "503" or c.startswith("4") for c in codes), codes
    assert any(c.startswith("4") for c in codes)
    macro, micro = obs(2, seed=8)
    with DecisionClient(server["url"]) as c:
        assert c.decide(macro, micro).actions.shape == (2, NET.num_branches)


@pytest.mark.ray
def test_clock_stamps_and_the_replicas_own_port(server):
    """`x-apex-clock` (asked for) returns the handler's stages on the host's monotonic clock,
    between the client's send and receive; the replica's own port from HAProxy's config (the
    bench's HAProxy-skipped path) answers the same decision."""
    import time

    from apex_bdq.haproxy_ingress import private_folder
    from apex_bdq.serve_app import CLOCK_HEADER
    from apex_bdq.serving import MSGPACK, pack_array
    from launch.bench_serve import haproxy_config, replica_urls
    macro, micro = obs(1, seed=5)
    body = msgpack.packb({"macro": pack_array(macro), "micro": pack_array(micro)}, use_bin_type=True)
    c = DecisionClient(server["url"])
    try:
        _, plain, _ = c.request("POST", "/v1/decide", body, MSGPACK)
        assert CLOCK_HEADER not in plain  # only when asked
        t0 = time.perf_counter()
        status, h, raw = c.request("POST", "/v1/decide", body, MSGPACK, headers={CLOCK_HEADER: "1"})
        t1 = time.perf_counter()
    finally:
        c.close()
    assert status == 200
    stamps = [float(x) for x in h[CLOCK_HEADER].split(",")]
    assert len(stamps) == 4 and t0 <= stamps[0] <= stamps[1] <= stamps[2] <= stamps[3] <= t1
    urls = replica_urls(haproxy_config(private_folder(server["port"])))
    assert len(urls) == 1 and urls[0] != server["url"]
    direct = DecisionClient(urls[0]).decide(macro, micro)
    via = DecisionClient(server["url"]).decide(macro, micro)
    assert np.array_equal(direct.actions, via.actions) and direct.version == via.version


def test_bench_floor_bare_asgi_server_stages_add_up(tmp_path):
    """The serving bench's floor (launch/_bare_asgi.py, no Ray) answers the policy's decision,
    and its one-clock breakdown adds up to the latency it measured."""
    from apex_bdq.serving import policy_from_checkpoint
    from launch.bench_serve import http_clocked
    ck = tmp_path / "policy.pt"
    write_checkpoint(ck, 3, seed=2)
    port = free_port()
    with open(tmp_path / "bare.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launch._bare_asgi", "--checkpoint", str(ck), "--port",
                                 str(port)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: DecisionClient(url).healthz()["status"] == "ok", 120, "the bare ASGI server", interval=0.3,
                 ignore=(OSError, ServiceError, http.client.HTTPException),
                 detail=lambda: (tmp_path / "bare.out").read_text()[-2000:])
        macro, micro = obs(4, seed=6)
        d = DecisionClient(url).decide(macro, micro)
        want, q = policy_from_checkpoint(ck).decide(macro, micro)
        assert np.array_equal(d.actions, want) and np.allclose(d.q, q, atol=1e-6)
        cell = http_clocked(url, macro, micro, 40, warm=5)
        assert set(cell["stages_ms"]) == {"client_encode", "to_handler", "read_parse", "decide", "encode",
                                          "from_handler", "client_decode"}
        assert cell["clock_ordered_share"] == 1.0
        assert cell["stage_means_sum_ms"] == pytest.approx(cell["mean_ms"], rel=1e-6)
        assert cell["n"] == 40 and cell["p50_ms"] > 0
        empty = http_clocked(url, macro, micro, 10, path="/v1/empty", warm=2)
        assert set(empty["stages_ms"]) == {"client_encode", "server", "client_decode"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_replica_urls_reads_servers_not_backups():
    from launch.bench_serve import replica_urls
    cfg = ("backend default\n    server replica_a 10.0.0.5:30001 check observe layer4\n"
           "    server fallback 10.0.0.5:8001 check backup\n"
           "backend router\n    server replica_a 10.0.0.5:30001 track default/replica_a\n"
           "    server replica_b 10.0.0.5:30002 check\n")
    assert replica_urls(cfg) == ["http://10.0.0.5:30001", "http://10.0.0.5:30002"]
