"""Erlang-C formulas against closed forms and an event-driven queue simulation."""

import heapq

import numpy as np
import pytest

from apex_bdq.sim.queueing import ErlangCTable, erlang_c, wait_quantile


def test_erlang_c_closed_forms():
    # M/M/1: P(wait) = rho. M/M/2 at a = 1: C = 1/3.
    for rho in (0.1, 0.5, 0.9):
        assert erlang_c(1, rho) == pytest.approx(rho, rel=1e-9)
    assert erlang_c(2, 1.0) == pytest.approx(1.0 / 3.0, rel=1e-9)
    # Unstable queues: everyone waits.
    assert erlang_c(4, 4.0) == 1.0 and erlang_c(4, 7.0) == 1.0


def test_table_matches_exact_formula():
    rng = np.random.default_rng(0)
    table = ErlangCTable(256)
    c = rng.integers(0, 257, 50_000).astype(np.float32)
    rho = (rng.random(50_000) * 1.3).astype(np.float32)
    exact = erlang_c(np.maximum(c, 1), np.minimum(rho, 1.0) * np.maximum(c, 1))
    exact[c == 0] = 1.0
    assert np.abs(table(c, rho) - exact).max() < 5e-4


def simulate_fcfs_waits(c: int, lam: float, mu: float, n: int, seed: int) -> np.ndarray:
    """Event-driven FCFS M/M/c: each arrival takes the server that frees first."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / lam, n))
    services = rng.exponential(1.0 / mu, n)
    free_at = [0.0] * c  # heap of the times each server next becomes free
    waits = np.empty(n)
    for i in range(n):
        t = arrivals[i]
        f = heapq.heappop(free_at)
        start = t if t > f else f
        waits[i] = start - t
        heapq.heappush(free_at, start + services[i])
    return waits[n // 20:]  # drop the warm-up


@pytest.mark.parametrize("c,rho", [(4, 0.7), (8, 0.9)])
def test_p99_wait_matches_event_simulation(c, rho):
    mu = 1.0
    lam = rho * c * mu
    waits = simulate_fcfs_waits(c, lam, mu, n=1_000_000, seed=7)
    simulated = np.quantile(waits, 0.99)
    formula = float(wait_quantile(c, lam, mu, 0.99))
    assert formula == pytest.approx(simulated, rel=0.05)
    # P(wait > 0) is Erlang C as well.
    assert float(erlang_c(c, lam / mu)) == pytest.approx(np.mean(waits > 0), rel=0.05)
