"""How well can the preference head rank pairs of a feedback log? (`python -m launch.bench
preference-fit --log LOG [--checkpoint CK]`)

Trains a fresh preference head (and the encoders, as the learner does) on a feedback log's
training pairs alone, with the learner's own preference-only update, and measures ranking
accuracy as it goes on

- the log's held-out pairs, against the labels given and against the oracle's rule (its
  weights and tie margin from `pref.*`, no random answers);
- random pairs of the held-out pairs' segments (segments in no training pair) labelled by
  that rule: thousands of pairs, so the figure is precise to ~0.01.

With `--dense N` the head is trained instead on N random pairs of the training segments,
labelled by the rule without random answers: how far the head and representation get with
far more, perfectly labelled feedback on the same segments -- the practical ceiling for the
accuracy a few hundred noisy pairs can reach.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from apex_bdq.checkpoint import load_checkpoint, net_config_of
from apex_bdq.config import AgentConfig, NetConfig, PreferenceConfig
from apex_bdq.preference import PreferenceBatch, load_log, oracle_label, random_pairs
from learner.learner import Learner, ranking_accuracy


def _random_pairs(ids: list, segs: dict, n: int, rule, rng: np.random.Generator) -> list:
    return [dataclasses.replace(p, label=rule(segs[p.a], segs[p.b])) for p in random_pairs(ids, n, rng)]


def bench_preference_fit(log: str, checkpoint: Optional[str] = None, steps: int = 1800, dense: int = 0,
                         batch_pairs: int = 16, lr: float = 3e-4, random_count: int = 3000, seed: int = 0,
                         pref: Optional[PreferenceConfig] = None, evals: int = 4) -> dict:
    pref = pref or PreferenceConfig()
    meta, segs, pairs = load_log(log)
    if meta is None:
        raise SystemExit(f"{log}: not a feedback log (no meta record)")
    train = [p for p in pairs if not p.heldout]
    held = [p for p in pairs if p.heldout]
    if not train or not held:
        raise SystemExit(f"{log}: needs training and held-out pairs (has {len(train)} / {len(held)}); "
                         "a benchmark run keeps every 5th oracle pair out (`launch.bench preference`)")
    rng = np.random.default_rng(seed)

    def rule(a, b) -> float:
        return oracle_label(a, b, pref.oracle_weights, 0.0, rng, tie_margin=pref.oracle_tie_margin)

    if checkpoint:
        ck = load_checkpoint(checkpoint)
        net_cfg = net_config_of(ck)
        shapes = {k: getattr(net_cfg, k) for k in NetConfig.SHAPE_FIELDS}
        if shapes != dict(meta["net"]):
            raise SystemExit(f"{checkpoint}: network shaped {shapes}, the log's segments fit {dict(meta['net'])}")
    else:
        ck, net_cfg = None, NetConfig(**dict(meta["net"]))
    net_cfg = dataclasses.replace(net_cfg, preference_ensemble=max(net_cfg.preference_ensemble, 3))
    torch.manual_seed(seed)
    learner = Learner(net_cfg, AgentConfig(lr=lr), seed=seed, pref_beta=1.0)
    if ck is not None:  # the trained encoders; the preference head starts fresh
        sd = {k: v for k, v in ck["learner"]["net"].items() if not k.startswith("pref.")}
        learner.net.load_state_dict({**learner.net.state_dict(), **sd})
    if dense:
        tids = sorted({i for p in train for i in (p.a, p.b)})
        fit = _random_pairs(tids, segs, dense, rule, rng)
    else:
        fit = train
    held_given = [p for p in held if p.label != 0.5]  # counted for the report
    held_rule = [q for q in (dataclasses.replace(p, label=rule(segs[p.a], segs[p.b])) for p in held) if q.label != 0.5]
    hids = sorted({i for p in held for i in (p.a, p.b)})
    rand = [p for p in _random_pairs(hids, segs, random_count, rule, np.random.default_rng(seed + 1))
            if p.label != 0.5]
    dev = learner.device

    def acc(ps: list) -> float:
        return ranking_accuracy(learner.net.utilities, ps, segs, dev)

    at = sorted({max(1, round(steps * (i + 1) / evals)) for i in range(evals)})
    curve = []
    for s in range(1, steps + 1):
        idx = rng.integers(0, len(fit), size=batch_pairs)
        learner.step(None, PreferenceBatch.from_pairs([fit[i] for i in idx], segs))
        if s in at:
            curve.append({"step": s, "heldout_accuracy": acc(held_given), "heldout_accuracy_noise_free": acc(held_rule),
                          "random_accuracy_noise_free": acc(rand)})
    res = {"log": log, "checkpoint": checkpoint, "training_pairs": len(fit), "dense": dense,
           "log_training_pairs": len(train), "heldout_pairs_strict": len(held_given),
           "heldout_pairs_strict_rule": len(held_rule), "random_pairs": len(rand), "heldout_segments": len(hids),
           "curve": curve, "final": curve[-1]}
    print(f"{log}: fitting {len(fit)} {'rule-labelled random' if dense else 'training'} pairs "
          f"({len(train)} in the log), {steps} preference-only steps of {batch_pairs} pairs")
    print(f"{'step':>6}{'held-out (labels)':>19}{'held-out (rule)':>17}{'random (rule)':>15}")
    for r in curve:
        print(f"{r['step']:>6}{r['heldout_accuracy']:>19.3f}{r['heldout_accuracy_noise_free']:>17.3f}"
              f"{r['random_accuracy_noise_free']:>15.3f}")
    print(f"held-out: {len(held_given)} strict pairs as labelled, {len(held_rule)} under the rule; "
          f"random: {len(rand)} strict pairs of {len(hids)} held-out segments")
    return res
