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
    """Ray token authentication on unless the user chose otherwise (set before Ray starts or
    connects): `RAY_AUTH_MODE=token`. A local cluster that `ray.init` starts makes its own token
    (~/.ray/auth_token, unless RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH names one); a cluster
    started with `ray start` / `ray up` needs the same token on every node and every client
    (README, "Run on a cluster"). `RAY_AUTH_MODE=disabled` turns it off."""
    import os
    return os.environ.setdefault("RAY_AUTH_MODE", "token")
