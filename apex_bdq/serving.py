"""The online decision path without Ray: request decoding and validation, the policy and its
versioned swaps, the batched forward, response encoding. `launch/serve.py` puts this behind a
Ray Serve deployment; `apex_bdq.client` speaks the same wire format.

Wire format (`POST /v1/decide`), JSON (`application/json`) or msgpack (`application/msgpack`):

    {"macro": [B, Fm] or [Fm], "micro": [B, K, H, Fu] or [K, H, Fu], "include_q": true}

In msgpack an array may also be `{"dtype": "<f4", "shape": [...], "data": <bytes>}` (C order),
which costs nothing to decode; responses in msgpack use that form for `actions` (int32
[B, D]) and `q` (float32 [B, D, n]); JSON responses use nested lists. Every response carries
the policy `version` that decided it. Anything malformed raises `RequestError` with an HTTP
status (400 unreadable body, 413 too large, 415 unknown content type, 422 wrong content) and a
message naming the field.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from apex_bdq.inference import FoldedQNet
from apex_bdq.networks import BDQNetwork, NetConfig

log = logging.getLogger("apex_bdq.serving")
JSON = "application/json"
MSGPACK = "application/msgpack"
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
DECIDE_FIELDS = ("macro", "micro", "include_q")
FEEDBACK_FIELDS = ("pairs", "segments")
PAIR_FIELDS = ("a", "b", "label")
SEGMENT_FIELDS = ("id", "macro", "micro", "action", "metrics", "source")
MAX_BODY_BYTES = 64 << 20
"""The largest body read; past it 413, while streaming, whatever the transfer encoding."""
MAX_ELEMENTS = 1 << 20
"""Values (numbers, strings, containers) a body may decode into: JSON and msgpack nested lists
cost 20-60 bytes of Python objects per value, so this bounds a request's memory (~60 MB)
before any field is checked. A packed msgpack array (bytes) counts as one value: send large
batches that way."""
MAX_SHARDS = 65536
MAX_STR = 4096
"""Longest string in a msgpack body (ids, keys, dtypes, sources)."""
MAX_MAP = 64
"""Most keys in one msgpack map."""
MAX_ID = 64
"""Longest segment id accepted."""
MAX_PAIRS = 256
"""Ranked pairs per /v1/feedback request."""
MAX_SEGMENTS = 64
"""Inline segments per /v1/feedback request."""
MAX_SEGMENT_DECISIONS = 1024
"""Decisions (T) per inline segment."""
LABELS = {1.0: 1.0, 0.0: 0.0, 0.5: 0.5, "a": 1.0, "b": 0.0, "tie": 0.5}


class RequestError(ValueError):
    """A request the service refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message


# -- bodies -----------------------------------------------------------------------------------
def media_type(content_type: Optional[str]) -> str:
    """`application/json; charset=utf-8` -> `application/json`; none given means JSON."""
    return (content_type or JSON).split(";", 1)[0].strip().lower() or JSON


class _TooManyValues(Exception):
    pass


def _too_many(n: int) -> RequestError:
    return RequestError(413, f"body decodes into more than {MAX_ELEMENTS:,} values ({n:,} counted): send large "
                             "batches as msgpack packed arrays ({dtype, shape, data})")


def decode_body(body: bytes, content_type: Optional[str]) -> Any:
    """Decode a JSON or msgpack body with its memory bounded before anything is allocated:
    the size, then the number of values it can decode into (JSON: counted on the bytes; msgpack:
    counted while decoding, with msgpack's own limits on string, binary, array and map lengths;
    extension types refused)."""
    mt = media_type(content_type)
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(413, f"body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}")
    if not body:
        raise RequestError(400, "empty body: expected a JSON or msgpack object")
    if mt == JSON:
        import orjson
        # every JSON value but the first of a container follows a comma; containers open with [ or {
        n = body.count(b",") + body.count(b"[") + body.count(b"{")
        if n > MAX_ELEMENTS:
            raise _too_many(n)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise RequestError(400, f"body is not valid JSON ({e}); NaN and Infinity are not JSON numbers") from None
    if mt in MSGPACK_TYPES:
        import msgpack
        budget = [MAX_ELEMENTS]

        def count(x):  # called for every array and map once built: the budget ends the decode early
            budget[0] -= len(x) + 1
            if budget[0] < 0:
                raise _TooManyValues()
            return x

        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True, list_hook=count, object_hook=count,
                                   max_str_len=MAX_STR, max_bin_len=MAX_BODY_BYTES, max_array_len=MAX_SHARDS,
                                   max_map_len=MAX_MAP, max_ext_len=0)
        except _TooManyValues:
            raise _too_many(MAX_ELEMENTS - budget[0]) from None
        except Exception as e:  # msgpack raises several unrelated types on bad input
            raise RequestError(400, f"body is not valid msgpack (or over its limits: strings {MAX_STR}, arrays "
                                    f"{MAX_SHARDS}, maps {MAX_MAP}, no extension types): "
                                    f"{type(e).__name__}: {str(e)[:200]}") from None
    raise RequestError(415, f"content type {mt!r} is not supported: send {JSON} or {MSGPACK}")


def encode_body(doc: dict, mt: str) -> bytes:
    if mt in MSGPACK_TYPES:
        import msgpack
        return msgpack.packb(doc, use_bin_type=True)
    import orjson
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def pack_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


MAX_DIMS = 8
_PACKED_DTYPE = re.compile(r"[<>|=]?(?:f[248]|[iu][1248])")


def _as_array(doc: dict, name: str, dtype, where: str = "") -> np.ndarray:
    """A nested list (JSON or msgpack) or a packed {dtype, shape, data} dict -> ndarray.
    Floats are wanted for observations (integers accepted), integers for actions; strings,
    booleans, nulls and bytes inside an array are refused."""
    label = f"{where}{name}"
    want = "floats" if dtype == np.float32 else "integers"
    kinds = "fiu" if dtype == np.float32 else "iu"
    if name not in doc:
        raise RequestError(422, f"field {label!r} is missing")
    v = doc[name]
    if isinstance(v, dict):
        extra = set(v) - {"dtype", "shape", "data"}
        if extra or not {"dtype", "shape", "data"} <= set(v):
            raise RequestError(422, f"{label}: a packed array has exactly the keys dtype, shape, data; got {sorted(v)}")
        shape = v["shape"]
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_BODY_BYTES
                           for x in shape)):
            raise RequestError(422, f"{label}: packed shape must be a list of at most {MAX_DIMS} sizes in "
                                    f"0..{MAX_BODY_BYTES}, got {str(shape)[:80]}")
        code = v["dtype"]
        if not isinstance(code, str) or not _PACKED_DTYPE.fullmatch(code):
            raise RequestError(422, f"{label}: packed dtype must be a numpy type string like '<f4', '<f8', '<i8' "
                                    f"(byte order; f2/f4/f8, i or u 1/2/4/8), got {str(code)[:40]!r}")
        try:
            dt = np.dtype(code)
        except TypeError as e:  # the pattern admits only what numpy knows; this is a second net
            raise RequestError(422, f"{label}: bad packed dtype {code!r}: {e}") from None
        if dt.kind not in kinds or not isinstance(v["data"], (bytes, bytearray)):
            raise RequestError(422, f"{label}: packed array must hold {want} as bytes, got dtype {dt.str}")
        n = math.prod(shape)
        if n * dt.itemsize != len(v["data"]):
            raise RequestError(422, f"{label}: packed data has {len(v['data'])} bytes, shape {list(shape)} of "
                                    f"{dt.str} needs {n * dt.itemsize}")
        try:
            with np.errstate(over="ignore"):  # float64 beyond float32 -> inf, refused later as not finite
                return np.frombuffer(v["data"], dtype=dt).reshape(shape).astype(dtype, copy=False)
        except ValueError as e:  # what numpy refuses beyond the checks above
            raise RequestError(422, f"{label}: packed shape {list(shape)}: {e}") from None
    if not isinstance(v, list):
        raise RequestError(422, f"{label} must be an array (nested lists), got {type(v).__name__}")
    try:
        a = np.asarray(v)  # numpy infers the element kind: strings, None, bytes, bools show up in it
    except (ValueError, TypeError, OverflowError) as e:
        raise RequestError(422, f"{label} is not a rectangular array of numbers: {str(e)[:200]}") from None
    if a.ndim > MAX_DIMS:
        raise RequestError(422, f"{label} has {a.ndim} dimensions")
    if a.size and a.dtype.kind not in kinds:
        raise RequestError(422, f"{label} must hold {want} only, got elements of kind {a.dtype.kind!r} "
                                f"(strings, booleans, nulls{', fractions' if want == 'integers' else ''} are refused)")
    try:
        with np.errstate(over="ignore"):  # 1e300 -> inf in float32, refused later as not finite
            return a.astype(dtype, copy=False)
    except (OverflowError, ValueError) as e:
        raise RequestError(422, f"{label}: {e}") from None


def _unknown(doc: Any, allowed: tuple, what: str) -> None:
    if not isinstance(doc, dict):
        raise RequestError(422, f"{what} must be an object with fields {list(allowed)}, got {type(doc).__name__}")
    extra = [k for k in doc if k not in allowed]
    if extra:
        raise RequestError(422, f"unknown field(s) {extra} in {what}; allowed: {list(allowed)}")


def _check_finite(a: np.ndarray, label: str) -> None:
    if not np.isfinite(a).all():
        bad = np.argwhere(~np.isfinite(a))[0].tolist()
        raise RequestError(422, f"{label} holds NaN or inf (first at index {bad})")


def parse_decide(doc: Any, cfg: NetConfig) -> tuple[np.ndarray, np.ndarray, bool]:
    """-> macro [B, Fm] float32, micro [B, K, H, Fu] float32, include_q."""
    _unknown(doc, DECIDE_FIELDS, "a decide request")
    include_q = doc.get("include_q", True)
    if not isinstance(include_q, bool):
        raise RequestError(422, f"include_q must be true or false, got {include_q!r}")
    macro, micro = check_obs(_as_array(doc, "macro", np.float32), _as_array(doc, "micro", np.float32), cfg)
    return macro, micro, include_q


def check_obs(macro: np.ndarray, micro: np.ndarray, cfg: NetConfig) -> tuple[np.ndarray, np.ndarray]:
    """Shapes, shard count and finiteness of one request's observations (one shard may come
    without the batch axis); -> float32 [B, Fm], [B, K, H, Fu]."""
    macro = np.asarray(macro, dtype=np.float32)
    micro = np.asarray(micro, dtype=np.float32)
    obs = (cfg.num_classes, cfg.history, cfg.micro_features)
    if macro.ndim == 1 and micro.ndim == 3:  # one shard
        macro, micro = macro[None], micro[None]
    if macro.ndim != 2 or macro.shape[1] != cfg.macro_features:
        raise RequestError(422, f"macro must be [B, {cfg.macro_features}] (or [{cfg.macro_features}] for one shard), "
                                f"got {list(macro.shape)}")
    if micro.ndim != 4 or tuple(micro.shape[1:]) != obs:
        raise RequestError(422, f"micro must be [B, {', '.join(map(str, obs))}] (or [{', '.join(map(str, obs))}] for "
                                f"one shard), got {list(micro.shape)}")
    if micro.shape[0] != macro.shape[0]:
        raise RequestError(422, f"macro has {macro.shape[0]} shards, micro {micro.shape[0]}")
    if not 1 <= macro.shape[0] <= MAX_SHARDS:
        raise RequestError(422, f"a request carries 1..{MAX_SHARDS} shards, got {macro.shape[0]}")
    _check_finite(macro, "macro")
    _check_finite(micro, "micro")
    return macro, micro


def check_output(q: np.ndarray) -> None:
    """Finite inputs can still overflow the network (e.g. 3e38): refuse instead of answering
    with NaN Q-values and arbitrary actions."""
    if not np.isfinite(q).all():
        raise RequestError(422, "observations out of range: the network's Q-values are not finite for them")


def decision_doc(actions: np.ndarray, q: Optional[np.ndarray], version: int, mt: str, branches: tuple) -> dict:
    doc: dict = {"version": int(version), "shards": int(actions.shape[0]), "branches": list(branches)}
    if mt in MSGPACK_TYPES:
        doc["actions"] = pack_array(actions.astype(np.int32, copy=False))
        if q is not None:
            doc["q"] = pack_array(q.astype(np.float32, copy=False))
    else:  # orjson writes C-contiguous arrays only (einsum outputs may be strided)
        doc["actions"] = np.ascontiguousarray(actions, dtype=np.int32)
        if q is not None:
            doc["q"] = np.ascontiguousarray(q, dtype=np.float32)
    return doc


def parse_feedback(doc: Any, cfg: NetConfig) -> tuple[list[dict], list]:
    """-> pairs [{a, b, label}], inline segments (apex_bdq.preference.Segment), validated."""
    from apex_bdq.preference import PREFERENCE_METRICS, FeedbackError, Segment
    _unknown(doc, FEEDBACK_FIELDS, "a feedback request")
    pairs = doc.get("pairs")
    if not isinstance(pairs, list) or not pairs:
        raise RequestError(422, "field 'pairs' must be a non-empty list of {a, b, label}")
    if len(pairs) > MAX_PAIRS:
        raise RequestError(413, f"{len(pairs)} pairs in one request; at most {MAX_PAIRS}: split it")
    raw = doc.get("segments", [])
    if not isinstance(raw, list):
        raise RequestError(422, "field 'segments' must be a list")
    if len(raw) > MAX_SEGMENTS:
        raise RequestError(413, f"{len(raw)} segments in one request; at most {MAX_SEGMENTS}: split it")
    out = []
    for i, p in enumerate(pairs):
        _unknown(p, PAIR_FIELDS, f"pairs[{i}]")
        a, b, label = p.get("a"), p.get("b"), p.get("label", 1.0)
        if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
            raise RequestError(422, f"pairs[{i}]: a and b must be segment ids (strings), got a={str(a)[:80]!r} "
                                    f"b={str(b)[:80]!r}")
        if len(a) > MAX_ID or len(b) > MAX_ID:
            raise RequestError(422, f"pairs[{i}]: segment ids are at most {MAX_ID} characters")
        key = label if isinstance(label, str) else (float(label) if isinstance(label, (int, float))
                                                     and not isinstance(label, bool) else None)
        if key not in LABELS:
            raise RequestError(422, f"pairs[{i}].label must be 1 (a preferred), 0 (b preferred), 0.5 (tie) or "
                                    f"'a' / 'b' / 'tie', got {label!r}")
        out.append({"a": a, "b": b, "label": LABELS[key]})
    segments = []
    for i, s in enumerate(raw):
        where = f"segments[{i}]."
        _unknown(s, SEGMENT_FIELDS, f"segments[{i}]")
        sid, source = s.get("id"), s.get("source", "http")
        if not isinstance(sid, str) or not 0 < len(sid) <= MAX_ID:
            raise RequestError(422, f"{where}id must be a string of 1..{MAX_ID} characters, got {str(sid)[:80]!r}")
        if not isinstance(source, str) or len(source) > MAX_ID:
            raise RequestError(422, f"{where}source must be a string of at most {MAX_ID} characters")
        metrics = s.get("metrics")
        if not isinstance(metrics, dict) or not all(isinstance(metrics.get(m), (int, float)) for m in PREFERENCE_METRICS):
            raise RequestError(422, f"{where}metrics must be an object with numbers {list(PREFERENCE_METRICS)}")
        seg = Segment(id=sid, macro=_as_array(s, "macro", np.float32, where),
                      micro=_as_array(s, "micro", np.float32, where), action=_as_array(s, "action", np.int64, where),
                      metrics={m: float(metrics[m]) for m in PREFERENCE_METRICS}, source=source)
        if seg.macro.ndim >= 1 and seg.macro.shape[0] > MAX_SEGMENT_DECISIONS:
            raise RequestError(413, f"{where}macro: {seg.macro.shape[0]} decisions; at most {MAX_SEGMENT_DECISIONS} "
                                    "per segment")
        try:
            seg.check(cfg.macro_features, (cfg.num_classes, cfg.history, cfg.micro_features), cfg.num_branches,
                      cfg.sub_actions)
        except FeedbackError as e:
            raise RequestError(422, f"segments[{i}]: {e}") from None
        segments.append(seg)
    return out, segments


# -- the policy ----------------------------------------------------------------------------------
@dataclass
class Policy:
    """One immutable version of the network; a swap replaces the whole object, so a request
    that holds it finishes on the version it started with."""

    net: BDQNetwork
    version: int
    source: str
    loaded_at: float = field(default_factory=time.time)
    guard: Optional[Any] = None
    """The policy's guard (apex_bdq.guard.Guard; None: the bare network). The decisions it
    bounded or replaced are counted in `guard_counts`."""
    guard_counts: dict = field(default_factory=lambda: {"decisions": 0, "clipped": 0, "admission_capped": 0,
                                                        "fallback": 0})
    folded: Optional[FoldedQNet] = field(default=None, repr=False)
    """The network's forward folded into seven GEMMs (apex_bdq/inference.py), built at load."""

    def __post_init__(self) -> None:
        if self.folded is None:
            self.folded = FoldedQNet(self.net)

    @torch.inference_mode()
    def decide(self, macro: np.ndarray, micro: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-branch actions [B, D] (int64: greedy, then the guard's) and Q [B, D, n] (float32)."""
        if not macro.flags.writeable:  # arrays from Ray's object store are read-only
            macro, micro = macro.copy(), micro.copy()
        elif not micro.flags.writeable:
            micro = micro.copy()
        q = self.folded(torch.from_numpy(macro), torch.from_numpy(micro))
        actions = q.argmax(-1).numpy()
        if self.guard is not None:
            actions, clipped, capped, back = self.guard.apply(macro, actions)
            c = self.guard_counts
            c["decisions"] += len(actions)
            c["clipped"] += int(clipped.sum())
            c["admission_capped"] += int(capped.sum())
            c["fallback"] += int(back.sum())
        return actions, q.numpy()


def guard_of_checkpoint(ck: dict, path: str | Path):
    """The guard a checkpoint's policy runs under (None: off, or platform v1); it needs the
    training trace to know the load shapes training covered."""
    from apex_bdq.checkpoint import CheckpointError, train_config_of
    from apex_bdq.guard import guard_for
    from apex_bdq.sim.trace import TraceError
    cfg = train_config_of(ck, path)
    try:
        return guard_for(cfg)
    except (TraceError, OSError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: its guard needs the training trace to know the load "
                              f"shapes training covered ({e}); serve the bare network with --no-guard") from e


def policy_from_checkpoint(path: str | Path, guard: bool = True) -> Policy:
    """The greedy policy of a checkpoint (the file is read once: a replacement racing the
    load cannot mix two versions), under its guard unless guard=False; version = the
    learner's weight version in it."""
    from apex_bdq.checkpoint import load_checkpoint, network_of, train_config_of
    ck = load_checkpoint(path)
    net = network_of(ck, path)
    train_config_of(ck, path)  # its whole config loads in this version, guarded or not
    version = int(ck["learner"].get("version", ck.get("counters", {}).get("updates", 0)))
    return Policy(net.eval(), version, f"checkpoint:{Path(path).resolve()}",
                  guard=guard_of_checkpoint(ck, path) if guard else None)


def policy_from_state(net_cfg: NetConfig, state: dict, version: int, source: str, guard=None) -> Policy:
    from learner.weight_store import load_numpy_state
    net = BDQNetwork(net_cfg)
    load_numpy_state(net, state)
    return Policy(net.eval(), int(version), source, guard=guard)


class PolicyHolder:
    """The current policy plus a background thread that swaps in newer versions: a changed
    checkpoint file (`watch_checkpoint`) or a newer version in a training run's weight store
    (`follow`). A version that fails to load is reported in `last_error` and the old one stays."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.swaps = 0
        self.last_error: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def cfg(self) -> NetConfig:
        return self.policy.net.cfg

    def swap(self, new: Policy) -> bool:
        """Install `new` if it fits the same observation/action shapes (a changed checkpoint
        file is installed whatever its version: replacing the file is how an operator rolls back)."""
        old = self.policy
        diffs = [f for f in NetConfig.SHAPE_FIELDS if getattr(new.net.cfg, f) != getattr(old.net.cfg, f)]
        if diffs:
            self.last_error = f"{new.source} v{new.version} refused: shapes differ in {diffs}"
            log.warning("policy reload: %s", self.last_error)
            return False
        self.policy = new  # one reference assignment: requests in flight keep the old object
        self.swaps += 1
        self.last_error = None
        log.info("policy v%d from %s swapped in (swap %d)", new.version, new.source, self.swaps)
        return True

    def _loop(self, poll: Callable[[], Optional[Policy]], every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                new = poll()
                if new is not None:
                    self.swap(new)
            except Exception as e:  # keep serving the current version; say why (in the log) the new one failed
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("policy reload failed, still serving v%d: %s", self.policy.version, self.last_error)

    def _start(self, poll: Callable[[], Optional[Policy]], every_s: float) -> None:
        self._thread = threading.Thread(target=self._loop, args=(poll, every_s), name="policy-reload", daemon=True)
        self._thread.start()

    def watch_checkpoint(self, path: str | Path, every_s: float = 2.0) -> None:
        path = Path(path)
        state = {"mtime": path.stat().st_mtime_ns}

        def poll() -> Optional[Policy]:
            m = path.stat().st_mtime_ns
            if m == state["mtime"]:
                return None
            state["mtime"] = m  # a file that fails to load is retried only when it changes again
            return policy_from_checkpoint(path, guard=self.policy.guard is not None)
        self._start(poll, every_s)

    def follow(self, store, every_s: float = 1.0, lookup: Optional[Callable[[], Any]] = None) -> None:
        """`store`: a WeightStore actor handle (learner.weight_store). When it dies (its run
        ended), `lookup()` finds the next one by name and any version of it is taken."""
        import ray
        state = {"store": store, "baseline": self.policy.version}

        def poll() -> Optional[Policy]:
            try:
                got = ray.get(state["store"].get_if_newer.remote(state["baseline"]), timeout=30)
            except ray.exceptions.RayActorError:
                if lookup is None:
                    raise
                state["store"], state["baseline"] = lookup(), -1  # raises while no run has a store
                return None
            if got is None:
                return None
            state["baseline"] = got.version
            return policy_from_state(self.cfg, ray.get(got.ref[0], timeout=60), got.version, "weight-store",
                                     guard=self.policy.guard)
        self._start(poll, every_s)

    def stop(self) -> None:
        self._stop.set()


TOKEN_ENV = "APEX_BDQ_FEEDBACK_TOKEN"
TOKEN_FILE_ENV = "APEX_BDQ_FEEDBACK_TOKEN_FILE"
MIN_TOKEN_CHARS = 16


def check_token(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"the service token from {where} must be at least {MIN_TOKEN_CHARS} characters without "
                         f"spaces (got {len(token)}); make one with `openssl rand -hex 32`")
    return token


def load_token(path: Optional[str] = None) -> Optional[str]:
    """The bearer token for /v1/feedback and /v1/status, never from the command line (which
    other users see in `ps`): the file `path` (or $APEX_BDQ_FEEDBACK_TOKEN_FILE), which must be
    readable by its owner only, else $APEX_BDQ_FEEDBACK_TOKEN. None: no token, those routes
    refuse everything. A token shorter than MIN_TOKEN_CHARS is refused (ValueError)."""
    path = path or os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            st = os.stat(path)
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"service token file {path!r}: {e.strerror or e}") from None
        if st.st_mode & 0o077:
            raise ValueError(f"service token file {path!r} is readable by others (mode {st.st_mode & 0o777:o}): "
                             f"chmod 600 it")
        return check_token(text, f"file {path!r}")
    tok = os.environ.get(TOKEN_ENV)
    return check_token(tok, f"${TOKEN_ENV}") if tok else None
