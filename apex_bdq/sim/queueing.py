"""M/M/c queueing formulas, vectorised.

Erlang C, the probability that an arrival waits, is exact from the Poisson distribution:
B(c, a) = P(N = c) / P(N <= c) for N ~ Poisson(a) (Erlang B), then
C(c, a) = c B / (c - a (1 - B)). The waiting time tail is P(W > t) = C e^{-(c mu - lambda) t}.

The simulator steps thousands of queues per tick, so it reads C from a table over
(servers c, utilisation rho) built once with the exact formula and interpolated linearly in
rho (`ErlangCTable`); `erlang_c` is the exact reference the table and the tests use.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy import special


def erlang_c(c, a) -> np.ndarray:
    """Exact Erlang C for integer servers c >= 1 and offered load a = lambda/mu (Erlangs).

    Returns 1 where a >= c (the queue is unstable: every arrival waits).
    """
    c = np.asarray(c, dtype=np.float64)
    a = np.asarray(a, dtype=np.float64)
    c, a = np.broadcast_arrays(c, a)
    out = np.ones(c.shape)
    ok = (a < c) & (c >= 1)
    cc, aa = c[ok], a[ok]
    with np.errstate(divide="ignore", invalid="ignore", under="ignore"):
        log_pmf = cc * np.log(np.where(aa > 0, aa, 1.0)) - aa - special.gammaln(cc + 1.0)
        cdf = special.gammaincc(cc + 1.0, aa)  # P(N <= c)
        b = np.where(aa > 0, np.exp(log_pmf) / cdf, 0.0)
        ce = cc * b / (cc - aa * (1.0 - b))
    out[ok] = np.clip(np.nan_to_num(ce, nan=0.0), 0.0, 1.0)
    return out


def wait_quantile(c, lam, mu, q: float = 0.99) -> np.ndarray:
    """The q-quantile of the M/M/c waiting time (exact; inf when lam >= c mu)."""
    c = np.asarray(c, dtype=np.float64)
    lam = np.asarray(lam, dtype=np.float64)
    mu = np.asarray(mu, dtype=np.float64)
    pw = erlang_c(c, lam / mu)
    theta = c * mu - lam
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.log(np.maximum(pw, 1e-300) / (1.0 - q)) / theta
    return np.where(theta <= 0, np.inf, np.maximum(t, 0.0))


class ErlangCTable:
    """C(c, rho c) on a grid of c = 0..c_max and rho in [0, 1], linear in rho.

    The grid has `n_rho` intervals; C is smooth in rho, and at the default resolution the
    interpolation error is below 5e-4 absolute (the float32 position costs up to 1/64 of a
    grid step at c ~ 256; tests check it against `erlang_c`), ~0.2 % on the p99 wait; the
    table stays small enough (0.5 MB) to live in cache.
    """

    def __init__(self, c_max: int, n_rho: int = 512) -> None:
        self.c_max = int(c_max)
        self.n_rho = int(n_rho)
        self.table = _table(self.c_max, self.n_rho)  # [c_max + 1, n_rho + 2] float32
        # Value and slope side by side, so one gather fetches both.
        flat = self.table.reshape(-1)
        self.pairs = (flat + 1j * np.append(np.diff(flat), 0.0)).astype(np.complex64)

    def __call__(self, c: np.ndarray, rho: np.ndarray) -> np.ndarray:
        """Erlang C for integer servers `c` in [0, c_max] (float or int array) at utilisation
        `rho` >= 0 (same shape). c = 0 or rho >= 1 give 1 (every arrival waits)."""
        # Position in the flattened table, in one float: row c, column rho * n_rho.
        pos = c * np.float32(self.n_rho + 2) + np.minimum(rho, 1.0) * np.float32(self.n_rho)
        i = pos.astype(np.int32)
        pair = self.pairs[i]  # (C at the grid point, step to the next one)
        return pair.real + (pos - i) * pair.imag


@functools.lru_cache(maxsize=4)
def _table(c_max: int, n_rho: int) -> np.ndarray:
    rho = np.arange(n_rho + 2, dtype=np.float64) / n_rho  # one spare column for i + 1
    c = np.arange(c_max + 1, dtype=np.float64)[:, None]
    tab = erlang_c(np.maximum(c, 1.0), np.minimum(rho, 1.0)[None, :] * np.maximum(c, 1.0))
    tab[0, :] = 1.0
    tab[:, n_rho:] = 1.0
    return tab.astype(np.float32)
