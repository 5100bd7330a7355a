"""The Ray Serve deployment of the decision service (the HTTP shell around
apex_bdq/serving.py; `python -m launch.serve` starts it).

    POST /v1/decide    one or many shard observations (JSON or msgpack) -> actions, Q, version
    POST /v1/feedback  ranked segment pairs -> the preference actor (bearer token required)
    GET  /v1/status    policy source, swaps, reload errors, guard counts, limits (bearer token required)
    GET  /healthz      ok and the policy version, nothing else (no token)
    GET  /docs, /openapi.json

Every request's memory is bounded before anything is allocated (body size while streaming,
decoded values, array shapes: apex_bdq/serving.py), the body bytes a replica holds at once are
capped (503 + Retry-After past it), and so are the requests queued for a replica
(`max_queued_requests`, 503 + Retry-After from Serve). Requests are validated in the replica (4xx naming the problem), then queued into
`@serve.batch`: concurrent requests are decided by one forward pass over all their shards.
The policy is an immutable object swapped by reference when a newer version loads, so a
request in flight finishes on the version it started with, and every answer names it.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at
# route registration, through Serve's ingress wrapper, and string annotations do not resolve there.
import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from apex_bdq import serving as S

APP_NAME = "apex_bdq"
FORWARD_THREAD_MIN_SHARDS = 128
FEEDBACK_TIMEOUT_S = 30.0
DEPLOYMENT_NAME = "DecisionService"


@dataclass
class ServeOptions:
    checkpoint: Optional[str] = None
    """Serve this checkpoint; reloaded when the file changes (every reload_s)."""
    follow: bool = False
    """Follow the weight store of the training run on this cluster instead."""
    batching: bool = True
    max_batch_shards: int = 1024
    """Shards per batched forward pass; a request this large or larger skips the queue."""
    batch_wait_s: float = 0.0
    """How long a batch waits for more requests; 0 = take what is queued (adaptive batching)."""
    max_ongoing_requests: int = 256
    """Serve's default (5) starves @serve.batch."""
    max_queued_requests: int = 1024
    """Requests waiting for a replica beyond max_ongoing_requests; past it Serve answers 503
    with Retry-After (Ray's default: unbounded)."""
    max_body_bytes_in_flight: int = 256 << 20
    """Request body bytes one replica holds at once (all requests being read); past it 503 with
    Retry-After, so many large requests together cannot exhaust its memory."""
    retry_after_s: int = 1
    replicas: int = 1
    replica_cpus: float = 1.0
    torch_threads: int = 1
    reload_s: float = 2.0
    feedback_token: Optional[str] = None
    initial_wait_s: float = 60.0
    """--follow: how long a new replica waits for the run's first weights."""
    guard: bool = True
    """Decide under the policy's guard (apex_bdq/guard.py; platform v2): its band around the
    reference rule and its fallback outside the training days' load shapes. False: the bare
    network's greedy actions."""
    user_code_thread: bool = False
    """Run the handler on its own event loop in a second thread, Serve's default
    (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1`). Off here: every request then skips a
    hand-over between the replica's two loops; the handler never blocks its loop (large
    forwards run in a worker thread), which is what that default protects against."""

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (not self.follow):
            raise ValueError("give exactly one of checkpoint=PATH or follow=True")
        for name in ("max_batch_shards", "max_ongoing_requests", "max_queued_requests", "replicas", "torch_threads",
                     "retry_after_s"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.batch_wait_s < 0 or self.reload_s <= 0 or self.replica_cpus < 0:
            raise ValueError("batch_wait_s >= 0, reload_s > 0 and replica_cpus >= 0 are required")
        if self.max_body_bytes_in_flight < S.MAX_BODY_BYTES:
            raise ValueError(f"max_body_bytes_in_flight must be >= the largest body ({S.MAX_BODY_BYTES})")
        if self.feedback_token is not None:
            S.check_token(self.feedback_token, "ServeOptions.feedback_token")


# -- OpenAPI: the bodies are parsed by apex_bdq.serving (JSON and msgpack), documented here ---
class DecideRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    macro: List[Any] = Field(description="[B, Fm] platform-level features, or [Fm] for one shard")
    micro: List[Any] = Field(description="[B, K, H, Fu] per-class history, or [K, H, Fu] for one shard")
    include_q: bool = Field(True, description="return the Q-values [B, D, n]")


class DecideResponse(BaseModel):
    version: int = Field(description="weight version of the policy that decided")
    shards: int
    branches: List[str] = Field(description="names of the D action branches")
    actions: List[List[int]] = Field(description="[B, D] greedy sub-action per branch")
    q: List[Any] = Field(description="[B, D, n] Q-values (when include_q)")


class FeedbackPair(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: str
    b: str
    label: Any = Field(1.0, description="1 / 'a': a preferred; 0 / 'b': b preferred; 0.5 / 'tie'")


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pairs: List[FeedbackPair]
    segments: List[Any] = Field([], description="optional segments to add first: {id, macro [T, Fm], micro "
                                                "[T, K, H, Fu], action [T, D], metrics, source}")


def _inline_refs(node, defs: dict):
    """Replace {"$ref": "#/$defs/X"} by the definition (the request body schema stands alone)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _body_doc(model) -> dict:
    schema = model.model_json_schema()
    schema = _inline_refs(schema, schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {
        S.JSON: {"schema": schema},
        S.MSGPACK: {"schema": {"type": "object", "description": "the same fields; arrays may also be "
                                                                 "{dtype, shape, data: bytes}"}}}}}


app = FastAPI(title="apex-bdq decisions", version="1",
              description="Learned capacity / priority / admission / scheduling decisions per platform shard.")


@app.exception_handler(S.RequestError)
async def _request_error(request: Request, e: S.RequestError):
    headers = {"WWW-Authenticate": 'Bearer realm="apex-bdq"'} if e.status == 401 else None
    if e.status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse({"error": e.message}, status_code=e.status, headers=headers)


RETRY_AFTER_S = 1


class _BodyBudget:
    """The body bytes a replica holds at once, over all requests being read."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise S.RequestError(503, f"this replica holds {self.used:,} bytes of request bodies, its limit is "
                                      f"{self.limit:,}: retry")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


async def read_body(request: Request, budget: _BodyBudget) -> bytes:
    """The body, read in chunks whatever the transfer encoding, refused with 413 as soon as it
    passes MAX_BODY_BYTES (a Content-Length over it before any byte is read) and with 503 when
    the replica's budget of body bytes in flight is spent. The bytes read stay charged to the
    budget until the caller gives them back (`budget.give(len(body))` when the request is done:
    the decoded arrays may be views of the body); a refused read gives back its own."""
    n = request.headers.get("content-length")
    if n is not None:
        if not n.strip().isdigit():
            raise S.RequestError(400, f"bad Content-Length {n[:40]!r}")
        if int(n) > S.MAX_BODY_BYTES:
            raise S.RequestError(413, f"body of {n} bytes is over the limit of {S.MAX_BODY_BYTES}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            if size + len(chunk) > S.MAX_BODY_BYTES:
                raise S.RequestError(413, f"body over the limit of {S.MAX_BODY_BYTES} bytes")
            budget.take(len(chunk))
            size += len(chunk)
            chunks.append(chunk)
    except BaseException:
        budget.give(size)
        raise
    return b"".join(chunks)


CLOCK_HEADER = "x-apex-clock"
"""A request that carries this header (any value) gets it back holding the handler's stages as
times of the host's monotonic clock (`time.perf_counter()`, CLOCK_MONOTONIC on Linux: the same
clock in every process of one machine): `entry,parsed,decided,encoded` in seconds. A client on
the same host places them between its own send and receive: a breakdown on one clock
(`launch.bench serve`)."""


def clock_stamps(*t: float) -> str:
    return ",".join(f"{x:.7f}" for x in t)


def _timing(**ms: float) -> str:
    """Server-Timing header (RFC: name;dur=milliseconds)."""
    return ", ".join(f"{k};dur={v:.3f}" for k, v in ms.items())


@serve.ingress(app)
class DecisionService:
    def __init__(self, opts: ServeOptions) -> None:
        import torch
        torch.set_num_threads(opts.torch_threads)
        self.opts = opts
        if opts.follow:
            import ray
            from actors.preference_actor import NAMESPACE
            from learner.weight_store import WEIGHT_STORE_NAME
            try:
                store = ray.get_actor(WEIGHT_STORE_NAME, namespace=NAMESPACE)
            except ValueError:
                raise RuntimeError(f"no weight store {WEIGHT_STORE_NAME!r} in namespace {NAMESPACE!r}: is a "
                                   f"distributed training run going on this cluster?") from None
            meta = ray.get(store.meta.remote())
            if meta is None:
                raise RuntimeError(f"the weight store {WEIGHT_STORE_NAME!r} does not say which network it holds")
            net_cfg = meta.net
            self.branches = tuple(meta.branches) or tuple(f"branch_{d}" for d in range(net_cfg.num_branches))
            deadline = time.time() + opts.initial_wait_s
            while (got := ray.get(store.get_if_newer.remote(-1))) is None:
                if time.time() > deadline:
                    raise RuntimeError(f"the run's weight store had no weights after {opts.initial_wait_s:.0f} s")
                time.sleep(0.5)
            policy = S.policy_from_state(net_cfg, ray.get(got.ref[0]), got.version, "weight-store",
                                         guard=getattr(meta, "guard", None) if opts.guard else None)
            self.holder = S.PolicyHolder(policy)
            self.holder.follow(store, opts.reload_s,
                               lookup=lambda: ray.get_actor(WEIGHT_STORE_NAME, namespace=NAMESPACE))
        else:
            from apex_bdq.checkpoint import load_checkpoint
            from apex_bdq.config import sim_config_from_dict
            self.holder = S.PolicyHolder(S.policy_from_checkpoint(opts.checkpoint, guard=opts.guard))
            self.branches = sim_config_from_dict(load_checkpoint(opts.checkpoint)["config"]["sim"]).branch_names
            self.holder.watch_checkpoint(opts.checkpoint, opts.reload_s)
        if opts.batching:
            self._batched.set_max_batch_size(opts.max_batch_shards)
            self._batched.set_batch_wait_timeout_s(opts.batch_wait_s)
        from concurrent.futures import ThreadPoolExecutor
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self.token = opts.feedback_token
        global RETRY_AFTER_S
        RETRY_AFTER_S = opts.retry_after_s
        self._bodies = _BodyBudget(opts.max_body_bytes_in_flight)
        self._pref = None
        self.served = 0
        self._inflight = 0

    # -- deciding ------------------------------------------------------------------------------
    async def _forward(self, policy: S.Policy, macro: np.ndarray, micro: np.ndarray):
        """Small batches run inline (a thread hop costs ~0.1 ms); large ones in the forward
        thread, so the event loop parses the next requests while torch computes."""
        if macro.shape[0] < FORWARD_THREAD_MIN_SHARDS:
            return policy.decide(macro, micro)
        return await asyncio.get_running_loop().run_in_executor(self._pool, policy.decide, macro, micro)

    @serve.batch(max_batch_size=1024, batch_wait_timeout_s=0.0, batch_size_fn=lambda items: sum(len(it[0]) for it in items))
    async def _batched(self, items: list) -> list:
        """items: (macro [b, Fm], micro [b, K, H, Fu], t_enqueued); the batch is capped in
        shards (batch_size_fn). One forward over all of them."""
        t0 = time.perf_counter()
        policy = self.holder.policy
        if len(items) == 1:
            parts = [await self._forward(policy, items[0][0], items[0][1])]
        else:
            sizes = np.cumsum([it[0].shape[0] for it in items])[:-1]
            actions, q = await self._forward(policy, np.concatenate([it[0] for it in items]),
                                             np.concatenate([it[1] for it in items]))
            parts = list(zip(np.split(actions, sizes), np.split(q, sizes)))
        model_ms = (time.perf_counter() - t0) * 1e3
        return [(a, qq, policy.version, (t0 - it[2]) * 1e3, model_ms, len(items)) for (a, qq), it in zip(parts, items)]

    async def _decide(self, macro: np.ndarray, micro: np.ndarray):
        """Through the batch queue only when other requests are in flight (counted from the
        moment they arrive, before their body is read): a lone request (concurrency 1) skips
        the queue's ~0.3 ms, a request that fills a batch by itself too."""
        t = time.perf_counter()
        if self.opts.batching:
            await asyncio.sleep(0)  # let requests already handed to this loop arrive (and count)
        if self.opts.batching and self._inflight > 1 and macro.shape[0] < self.opts.max_batch_shards:
            return await self._batched((macro, micro, t))
        policy = self.holder.policy
        actions, q = await self._forward(policy, macro, micro)
        return actions, q, policy.version, 0.0, (time.perf_counter() - t) * 1e3, 1

    @app.post("/v1/decide", response_model=DecideResponse, openapi_extra=_body_doc(DecideRequest),
              summary="Decide actions for one or many shards")
    async def decide_http(self, request: Request) -> Response:
        self._inflight += 1
        try:
            return await self._decide_http(request)
        finally:
            self._inflight -= 1

    async def _decide_http(self, request: Request) -> Response:
        t0 = time.perf_counter()
        mt = S.media_type(request.headers.get("content-type"))
        raw = await read_body(request, self._bodies)
        try:
            return await self._decide_body(raw, mt, t0, CLOCK_HEADER in request.headers)
        finally:
            self._bodies.give(len(raw))  # held until the answer: the arrays may be views of the body

    async def _decide_body(self, raw: bytes, mt: str, t0: float, clock: bool = False) -> Response:
        doc = S.decode_body(raw, mt)
        macro, micro, include_q = S.parse_decide(doc, self.holder.cfg)
        t1 = time.perf_counter()
        actions, q, version, queue_ms, model_ms, batch = await self._decide(macro, micro)
        S.check_output(q)
        t2 = time.perf_counter()
        out_mt = S.MSGPACK if mt in S.MSGPACK_TYPES else S.JSON
        body = S.encode_body(S.decision_doc(actions, q if include_q else None, version, out_mt, self.branches), out_mt)
        t3 = time.perf_counter()
        self.served += macro.shape[0]
        headers = {"Server-Timing": _timing(parse=(t1 - t0) * 1e3, queue=queue_ms, model=model_ms,
                                            encode=(t3 - t2) * 1e3, replica=(t3 - t0) * 1e3),
                   "X-Policy-Version": str(version), "X-Batch-Requests": str(batch)}
        if clock:
            headers[CLOCK_HEADER] = clock_stamps(t0, t1, t2, t3)
        return Response(body, media_type=out_mt, headers=headers)

    async def decide(self, macro, micro, include_q: bool = True) -> dict:
        """The deployment-handle path: numpy arrays in, numpy arrays out (no HTTP, no codec)."""
        self._inflight += 1
        try:
            return await self._decide_handle(macro, micro, include_q)
        finally:
            self._inflight -= 1

    async def _decide_handle(self, macro, micro, include_q: bool) -> dict:
        t0 = time.perf_counter()
        try:
            macro, micro = S.check_obs(macro, micro, self.holder.cfg)
        except (TypeError, ValueError) as e:
            if isinstance(e, S.RequestError):
                raise
            raise S.RequestError(422, f"observations are not numeric arrays: {e}") from None
        actions, q, version, queue_ms, model_ms, batch = await self._decide(macro, micro)
        S.check_output(q)
        self.served += macro.shape[0]
        return {"actions": actions, "q": q if include_q else None, "version": version,
                "timing_ms": {"queue": queue_ms, "model": model_ms, "replica": (time.perf_counter() - t0) * 1e3},
                "batch_requests": batch}

    # -- feedback ------------------------------------------------------------------------------
    def _authorise(self, request: Request) -> None:
        if not self.token:
            raise S.RequestError(403, "this route is disabled on this server: start it with a token "
                                      f"(${S.TOKEN_FILE_ENV} or --token-file, or ${S.TOKEN_ENV})")
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer ") or not auth[7:].strip():
            raise S.RequestError(401, "this route needs 'Authorization: Bearer <token>'")
        import hmac
        if not hmac.compare_digest(auth[7:].strip().encode(), self.token.encode()):
            raise S.RequestError(403, "wrong feedback token")

    def _preference_actor(self):
        import ray
        from actors.preference_actor import NAMESPACE, PREFERENCE_ACTOR_NAME
        if self._pref is None:
            try:
                self._pref = ray.get_actor(PREFERENCE_ACTOR_NAME, namespace=NAMESPACE)
            except ValueError:
                raise S.RequestError(503, f"no preference actor {PREFERENCE_ACTOR_NAME!r} on this cluster: run training "
                                          f"with pref.enabled=true, or start serve with --feedback-log PATH") from None
        return self._pref

    @app.post("/v1/feedback", openapi_extra=_body_doc(FeedbackRequest),
              summary="Rank segment pairs (a preferred to b); needs a bearer token")
    async def feedback_http(self, request: Request) -> Response:
        import ray
        from apex_bdq.preference import FeedbackError, UnknownSegment
        self._authorise(request)
        mt = S.media_type(request.headers.get("content-type"))
        raw = await read_body(request, self._bodies)
        try:
            pairs, segments = S.parse_feedback(S.decode_body(raw, mt), self.holder.cfg)
        finally:
            self._bodies.give(len(raw))  # parsed into segments of their own; the body can go
        actor = self._preference_actor()
        try:
            results = await asyncio.wait_for(actor.rank_many.remote(pairs, segments, "http"), FEEDBACK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise S.RequestError(503, f"the preference actor did not answer within {FEEDBACK_TIMEOUT_S:.0f} s; retry "
                                      f"(a pair it accepted meanwhile comes back as 'duplicate')") from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, UnknownSegment):
                raise S.RequestError(404, str(cause)) from None
            if isinstance(cause, FeedbackError):
                raise S.RequestError(422, str(cause)) from None
            raise
        except ray.exceptions.RayActorError as e:
            self._pref = None  # it restarts (replaying its log) or is gone: look it up again next time
            raise S.RequestError(503, f"the preference actor is unavailable ({type(e).__name__}); retry: accepted "
                                      f"pairs are in its log") from None
        return JSONResponse({"results": results, "accepted": results.count("accepted"),
                             "duplicates": results.count("duplicate")})

    @app.get("/healthz", summary="ok and the policy version (no token; the details are in /v1/status)")
    async def healthz(self) -> dict:
        return {"status": "ok", "version": self.holder.policy.version}

    @app.get("/v1/status", summary="Policy source, swaps, reload errors, guard counts, limits; needs a bearer token")
    async def status_http(self, request: Request) -> dict:
        from ray.serve._private import constants as serve_constants
        self._authorise(request)
        p = self.holder.policy
        return {"status": "ok", "version": p.version, "source": p.source, "loaded_at": p.loaded_at, "pid": os.getpid(),
                "swaps": self.holder.swaps, "last_reload_error": self.holder.last_error,
                "limits": {"max_body_bytes": S.MAX_BODY_BYTES, "max_values": S.MAX_ELEMENTS,
                           "max_shards": S.MAX_SHARDS, "max_pairs": S.MAX_PAIRS, "max_segments": S.MAX_SEGMENTS,
                           "max_ongoing_requests": self.opts.max_ongoing_requests,
                           "max_queued_requests": self.opts.max_queued_requests,
                           "max_body_bytes_in_flight": self.opts.max_body_bytes_in_flight},
                "batching": {"enabled": self.opts.batching, "max_batch_shards": self.opts.max_batch_shards,
                             "batch_wait_s": self.opts.batch_wait_s},
                "branches": list(self.branches), "shards_served": self.served,
                # decisions of the current policy version its guard bounded to the rule's band or
                # replaced by the rule's (an observation outside the training days' load shapes)
                "guard": None if p.guard is None else dict(p.guard_counts),
                # as Serve read its environment when this replica started
                "user_code_thread": bool(serve_constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD),
                "net": {f: getattr(p.net.cfg, f) for f in p.net.cfg.SHAPE_FIELDS}}

    def __del__(self) -> None:
        holder = getattr(self, "holder", None)
        if holder is not None:
            holder.stop()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def build_app(opts: ServeOptions):
    from ray.serve.config import BackpressureConfig
    return serve.deployment(name=DEPLOYMENT_NAME, num_replicas=opts.replicas,
                            max_ongoing_requests=opts.max_ongoing_requests,
                            max_queued_requests=opts.max_queued_requests,
                            backpressure_config=BackpressureConfig(status_code=503, retry_after_s=opts.retry_after_s),
                            ray_actor_options={"num_cpus": opts.replica_cpus, "runtime_env": {"env_vars": {
                                "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1" if opts.user_code_thread else "0"}}},
                            )(DecisionService).bind(opts)


def app_builder(args: dict):
    """The Serve config entry point: `import_path: apex_bdq.serve_app:app_builder` with `args`
    holding ServeOptions fields (`serve run deploy/serve_config.yaml`, `serve deploy`, KubeRay's
    RayService). The feedback token comes from $APEX_BDQ_FEEDBACK_TOKEN_FILE or
    $APEX_BDQ_FEEDBACK_TOKEN, never from the config file."""
    import dataclasses
    allowed = {f.name for f in dataclasses.fields(ServeOptions)} - {"feedback_token"}
    bad = set(args or {}) - allowed
    if bad:
        raise ValueError(f"unknown Serve app args {sorted(bad)}; allowed: {sorted(allowed)}")
    return build_app(ServeOptions(**(args or {}), feedback_token=S.load_token(None)))


def ensure_preference_actor(net_cfg, log_path: str):
    """A preference actor for feedback over HTTP when no training run has one: it writes the
    same durable log a later run reads with `--set pref.log_path=...`."""
    import ray
    from actors.preference_actor import NAMESPACE, PREFERENCE_ACTOR_NAME, remote_preference_class
    from apex_bdq.config import PreferenceConfig
    try:
        return ray.get_actor(PREFERENCE_ACTOR_NAME, namespace=NAMESPACE), False
    except ValueError:
        pass
    cfg = PreferenceConfig(enabled=True, oracle_pairs=0)
    actor = remote_preference_class(max_restarts=-1).options(
        name=PREFERENCE_ACTOR_NAME, namespace=NAMESPACE, num_cpus=0, lifetime="detached",
        max_concurrency=1).remote(net_cfg, cfg, os.path.abspath(log_path))
    ray.get(actor.stats.remote())
    return actor, True


def start(opts: ServeOptions, port: int = 8000, host: str = "127.0.0.1", blocking: bool = False):
    """Deploy on the connected Ray cluster; returns the deployment handle."""
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(opts), name=APP_NAME, route_prefix="/", blocking=blocking,
                     logging_config={"enable_access_log": False, "log_level": "WARNING"})  # a log line per request costs ~0.3 ms


