"""The platform v2 observation, defined once: the simulator builds it from its own state and
`apex_bdq.telemetry` builds it from a live Prometheus; both call the functions here.

Inputs are raw platform quantities in platform units (requests, requests per second,
replicas, seconds, levels); `Scales` holds the normalisers a config implies, so a policy
sees the same numbers for the same platform state wherever the state came from.

  macro [S, F]  `macro_v2`: the global features (time of day / week, accounting-window phase,
                the admission level in force, whether the metrics store reaches back a day /
                a week), then per class its state (requests in flight, utilisation, replicas
                ready / booting / ready within half the provisioning delay / targeted, the
                plan and hold levels in force, whether the last accounting window broke the
                SLO), its coarse arrival-rate history (oldest first) and its rates a day and a
                week ago at the seasonal leads.
  micro [S, K, 2H, U]  one frame per tick, `micro_frame_v2`: arrivals this tick, backlog
                drain time, p99 latency (both in SLOs), refusals, replicas ready / booting,
                and the accounting window's error-budget burn so far.
Names are `platform_v2.macro_names(cfg)` and `MICRO_FEATURES_V2`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from apex_bdq.config import SimConfig

P99_Q = 0.01  # tail mass of the p99 (the SLO's 1 %)
BACKLOG_CAP = 10.0  # drain time and burn features are clipped at 10 SLOs / 10 budgets
TWO_PI = 2.0 * np.pi


class Scales:
    """Normalisers of a v2 config: per class its mean offered load (Erlangs), mean request
    rate, mean arrivals per tick, SLO, service rate; the number of sub-actions."""

    def __init__(self, cfg: SimConfig) -> None:
        f32 = np.float32
        svc = np.asarray(cfg.service_time_s, dtype=np.float64)
        self.K, self.n = cfg.num_classes, cfg.sub_actions
        self.mu = (1.0 / svc).astype(f32)  # [K] requests per second per replica
        self.slo = (np.asarray(cfg.slo_factor) * svc).astype(f32)  # [K] p99 target, seconds
        self.inv_slo = (1.0 / self.slo).astype(f32)
        self.class_load = (np.asarray(cfg.shares) * cfg.mean_load_erlangs).astype(f32)  # [K] Erlangs
        self.inv_class_load = (1.0 / self.class_load).astype(f32)
        self.class_rate = (self.class_load * self.mu).astype(f32)  # [K] mean requests per second
        self.inv_class_rate = (1.0 / self.class_rate).astype(f32)
        self.inv_mean_n = (1.0 / (self.class_rate * cfg.tick_s)).astype(f32)  # [K] arrivals per tick -> O(1)
        self.inv_n1 = 1.0 / (cfg.sub_actions - 1)


def macro_v2(out: np.ndarray, cls: np.ndarray, sc: Scales, *, tod, tow, window_phase, admission_level,
             ok_1d, ok_7d, in_flight, utilisation, ready, booting, booting_soon, target, plan_level,
             hold_level, last_violated, rate_blocks, rate_1d, rate_7d) -> np.ndarray:
    """Fill `out` [S, F] (and the scratch `cls` [S, K, per-class features]).

    tod, tow: [S] fraction of the day / week; window_phase [S] in [0, 1); admission_level,
    ok_1d, ok_7d [S]; in_flight (requests), utilisation, ready, booting, booting_soon,
    target (replicas), plan_level, hold_level (levels), last_violated (0/1) [S, K];
    rate_blocks [Hc, S, K] requests per second, oldest first; rate_1d, rate_7d [S, J, K]."""
    K = sc.K
    g = 8
    out[:, 0], out[:, 1] = np.sin(TWO_PI * tod), np.cos(TWO_PI * tod)
    out[:, 2], out[:, 3] = np.sin(TWO_PI * tow), np.cos(TWO_PI * tow)
    out[:, 4] = window_phase
    out[:, 5] = admission_level * sc.inv_n1
    out[:, 6], out[:, 7] = ok_1d, ok_7d
    inv_load = sc.inv_class_load
    cls[..., 0] = in_flight * inv_load
    cls[..., 1] = utilisation
    cls[..., 2] = ready * inv_load
    cls[..., 3] = booting * inv_load
    cls[..., 4] = booting_soon * inv_load
    cls[..., 5] = target * inv_load
    cls[..., 6] = plan_level * sc.inv_n1
    cls[..., 7] = hold_level * sc.inv_n1
    cls[..., 8] = last_violated
    m, Hc, J = 9, rate_blocks.shape[0], rate_1d.shape[1]
    cls[..., m:m + Hc] = (rate_blocks * sc.inv_class_rate).transpose(1, 2, 0)
    cls[..., m + Hc:m + Hc + J] = (rate_1d * sc.inv_class_rate).transpose(0, 2, 1)
    cls[..., m + Hc + J:] = (rate_7d * sc.inv_class_rate).transpose(0, 2, 1)
    out[:, g:] = cls.reshape(len(out), K * cls.shape[-1])
    return out


def drain_inv_rate(ready: np.ndarray, sc: Scales) -> np.ndarray:
    """[S, K] 1 / the rate `ready` replicas serve at (a pool with none: 1e9 s per request)."""
    with np.errstate(divide="ignore"):
        return 1.0 / np.maximum(ready * sc.mu, 1e-9)


def micro_frame_v2(out: np.ndarray, sc: Scales, *, arrivals, backlog, p99_s, refused, ready, booting,
                   win_late, win_req, inv_rate: Optional[np.ndarray] = None) -> np.ndarray:
    """Fill one micro frame `out` [S, K, U] from this tick's arrivals, backlog (requests
    queued), p99 latency (s), refusals, replicas ready / booting, and the accounting window's
    late and offered requests so far; `inv_rate`: `drain_inv_rate(ready)` when the caller
    has it."""
    if inv_rate is None:
        inv_rate = drain_inv_rate(ready, sc)
    out[..., 0] = arrivals * sc.inv_mean_n
    out[..., 1] = np.minimum(backlog * inv_rate * sc.inv_slo, BACKLOG_CAP)
    out[..., 2] = p99_s * sc.inv_slo
    out[..., 3] = refused * sc.inv_mean_n
    out[..., 4] = ready * sc.inv_class_load
    out[..., 5] = booting * sc.inv_class_load
    out[..., 6] = np.minimum(win_late / (np.maximum(win_req, 1.0) * P99_Q), BACKLOG_CAP)
    return out
