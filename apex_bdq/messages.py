"""Every message that crosses a process boundary, as a typed dataclass (no Ray in here).

    RolloutActor ──TransitionBatch──► ReplayShard ──SampledBatch──► learner worker
    learner worker ──PriorityUpdate──► ReplayShard       (the RPC route; in place otherwise)
    learner rank 0 ──PublishedWeights──► WeightStore ──WeightPoll──► RolloutActor
    learner rank 0 ──LearnerReport──► WeightStore ──StoreStatus──► driver
    RolloutActor ──ActorStats──► driver;  ReplayShard ──ShardStats──► driver;
    PreferenceActor ──PreferenceStats──► driver
    driver ──LearnerLoopConfig──► Ray Train `train_loop_per_worker`

Arrays are numpy so that Ray's object store passes them without copies; a reader that
needs tensors asks for them (`SampledBatch.tensors`). `as_dict()` is for JSON output at the
edge of the system (result files, progress lines), never for passing between components.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

TRANSITION_FIELDS = ("macro", "micro", "action", "reward", "discount", "next_macro", "next_micro")
"""The replay's stored fields, in the order the storage allocates them."""


class _Message:
    def as_dict(self) -> dict:
        """Plain values for JSON at the system's edge (result files, progress lines)."""
        return dataclasses.asdict(self)


def _tensor(a):
    import torch
    with warnings.catch_warnings():  # arrays from the object store are read-only; consumers copy them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(a))


@dataclass
class TransitionBatch(_Message):
    """A chunk of n-step transitions from one rollout actor, with initial priorities.

    macro [M, Fm] f32, micro [M, K, H, Fu] f32, action [M, D] u8, reward [M] f32,
    discount [M] f32 (gamma^n, 0 at a terminal), next_macro, next_micro; priorities [M] f32
    (|TD| from the actor's network copy)."""

    macro: np.ndarray
    micro: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    next_macro: np.ndarray
    next_micro: np.ndarray
    priorities: np.ndarray
    actor_id: int = -1
    weight_version: int = -1  # the weights that acted
    env_steps: int = 0  # simulator ticks x shards behind this chunk

    def __len__(self) -> int:
        return len(self.reward)

    def tensors(self) -> dict:
        """The stored fields as CPU tensors (views of the arrays), keyed by field name."""
        return {k: _tensor(getattr(self, k)) for k in TRANSITION_FIELDS}


@dataclass
class SampledBatch(_Message):
    """A prioritized batch of B transitions from one replay shard.

    indices / generations [B] int64 identify the slots (a priority update for a slot
    overwritten since is ignored); weights [B] f32 are the importance weights; the fields
    are TransitionBatch's. On the shared-memory route the arrays are device tensors; on the
    RPC route numpy arrays."""

    indices: Any
    generations: Any
    weights: Any
    macro: Any
    micro: Any
    action: Any
    reward: Any
    discount: Any
    next_macro: Any
    next_micro: Any
    shard: int = -1

    def __len__(self) -> int:
        return len(self.weights)

    @classmethod
    def from_replay(cls, sample, shard: int = -1) -> "SampledBatch":
        """From `PrioritizedReplay.sample`'s tensors (kept as they are: no copy)."""
        return cls(indices=sample.indices, generations=sample.generations, weights=sample.weights, shard=shard,
                   **{k: sample.data[k] for k in TRANSITION_FIELDS})

    def numpy(self) -> "SampledBatch":
        """The same batch as host numpy arrays (what the RPC route sends)."""
        def host(x):
            return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
        return dataclasses.replace(self, **{f.name: host(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if f.name != "shard"})

    def rows(self, lo: int, hi: int) -> "SampledBatch":
        """Rows [lo, hi) (a learner rank's share of a group batch)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[lo:hi] for f in dataclasses.fields(self)
                                            if f.name != "shard"})

    def to_device(self, device) -> "SampledBatch":
        """The weights and fields as tensors on `device` (slot ids stay where they are: the
        shard that sampled them reads them). A copy to a GPU is issued without waiting, so
        the prefetch thread overlaps it with compute."""
        import torch

        def dev(x):
            return (x if isinstance(x, torch.Tensor) else _tensor(x)).to(device, non_blocking=True)
        return dataclasses.replace(self, weights=dev(self.weights),
                                   **{k: dev(getattr(self, k)) for k in TRANSITION_FIELDS})

    def fields(self) -> dict:
        """{field name: array}, what the TD loss reads."""
        return {k: getattr(self, k) for k in TRANSITION_FIELDS}

    def update(self, priorities) -> "PriorityUpdate":
        """The priority update for this batch's slots."""
        return PriorityUpdate(self.indices, self.generations, priorities, shard=self.shard)


@dataclass
class PriorityUpdate(_Message):
    """New priorities [B] for the slots (indices, generations) of a SampledBatch."""

    indices: Any
    generations: Any
    priorities: Any
    shard: int = -1


@dataclass
class PublishedWeights(_Message):
    """A version of the learner's weights. `ref` holds the object-store reference inside a
    list, so that Ray passes the reference instead of resolving it: a reader fetches the
    arrays only when it wants them (`ray.get(ref[0])`)."""

    version: int
    ref: list


@dataclass
class StoreMeta(_Message):
    """What a reader of the weight store needs besides the weights: the run's network config
    (a NetConfig), the names of its action branches and the policy's guard (an
    apex_bdq.guard.Guard; None: none)."""

    net: Any
    branches: tuple = ()
    guard: Any = None


@dataclass
class WeightPoll(_Message):
    """What an actor asks every K decisions, in one call: newer weights (None if it has the
    newest) and the run's stop flag."""

    weights: Optional[PublishedWeights]
    stop: bool


@dataclass
class LearnerReport(_Message):
    """The learner group's latest figures (rank 0), to the weight store and Ray Train."""

    updates: int = 0
    version: int = 0
    td_loss: float = float("nan")
    q_mean: float = float("nan")
    pref_loss: float = float("nan")
    pref_accuracy: float = float("nan")
    updates_per_s: float = 0.0
    learner_wait_share: float = 0.0
    sample_ms: float = float("nan")
    elapsed_s: float = 0.0
    route: str = ""  # shared-memory | object-store | fixed
    backend: str = ""
    rank: int = 0
    world_size: int = 1
    final: bool = False
    start_id: Optional[str] = None  # one per worker-group incarnation
    restored_from_updates: Optional[int] = None  # a restarted group's checkpoint
    replay_reattached: int = 0
    optimizer_resets: int = 0  # a resumed optimiser state that did not load (warned; started afresh)
    pid: int = 0
    node_id: str = ""


@dataclass
class StoreStatus(_Message):
    """The weight store's view: newest version, stop flag, the learner's last report and
    how many learner restarts (and updates lost to them) it has counted."""

    version: int = -1
    stop: bool = False
    learner: Optional[LearnerReport] = None
    published_at: float = 0.0
    learner_restarts: int = 0
    updates_lost: int = 0
    unavailable: bool = False  # the store did not answer (a driver-side placeholder)


@dataclass
class ActorStats(_Message):
    """A rollout actor's counters since it (this incarnation) started."""

    actor: int
    env_steps: int = 0
    decisions: int = 0
    transitions_sent: int = 0
    weight_version: int = -1
    backpressure_wait_s: float = 0.0
    segments_sent: int = 0
    overload_ticks: int = 0
    breached_windows: int = 0
    settled_windows: int = 0
    chunks_lost: int = 0
    transitions_lost: int = 0
    segments_lost: int = 0
    env_steps_per_s: float = 0.0
    epsilon_min: float = 0.0
    epsilon_max: float = 0.0
    episode_rewards: list = field(default_factory=list)
    pid: int = 0
    node_id: str = ""
    error: Optional[str] = None  # set by the driver for an actor whose run failed


@dataclass
class ShardStats(_Message):
    """A replay shard's counters since it (this incarnation) started."""

    shard: int
    size: int = 0
    capacity: int = 0
    inserted: int = 0
    sampled: int = 0
    env_steps: int = 0
    inserted_by_actor: dict = field(default_factory=dict)  # actor id -> transitions
    actor_versions: dict = field(default_factory=dict)  # actor id -> weight version of its last chunk
    insert_blocked_s: float = 0.0
    uptime_s: float = 0.0
    pid: int = 0
    node_id: str = ""
    device: str = "cpu"
    restarted: bool = False
    restored_size: int = 0
    snapshots: int = 0
    snapshot_s: float = 0.0


@dataclass
class PreferenceStats(_Message):
    """The preference actor's feedback counters."""

    pairs: int = 0
    heldout_pairs: int = 0
    oracle_ranked: int = 0
    unranked_segments: int = 0
    ranked_segments: int = 0
    refused: int = 0
    duplicates: int = 0
    replayed_pairs: int = 0
    log_path: str = ""
    pid: int = 0
    log_corrupt_records: int = 0  # skipped on replay (each warned about); the intact ones after them kept
    log_torn_bytes: int = 0  # a torn last record cut off on replay
    log_orphan_pairs: int = 0  # pairs replayed without their segments (lost to a corrupt record): left out


@dataclass
class LearnerLoopConfig:
    """What the driver hands each Ray Train worker (`train_loop_per_worker`).

    cfg is the run's TrainConfig (Ray Train pickles it into every worker); shards and
    specs are the replay shards' handles and their shared-memory specs; source, when set,
    replaces the replay route with a fixed list of SampledBatch (group batches: each rank
    takes its rows), for replaying recorded batches offline."""

    cfg: Any  # TrainConfig (not imported here: messages stay free of the config tree)
    backend: str = "ddp"
    shards: Optional[list] = None
    specs: Optional[list] = None
    shard_cfg: Any = None
    store: Any = None  # the WeightStore handle
    preference: Any = None  # the PreferenceActor handle (pref.enabled)
    minutes: Optional[float] = None  # None: cfg.minutes
    max_updates: Optional[int] = None
    publish_every: int = 50
    checkpoint_every_s: float = 60.0
    use_gpu: bool = False
    resume: Optional[dict] = None  # a checkpoint's contents
    torch_threads: int = 1
    prefetch: int = 2
    batches: Optional[list] = None  # fixed SampledBatch list instead of replay (see above)
