"""The one sizing function (apex_bdq.sizing) against the queueing model it inverts."""

import numpy as np
import pytest

from apex_bdq.sim.queueing import erlang_c
from apex_bdq.sizing import SizingTable, max_load_within_slo, replicas_for

SVC = np.array([0.06, 3.3057, 13.3921, 321.1498])
SLO = SVC * np.array([1.5, 2.0, 3.0, 4.0])


def p_late(c, rate, svc, slo):
    """P(wait > slo - svc) in the stationary M/M/c queue (exact), 1 when unstable."""
    a = rate * svc
    if a >= c:
        return 1.0
    return float(erlang_c(c, a) * np.exp(-(c - a) * (slo - svc) / svc))


@pytest.mark.parametrize("load", [0.3, 2.0, 11.7, 12.0, 48.0, 150.0])
def test_replicas_are_the_fewest_whose_stationary_p99_meets_the_slo(load):
    table = SizingTable.build(SVC, SLO, [400] * 4)
    rate = load / SVC
    c = replicas_for(rate[None], table)[0]
    for k in range(4):
        assert p_late(int(c[k]), rate[k], SVC[k], SLO[k]) <= 0.01 + 1e-9
        if c[k] > 1:
            assert p_late(int(c[k]) - 1, rate[k], SVC[k], SLO[k]) > 0.01
    # A tighter SLO (relative to the service time) needs more replicas at the same load.
    assert c[0] >= c[1] >= c[2] >= c[3] >= np.ceil(load)


def test_sizing_is_monotone_capped_and_rejects_bad_input():
    table = SizingTable.build(SVC[:1], SLO[:1], [50], min_replicas=2)
    rates = np.linspace(0.0, 2000.0, 400)[:, None]
    c = replicas_for(rates, table)[:, 0]
    assert (np.diff(c) >= 0).all() and c[0] == 2 and c[-1] == 50  # the floor, then the pool cap
    assert max_load_within_slo(np.array([10.0]), 1.0, 1.0, 0.01)[0] == 0.0  # no waiting budget: nothing fits
    with pytest.raises(ValueError, match="end in the class axis"):
        replicas_for(np.ones((3, 2)), table)
    with pytest.raises(ValueError, match="finite and >= 0"):
        replicas_for(np.array([[np.nan]]), table)
    with pytest.raises(ValueError, match="not above its mean service time"):
        SizingTable.build([1.0], [0.5], [10])
