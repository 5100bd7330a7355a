"""Ray dashboard / Prometheus metrics of a training run (`ray.util.metrics`).

Names are an interface (dashboards and alerts read them); Prometheus sees them prefixed
with `ray_`, counters with a `_total` suffix. Each process records what it owns:
rollout actors the env steps, replay shards inserts and size, learner rank 0 the updates,
samples, sample latency, TD loss and mean Q (and the preference loss and accuracy), the
weight store the version lag and actor count (set by the driver), the preference actor its
pair count.
"""

from __future__ import annotations

import functools
from typing import Optional

ENV_STEPS = "apex_env_steps"  # counter: simulator shard-ticks
ENV_STEPS_PER_S = "apex_env_steps_per_s"  # gauge, per actor
TRANSITIONS_INSERTED = "apex_transitions_inserted"  # counter, per replay shard
TRANSITIONS_SAMPLED = "apex_transitions_sampled"  # counter, learner
REPLAY_SIZE = "apex_replay_size"  # gauge, per replay shard
SAMPLE_LATENCY_MS = "apex_sample_latency_ms"  # gauge: time to draw one batch (prefetch thread)
LEARNER_UPDATES = "apex_learner_updates"  # counter
LEARNER_UPDATES_PER_S = "apex_learner_updates_per_s"  # gauge
TD_LOSS = "apex_td_loss"  # gauge
MEAN_Q = "apex_mean_q"  # gauge
WEIGHT_VERSION_LAG = "apex_weight_version_lag"  # gauge: learner updates - oldest version acting
ACTOR_COUNT = "apex_actor_count"  # gauge: rollout actors alive
PREF_LOSS = "apex_pref_loss"  # gauge: Bradley-Terry loss of the latest preference batch (learner)
PREF_ACCURACY = "apex_pref_accuracy"  # gauge: share of that batch's strict pairs the head ranks right
FEEDBACK_PAIRS = "apex_feedback_pairs"  # gauge: ranked pairs held by the preference actor
PREFERENCE = (PREF_LOSS, PREF_ACCURACY, FEEDBACK_PAIRS)  # only in runs with pref.enabled
ALL = (ENV_STEPS, ENV_STEPS_PER_S, TRANSITIONS_INSERTED, TRANSITIONS_SAMPLED, REPLAY_SIZE, SAMPLE_LATENCY_MS,
       LEARNER_UPDATES, LEARNER_UPDATES_PER_S, TD_LOSS, MEAN_Q, WEIGHT_VERSION_LAG, ACTOR_COUNT)

_COUNTERS = {ENV_STEPS, TRANSITIONS_INSERTED, TRANSITIONS_SAMPLED, LEARNER_UPDATES}
_DESCRIPTIONS = {
    ENV_STEPS: "simulated shard-ticks stepped by rollout actors",
    ENV_STEPS_PER_S: "simulated shard-ticks per second of one rollout actor",
    TRANSITIONS_INSERTED: "n-step transitions inserted into a replay shard",
    TRANSITIONS_SAMPLED: "transitions sampled by the learner",
    REPLAY_SIZE: "transitions held by a replay shard",
    SAMPLE_LATENCY_MS: "milliseconds to sample one learner batch",
    LEARNER_UPDATES: "learner gradient updates",
    LEARNER_UPDATES_PER_S: "learner gradient updates per second",
    TD_LOSS: "latest TD loss",
    MEAN_Q: "mean Q of the sampled actions in the latest batch",
    WEIGHT_VERSION_LAG: "learner updates made since the weights the oldest-acting actor uses",
    ACTOR_COUNT: "rollout actors alive",
    PREF_LOSS: "Bradley-Terry loss of the latest preference batch",
    PREF_ACCURACY: "share of the latest preference batch's pairs the preference head ranks as labelled",
    FEEDBACK_PAIRS: "ranked feedback pairs held (durably logged) by the preference actor",
}
_TAGS = ("component", "id")


@functools.lru_cache(maxsize=None)
def _metric(name: str):
    from ray.util import metrics
    if name in _COUNTERS:
        return metrics.Counter(name, description=_DESCRIPTIONS[name], tag_keys=_TAGS)
    return metrics.Gauge(name, description=_DESCRIPTIONS[name], tag_keys=_TAGS)


def record(name: str, value: float, component: str, id: Optional[int | str] = 0) -> None:
    """Add to a counter or set a gauge. Never raises: metrics must not stop training."""
    try:
        m = _metric(name)
        tags = {"component": component, "id": str(id)}
        if name in _COUNTERS:
            if value > 0:
                m.inc(float(value), tags=tags)
        else:
            m.set(float(value), tags=tags)
    except Exception:
        pass
