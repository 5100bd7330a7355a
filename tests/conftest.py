import os
from pathlib import Path

import numpy as np
import pytest

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture
def step_trace(tmp_path):
    """A synthetic 1 s trace: constant rate, then a step up at `at` (rates per class)."""

    def make(low=(100.0, 2.0, 0.5, 0.02), high=None, at=10_000, n=20_000, name="step_1s.csv"):
        high = high or low
        p = tmp_path / name
        rows = ["second," + ",".join(f"c{k}" for k in range(len(low)))]
        for t in range(n):
            r = low if t < at else high
            rows.append(f"{t}," + ",".join(repr(float(x)) for x in r))
        p.write_text("\n".join(rows) + "\n")
        return p

    return make


def random_actions(rng: np.random.Generator, S: int, D: int, n: int) -> np.ndarray:
    return rng.integers(0, n, size=(S, D))


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray cluster for one test module (8 logical CPUs, the placement resources of
    cluster.yaml). One per module: see the README's notes on ray.shutdown() in tests."""
    import ray
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=8, resources={"rollout": 8, "learner": 8}, include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True, scope="session")
def _yardstick_cache(tmp_path_factory):
    """The rules' frontiers are cached per platform and trace: tests keep theirs apart from
    the user's (~/.cache/apex-bdq), in one folder for the session."""
    old = os.environ.get("APEX_BDQ_CACHE")
    os.environ["APEX_BDQ_CACHE"] = str(tmp_path_factory.mktemp("apex_bdq_cache"))
    yield
    if old is None:
        os.environ.pop("APEX_BDQ_CACHE", None)
    else:
        os.environ["APEX_BDQ_CACHE"] = old


@pytest.fixture
def daily_trace(tmp_path):
    """A synthetic 1-min trace of `days` days: a daily cycle (peak/trough 3) plus bursts."""

    def make(days=2, name="daily_1min.csv", seed=0):
        rng = np.random.default_rng(seed)
        n = days * 1440
        m = np.arange(n)
        base = 100.0 * (2.0 - np.cos(2 * np.pi * m / 1440.0))  # 100..300 per minute
        bursts = np.where(rng.random(n) < 0.01, rng.uniform(1.5, 3.0, n), 1.0)
        rate = base * np.convolve(bursts, np.ones(5) / 5, mode="same")
        p = tmp_path / name
        p.write_text("minute,requests\n" + "\n".join(f"{i},{r:.2f}" for i, r in enumerate(rate)) + "\n")
        return p

    return make
