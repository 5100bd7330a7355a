"""Small Ray helpers shared by the driver and the learner."""

from __future__ import annotations


def answers(refs: list, timeout_s: float) -> list:
    """ray.get of each ref (None entries allowed), waiting at most timeout_s for all of them
    together; None for a ref whose actor is dead, restarting or silent."""
    import ray
    live = [r for r in refs if r is not None]
    done = set(ray.wait(live, num_returns=len(live), timeout=timeout_s)[0]) if live else set()
    out = []
    for r in refs:
        try:
            out.append(ray.get(r) if r is not None and r in done else None)
        except ray.exceptions.RayActorError:
            out.append(None)
    return out


def ray_auth_default() -> str:
    """Ray token authentication on unless the user chose otherwise: `RAY_AUTH_MODE=token`,
    set for every `python -m launch.*` entry point (launch/__init__.py) before Ray is imported
    (Ray reads it once, at import: set later, the driver and the cluster it starts would
    disagree). A local cluster that `ray.init` starts makes its own token (~/.ray/auth_token,
    unless RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH names one); a cluster started with `ray start`
    / `ray up` needs the same token on every node and every client (README, "Run on a
    cluster"). `RAY_AUTH_MODE=disabled` turns it off. Returns the mode in effect ("" when
    Ray was imported before and the environment does not say)."""
    import os
    import sys
    if "ray" in sys.modules:
        return os.environ.get("RAY_AUTH_MODE", "")
    return os.environ.setdefault("RAY_AUTH_MODE", "token")
