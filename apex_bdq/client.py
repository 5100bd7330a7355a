"""A small client for the platform side of `launch.serve` (stdlib HTTP, one kept-alive
connection; msgpack with packed arrays by default, JSON on request).

    from apex_bdq.client import DecisionClient
    c = DecisionClient("http://127.0.0.1:8000", token=os.environ.get("APEX_BDQ_FEEDBACK_TOKEN"))
    d = c.decide(macro, micro)          # macro [B, Fm] (or [Fm]), micro [B, K, H, Fu] (or [K, H, Fu])
    d.actions, d.q, d.version           # [B, D] int32, [B, D, n] float32, weight version
    c.feedback([("seg_a", "seg_b", 1.0)])   # a preferred to b (0.0: b preferred, 0.5: tie)

A refused request raises `ServiceError` with the server's status and message.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional
from urllib.parse import urlsplit

import msgpack
import numpy as np

from apex_bdq.serving import JSON, MSGPACK, pack_array


class ServiceError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


@dataclass
class Decision:
    actions: np.ndarray
    """[B, D] greedy sub-action per branch."""
    q: Optional[np.ndarray]
    """[B, D, n] Q-values, or None when not asked for."""
    version: int
    """Weight version of the policy that decided."""
    branches: list
    server_timing: dict
    """Server-Timing header (milliseconds by stage: parse, queue, model, encode, replica)."""


def _unpack(v: Any, dtype) -> np.ndarray:
    if isinstance(v, dict):  # a writable copy, in the documented dtype
        return np.frombuffer(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"]).astype(dtype)
    return np.asarray(v, dtype=dtype)


def parse_server_timing(header: Optional[str]) -> dict:
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            out[name] = float(rest[4:])
    return out


class DecisionClient:
    def __init__(self, url: str = "http://127.0.0.1:8000", token: Optional[str] = None, use_msgpack: bool = True,
                 timeout_s: float = 30.0) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"url must be http(s)://host[:port], got {url!r}")
        self.host, self.port, self.https = u.hostname, u.port or (443 if u.scheme == "https" else 80), u.scheme == "https"
        self.prefix = u.path.rstrip("/")
        self.token, self.use_msgpack, self.timeout_s = token, use_msgpack, timeout_s
        self._conn: Optional[http.client.HTTPConnection] = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self._conn = cls(self.host, self.port, timeout=self.timeout_s)
        return self._conn

    def request(self, method: str, path: str, body: Optional[bytes] = None, content_type: str = JSON,
                headers: Optional[dict] = None, retry: bool = True) -> tuple[int, dict, bytes]:
        h = {"Content-Type": content_type, **(headers or {})}
        for attempt in ((0, 1) if retry else (1,)):  # a kept-alive connection the server closed is reopened once
            conn = self._connection()
            try:
                conn.request(method, self.prefix + path, body=body, headers=h)
                r = conn.getresponse()
                return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt:
                    raise
            except BaseException:
                self.close()  # a half-used connection cannot carry the next request
                raise
        raise AssertionError("unreachable")

    @staticmethod
    def _decode(status: int, headers: dict, body: bytes) -> Any:
        ct = headers.get("content-type", "")
        try:
            doc = msgpack.unpackb(body, raw=False) if ct.startswith(MSGPACK) else (json.loads(body) if body else {})
        except ValueError:  # not from the app (e.g. the ingress before routes exist): say what came back
            raise ServiceError(status, body[:300].decode("utf-8", "replace")) from None
        if status >= 400:
            msg = doc.get("error") or doc.get("detail") if isinstance(doc, dict) else body[:200]
            raise ServiceError(status, str(msg))
        return doc

    def decide(self, macro, micro, include_q: bool = True) -> Decision:
        macro = np.asarray(macro, dtype=np.float32)
        micro = np.asarray(micro, dtype=np.float32)
        if self.use_msgpack:
            body = msgpack.packb({"macro": pack_array(macro), "micro": pack_array(micro), "include_q": include_q},
                                 use_bin_type=True)
            ct = MSGPACK
        else:
            body = json.dumps({"macro": macro.tolist(), "micro": micro.tolist(), "include_q": include_q}).encode()
            ct = JSON
        status, headers, raw = self.request("POST", "/v1/decide", body, ct)
        doc = self._decode(status, headers, raw)
        return Decision(actions=_unpack(doc["actions"], np.int32), q=_unpack(doc["q"], np.float32) if "q" in doc else None,
                        version=int(doc["version"]), branches=list(doc.get("branches", [])),
                        server_timing=parse_server_timing(headers.get("server-timing")))

    def feedback(self, pairs: Iterable, segments: Optional[list[dict]] = None) -> dict:
        """pairs: (a, b, label) tuples or {a, b, label} dicts; segments: optional inline
        segments {id, macro, micro, action, metrics} to add before ranking."""
        if not self.token:
            raise ValueError("feedback needs a token (DecisionClient(token=...))")
        ps = [p if isinstance(p, dict) else {"a": p[0], "b": p[1], "label": p[2] if len(p) > 2 else 1.0} for p in pairs]
        doc: dict = {"pairs": ps}
        if segments:
            doc["segments"] = [{k: (np.asarray(v).tolist() if k in ("macro", "micro", "action") else v)
                                for k, v in s.items()} for s in segments]
        status, headers, raw = self.request("POST", "/v1/feedback", json.dumps(doc).encode(), JSON,
                                            {"Authorization": f"Bearer {self.token}"},
                                            retry=False)  # not resent blindly: the server may have accepted it
        return self._decode(status, headers, raw)

    def healthz(self) -> dict:
        """{status, version}: no token needed."""
        return self._decode(*self.request("GET", "/healthz"))

    def status(self) -> dict:
        """The replica's details (policy source, swaps, last reload error, guard counts, limits);
        needs the token."""
        if not self.token:
            raise ValueError("status needs a token (DecisionClient(token=...))")
        return self._decode(*self.request("GET", "/v1/status", headers={"Authorization": f"Bearer {self.token}"}))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "DecisionClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
