"""`python -m launch.bench scaler`: the KEDA scaler's decision latency on a live Prometheus.

One decision = what KEDA's GetMetrics costs when the newest decision is a sync period old:
the Prometheus queries (concurrent, over HTTP), the observation built from them, the policy's
forward pass and the guard, and the gRPC answer. Measured end to end at the client (a real
gRPC client built from KEDA's proto) against the trace replay platform scraped by a real
Prometheus, the platform stepped one tick between decisions; the stages from the
controller's own clock. The cached answer (the other classes' GetMetrics in the same period)
is timed beside it. Reported as p50 / p99 and as the share of HPA's 15-s sync period.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import numpy as np

HPA_SYNC_S = 15.0


def _pct(x, q) -> float:
    return float(np.percentile(np.asarray(x) * 1e3, q))


def bench_scaler(decisions: int = 200, checkpoint: Optional[str] = None) -> dict:
    from apex_bdq.config import NetConfig, SimConfig
    from apex_bdq.control import ControlConfig, Controller
    from apex_bdq.keda_scaler import KedaHpa, ScalerServer
    from apex_bdq.replay_platform import ReplayLoop, ReplayPlatform
    from apex_bdq.serving import Policy, policy_from_checkpoint
    from apex_bdq.telemetry import TelemetryConfig, TelemetryReader
    if checkpoint is None and Path("runs/train/checkpoint.pt").is_file():
        checkpoint = "runs/train/checkpoint.pt"
    if checkpoint:
        from apex_bdq.checkpoint import load_checkpoint, train_config_of
        policy = policy_from_checkpoint(checkpoint)
        cfg = train_config_of(load_checkpoint(checkpoint), checkpoint).sim
        source = checkpoint
    else:  # the forward pass costs the same with any weights
        from apex_bdq.networks import BDQNetwork
        cfg = SimConfig()
        policy = Policy(BDQNetwork(NetConfig.for_sim(cfg)).eval(), 0, "random")
        source = "random weights (no checkpoint)"
    warm = 150
    p = ReplayPlatform(cfg, seed=0)
    e2e, cached, query, policy_s, macro_err, micro_err, fc_err = [], [], [], [], [], [], []
    from apex_bdq.sim.baselines import Predictive
    forecaster = Predictive()  # the simulator's forecast, to compare the reader's with
    forecaster.reset(p.sim)
    from apex_bdq.sim.platform_v2 import MICRO_FEATURES_V2, macro_names
    # coarse blocks that end before the replay: the trace's mean over the block (backfilled
    # history) vs the simulator's sample at its middle; excluded from the comparison
    names = macro_names(cfg)
    # the plan / hold / admission levels are the controller's own state, not telemetry (the
    # platform here runs its default setting while the policy decides): not compared
    levels = np.array([n.startswith(("plan_level", "hold_level", "admission_level")) for n in names])
    block_of = np.array([int(n.split("rate_block_")[1].split("[")[0]) if "rate_block_" in n else -1 for n in names])
    with ReplayLoop(p, horizon_ticks=warm + decisions + 10) as loop:
        reader = TelemetryReader(TelemetryConfig(url=loop.url, classes=tuple(p.classes),
                                                 deployments=tuple(f"{p.service}-{c}" for c in p.classes),
                                                 selector=f'service="{p.service}"',
                                                 clock_offset_s=p.clock_offset_s, stale_s=10.0), cfg)
        last = {}

        def read(t, levels):
            last["r"] = r = reader.read(t, levels)
            return r
        ctl = Controller(cfg, policy, ControlConfig(mode="control", sync_s=1.0), read=read, classes=p.classes,
                         clock=lambda: p.now)
        server = ScalerServer(ctl, loop=False)
        keda = KedaHpa(f"127.0.0.1:{server.port}", p.classes)
        pb, stub = keda.pb, keda.stub
        try:
            for _ in range(warm):
                loop.step()
            reqs = [pb.GetMetricsRequest(scaledObjectRef=r, metricName=s.metricName)
                    for r, s in zip(keda.refs, keda.specs)]
            for i in range(decisions):
                loop.step()
                t = time.perf_counter()
                stub.GetMetrics(reqs[0])  # a period old: decides
                e2e.append(time.perf_counter() - t)
                d = ctl.last
                if d.fallback is not None:
                    raise RuntimeError(f"decision {i} fell back ({d.fallback}): {d.problems[:3]}")
                query.append(d.query_s)
                # the reader's observation against the simulator's own for the same tick
                ro, so = last["r"].obs, p.obs
                live_blocks = (p.now - p.T0) // int(cfg.coarse_block_s)  # blocks closed since the replay began
                before = (block_of >= 0) & (block_of < cfg.coarse_history - live_blocks)
                macro_err.append(np.abs(ro.macro[0] - so.macro[0])[~(before | levels)])
                micro_err.append(np.abs(ro.micro[0] - so.micro[0]).reshape(-1, so.micro.shape[-1]))
                fc = forecaster.forecast(p.sim)[0]
                fc_err.append((np.abs(last["r"].forecast - fc) / fc)[fc > 0])  # classes with a forecast
                policy_s.append(d.decide_s - d.query_s)
                t = time.perf_counter()
                for r in reqs[1:]:
                    stub.GetMetrics(r)  # same period: the cached decision
                cached.append((time.perf_counter() - t) / max(1, len(reqs) - 1))
        finally:
            keda.close()
            server.stop()
            reader.close()
    me, ue = np.concatenate(macro_err), np.concatenate(micro_err)
    p99i = MICRO_FEATURES_V2.index("p99_over_slo")
    other = [i for i in range(ue.shape[1]) if i != p99i]
    return {"decisions": decisions,
            "reader_macro_abs_err_max": float(me.max()), "reader_macro_abs_err_p99": float(np.percentile(me, 99)),
            "reader_micro_abs_err_max_exact_features": float(ue[:, other].max()),
            "reader_p99_over_slo_abs_err_median": float(np.median(ue[:, p99i])),
            "reader_p99_over_slo_abs_err_p99": float(np.percentile(ue[:, p99i], 99)), "policy": source, "classes": len(p.classes),
            "queries_per_decision": len(reader.queries(p.now)),
            "reader_forecast_rel_err_median": float(np.median(np.concatenate(fc_err))),
            "reader_forecast_rel_err_max": float(np.max(np.concatenate(fc_err))),
            "guard_floor_raised": int(ctl.counts["floor"]), "class_decisions": decisions * len(p.classes),
            "decision_ms_p50": _pct(e2e, 50), "decision_ms_p99": _pct(e2e, 99),
            "reading_ms_p50": _pct(query, 50), "reading_ms_p99": _pct(query, 99),
            "policy_guard_ms_p50": _pct(policy_s, 50), "policy_guard_ms_p99": _pct(policy_s, 99),
            "answer_ms_p50": _pct(np.subtract(e2e, np.add(query, policy_s)), 50),
            "answer_ms_p99": _pct(np.subtract(e2e, np.add(query, policy_s)), 99),
            "cached_answer_ms_p50": _pct(cached, 50), "cached_answer_ms_p99": _pct(cached, 99),
            "hpa_sync_share_p99": _pct(e2e, 99) / 1e3 / HPA_SYNC_S}


def print_scaler(r: dict) -> None:
    print(f"KEDA scaler decision latency, {r['decisions']} decisions on a live Prometheus "
          f"({r['queries_per_decision']} PromQL queries each, {r['classes']} classes; policy: {r['policy']})")
    print(f"{'stage':34s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for key, label in (("reading", "Prometheus queries + features"), ("policy_guard", "policy forward + guard + sizing"),
                       ("answer", "gRPC answer (rest of end to end)"), ("decision", "GetMetrics end to end"),
                       ("cached_answer", "GetMetrics, decision cached")):
        print(f"{label:34s} {r[key + '_ms_p50']:8.2f} {r[key + '_ms_p99']:8.2f}")
    print(f"p99 end to end = {r['hpa_sync_share_p99']:.2%} of HPA's 15-s sync period")
    print(f"reader vs the simulator's own observation (normalised features): macro |err| max "
          f"{r['reader_macro_abs_err_max']:.4f} (p99 {r['reader_macro_abs_err_p99']:.4f}); micro max "
          f"{r['reader_micro_abs_err_max_exact_features']:.2e} except p99/SLO from the histogram: median "
          f"{r['reader_p99_over_slo_abs_err_median']:.3f}, p99 {r['reader_p99_over_slo_abs_err_p99']:.3f}")
    print(f"the predictive rule's forecast from Prometheus vs the simulator's: relative error median "
          f"{r['reader_forecast_rel_err_median']:.2%}, max {r['reader_forecast_rel_err_max']:.2%}; the guard's floor "
          f"raised {r['guard_floor_raised']} of {r['class_decisions']} class-decisions")
