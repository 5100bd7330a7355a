import os
import sys
from pathlib import Path

# In-process tests share one local Ray without token authentication, set before anything
# imports Ray or `launch` (which would default it to token). Subprocesses that test the
# default (launch.serve, ray job submit) are given their own environment.
os.environ["RAY_AUTH_MODE"] = "disabled"
from typing import Optional

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


class ModuleCluster:
    """The local Ray cluster a test module shares (the `ray_local` fixture). `address` is the GCS
    address of the cluster it started: the driver must still be on that one after every test."""

    def __init__(self, **options):
        self.options = options
        self.address: Optional[str] = None

    def start(self) -> None:
        import ray
        os.environ["RAY_AUTH_MODE"] = "disabled"
        ray.init(address="local", include_dashboard=False, log_to_driver=False, **self.options)
        self.address = ray.get_runtime_context().gcs_address

    def stop(self) -> None:
        import ray
        self.address = None
        ray.shutdown()

    def problem(self) -> Optional[str]:
        """None while the driver is on this cluster, else what happened to it."""
        import ray
        if not ray.is_initialized():
            return "was shut down (ray.shutdown())"
        now = ray.get_runtime_context().gcs_address
        if now != self.address:
            return f"was replaced: the driver is on {now}, the module's cluster was {self.address}"
        return None

    def restore(self) -> None:
        import ray
        if ray.is_initialized():
            ray.shutdown()
        self.start()


_module_cluster: Optional[ModuleCluster] = None  # the live `ray_local` cluster, if any


@pytest.fixture(scope="module")
def ray_local_options():
    """ray.init options of the module's cluster: 8 logical CPUs and the placement resources of
    cluster.yaml. A module overrides this fixture (not `ray_local`) for another size."""
    return {"num_cpus": 8, "resources": {"rollout": 8, "learner": 8}}


@pytest.fixture(scope="module")
def ray_local(ray_local_options):
    """A local Ray cluster for one test module (see the README's notes on ray.shutdown() in
    tests). No test may shut it down: `_module_cluster_guard` fails a test that does (and
    starts the cluster again for the next ones); a test that needs a Ray of its own takes
    `own_ray_cluster`."""
    global _module_cluster
    import ray
    if ray.is_initialized():
        pytest.fail("a Ray driver is already initialised before this module's cluster starts: an earlier test "
                    "left it running (a test that starts its own Ray takes the `own_ray_cluster` fixture)")
    mc = ModuleCluster(**ray_local_options)
    mc.start()
    _module_cluster = mc
    try:
        yield ray
    finally:
        _module_cluster = None
        ray.shutdown()


@pytest.fixture(autouse=True)
def _module_cluster_guard(request):
    """While a module's cluster is up, every test starts and ends on it: without this, a test
    that calls ray.shutdown() leaves the following tests on whatever cluster launch.train or
    the next ray.remote() starts for itself (all CPUs, where Ray Train learners can wait for
    CPUs forever)."""
    mc = _module_cluster
    if mc is not None and (bad := mc.problem()):
        mc.restore()
        pytest.fail(f"the module's shared Ray cluster {bad} before {request.node.nodeid} started")
    was_up = _ray_initialized()
    yield
    if mc is None and not was_up and _ray_initialized() and "own_ray_cluster" not in request.fixturenames:
        import ray
        ray.shutdown()  # the next tests start clean; this one fails
        pytest.fail(f"{request.node.nodeid} started a Ray cluster as a side effect (e.g. ray.get_runtime_context() "
                    "outside Ray): it held Ray's ports and CPUs for the tests after it")
    if mc is not None and _module_cluster is mc and (bad := mc.problem()):
        mc.restore()  # the following tests run on the module's cluster again
        pytest.fail(f"{request.node.nodeid}: the module's shared Ray cluster {bad} during the test; a test "
                    "that needs a Ray of its own takes the `own_ray_cluster` fixture")


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # a test that never imported Ray started none
    return bool(ray is not None and ray.is_initialized())


@pytest.fixture
def own_ray_cluster():
    """For a test that starts a Ray of its own (a multi-node `Cluster`, a `ray start` head, an
    in-process Serve): the module's shared cluster, if one is up, is stopped for the test and
    started again after it; whatever Ray driver the test leaves initialised is shut down."""
    import ray
    mc = _module_cluster
    if mc is not None:
        mc.stop()
    try:
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if mc is not None:
            mc.start()


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
