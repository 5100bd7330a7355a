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
