"""WeightStore: the learner's rank 0 publishes versioned weights, actors pull the newest.

The weights themselves stay in Ray's object store (the store keeps a reference inside a
list, so it never copies them); an actor asks `get_if_newer(its version)` and fetches the
object only when there is a newer one. The store also carries the run's stop flag and the
learner's latest metrics, so the driver and actors have one place to look.
"""

from __future__ import annotations

import time
from typing import Optional

from apex_bdq.messages import LearnerReport, PublishedWeights, StoreMeta, StoreStatus, WeightPoll


WEIGHT_STORE_NAME = "apex_bdq_weights"
"""A distributed run registers its store under this name (Ray namespace "apex_bdq"), so
`launch.serve --follow` finds it."""


class WeightStore:
    def __init__(self, meta: Optional[StoreMeta] = None) -> None:
        if meta is not None and not isinstance(meta, StoreMeta):
            raise TypeError(f"a weight store's meta is a StoreMeta, got {type(meta).__name__}")
        self._meta = meta
        self.version = -1
        self._ref: list = []
        self.stop = False
        self.learner: Optional[LearnerReport] = None
        self.published_at = 0.0
        self.learner_restarts = 0
        self._deadline = None
        self.updates_lost = 0
        self.max_updates_seen = 0
        self._starts: set = set()

    def put(self, version: int, state: dict) -> int:
        """Publish weights (a dict of numpy arrays). The store re-puts them itself so that it
        owns the object: weights outlive the learner worker that sent them (a finished or
        restarted learner must not take the actors' weights with it)."""
        if version <= self.version:
            return self.version  # an older publication arriving late never replaces a newer one
        import numpy as np
        import ray
        own = {k: np.array(v, copy=True) for k, v in state.items()}
        self.version, self._ref, self.published_at = int(version), [ray.put(own)], time.time()
        return self.version

    def get_if_newer(self, version: int) -> Optional[PublishedWeights]:
        return PublishedWeights(self.version, self._ref) if self.version > version else None

    def poll(self, version: int) -> WeightPoll:
        """What an actor asks every K decisions, in one call: newer weights and the stop flag."""
        return WeightPoll(weights=self.get_if_newer(version), stop=self.stop)

    def meta(self) -> Optional[StoreMeta]:
        """What a reader needs besides the weights: the run's network config and branches."""
        return self._meta

    def deadline(self, proposed: float) -> float:
        """The learner group's end time: the first group to ask sets it, a restarted one gets
        the same (so a restart does not extend the run)."""
        if self._deadline is None:
            self._deadline = float(proposed)
        return self._deadline

    def get_version(self) -> int:
        return self.version

    def set_stop(self, stop: bool = True) -> None:
        self.stop = bool(stop)

    def should_stop(self) -> bool:
        return self.stop

    def report(self, report: LearnerReport) -> None:
        """The learner's latest figures. A report from a restarted learner group (new
        start_id, restored from a checkpoint) counts a learner restart and the updates it
        lost (those past the checkpoint it came back from)."""
        if not isinstance(report, LearnerReport):
            raise TypeError(f"weight store: expected a LearnerReport, got {type(report).__name__}")
        sid = report.start_id
        if sid is not None and sid not in self._starts and report.restored_from_updates is not None:
            self.learner_restarts += 1
            self.updates_lost += max(0, self.max_updates_seen - int(report.restored_from_updates))
        if sid is not None:
            self._starts.add(sid)
        self.max_updates_seen = max(self.max_updates_seen, int(report.updates))
        self.learner = report

    def record_driver_metrics(self, version_lag: float, actors: int) -> None:
        from apex_bdq import metrics as M
        M.record(M.WEIGHT_VERSION_LAG, version_lag, "driver")
        M.record(M.ACTOR_COUNT, actors, "driver")

    def status(self) -> StoreStatus:
        return StoreStatus(version=self.version, stop=self.stop, learner=self.learner, published_at=self.published_at,
                           learner_restarts=self.learner_restarts, updates_lost=self.updates_lost)


def remote_store_class(max_restarts: int = 0):
    import ray
    return ray.remote(num_cpus=0, max_restarts=max_restarts)(WeightStore)


def state_to_numpy(module) -> dict:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_numpy_state(module, state: dict) -> None:
    import torch
    module.load_state_dict({k: torch.tensor(v) for k, v in state.items()})  # copies: arrays from the object store are read-only
