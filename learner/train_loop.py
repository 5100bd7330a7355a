"""The learner group: `train_loop_per_worker` for a Ray Train `TorchTrainer`.

Each worker
- attaches to the replay shards on its own node through shared memory (CPU) or CUDA IPC
  (one GPU) and samples and updates priorities in place (`LocalShardSource`); shards on
  other nodes are reached by RPC through the object store (`RemoteShardSource`), the slow
  route, used only when no shard shares the worker's node;
- prefetches the next batch on a thread while the current one trains (sampling overlapped
  with compute), honouring the shards' rate limiter;
- runs the BDQ double-Q n-step TD loss (`apex_bdq.losses`) through the chosen backend
  (DDP / DeepSpeed ZeRO-2 / Accelerate), each worker on batch_size / world_size rows, so
  the group's step equals one learner's step on the whole batch;
- writes new priorities back to the shard it sampled from.
Rank 0 publishes versioned weights to the weight store, reports metrics, and checkpoints
through Ray Train (the same file format as `launch.train --local`, so
`launch.evaluate --policy checkpoint:PATH` reads both).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Optional

import torch

from apex_bdq.checkpoint import config_to_dict, save_checkpoint
from apex_bdq.config import TrainConfig
from apex_bdq.messages import LearnerLoopConfig, LearnerReport, PriorityUpdate, SampledBatch
from apex_bdq.ray_util import answers
from apex_bdq.system import make_components
from learner.learner import StepResult
from replay_server.rate_limiter import RateLimiter
from replay_server.replay import PrioritizedReplay

CHECKPOINT_NAME = "checkpoint.pt"


class LocalShardSource:
    """Samples from replay shards attached in place (same node), rotating over them."""

    route = "shared-memory"

    def __init__(self, specs: list, capacity: int, fields: dict, limiter: RateLimiter, alpha: float, beta0: float,
                 beta_steps: int, seed: int, handles: Optional[list] = None, probe_every_s: float = 1.0,
                 unanswered_s: float = 2.0) -> None:
        """handles: the shards' actor handles. With them, each shard is probed every
        probe_every_s: one that does not answer within unanswered_s (dead, restarting) is
        skipped, and one that comes back in a new process (a restart: new shared memory) is
        attached again, so training goes on from the other shards meanwhile."""
        self._attach_args = dict(capacity=capacity, fields=fields, alpha=alpha, beta0=beta0, beta_steps=beta_steps)
        self.seed = seed
        self.specs = list(specs)  # None: a shard that did not answer yet (attached once it does)
        self.replays = [self._attach(i, s) if s is not None else None for i, s in enumerate(specs)]
        self.limiter = limiter
        self.i = 0
        self.handles = handles
        self.probe_every_s, self.unanswered_s = probe_every_s, unanswered_s
        self.alive = [r is not None for r in self.replays]
        self.probes: list = [None] * len(self.replays)
        self.last_probe = time.perf_counter()
        self.reattached = 0

    def _attach(self, i: int, spec) -> PrioritizedReplay:
        a = self._attach_args
        return PrioritizedReplay.attach(spec, a["capacity"], a["fields"], alpha=a["alpha"], beta0=a["beta0"],
                                        beta_steps=a["beta_steps"], seed=self.seed + i)

    def refresh(self) -> None:
        """Probe the shards (non-blocking): skip silent ones, re-attach restarted ones."""
        if self.handles is None:
            return
        now = time.perf_counter()
        if now - self.last_probe < self.probe_every_s:
            return
        self.last_probe = now
        import ray
        for j, h in enumerate(self.handles):
            if self.probes[j] is None:
                self.probes[j] = (h.shared_spec.remote(), now)
                continue
            ref, t = self.probes[j]
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                if now - t > self.unanswered_s:
                    self.alive[j] = False
                continue
            self.probes[j] = None
            try:
                spec = ray.get(ref)
            except ray.exceptions.RayActorError:
                self.alive[j] = False
                continue
            if spec is None:
                self.alive[j] = False
                continue
            old = self.specs[j]
            if old is None or (spec.path, spec.owner_pid) != (old.path, old.owner_pid):  # a new incarnation
                self.replays[j] = self._attach(j, spec)
                self.specs[j] = spec
                self.reattached += 1
            self.alive[j] = True

    def try_sample(self, b: int):
        self.refresh()
        for _ in range(len(self.replays)):
            j = self.i
            self.i = (self.i + 1) % len(self.replays)
            if not self.alive[j]:
                continue
            rb = self.replays[j]
            if self.limiter.can_sample(rb.size, rb.writes, rb.sampled, b):
                return SampledBatch.from_replay(rb.sample(b), shard=j)
        return None

    def update(self, u: PriorityUpdate) -> None:
        # A batch sampled before its shard was re-attached updates the old memory: harmless.
        self.replays[u.shard].update_priorities(u.indices, u.generations, u.priorities)

    def sizes(self) -> list[int]:
        return [rb.size if rb is not None else 0 for rb in self.replays]


class RemoteShardSource:
    """Samples through shard RPCs (object store): the route for shards on other nodes."""

    route = "object-store"

    def __init__(self, shards: list) -> None:
        self.shards = shards
        self.i = 0

    def try_sample(self, b: int):
        import ray
        j = self.i
        self.i = (self.i + 1) % len(self.shards)
        try:
            out = ray.get(self.shards[j].sample.remote(b, 0.05), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None  # a dead or restarting shard: the next call tries the next one
        return out  # a SampledBatch of numpy arrays, or None (the shard's limiter said no)

    def update(self, u: PriorityUpdate) -> None:
        host = u.priorities.cpu().numpy() if hasattr(u.priorities, "cpu") else u.priorities
        self.shards[u.shard].update_priorities.remote(dataclasses.replace(u, priorities=host))

    def sizes(self) -> list[int]:
        import ray
        return [s.size for s in ray.get([sh.stats.remote() for sh in self.shards])]


class Prefetcher:
    """Keeps `depth` sampled batches ready on a background thread; records how long the
    learner waited for one (its data-starvation time)."""

    def __init__(self, source, batch_size: int, device: torch.device, depth: int = 2) -> None:
        self.source, self.b, self.device = source, batch_size, device
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.wait_s = 0.0  # time the learner waited for a batch after the first one
        self.delivered = 0
        self.sample_ms = float("nan")
        self.t = threading.Thread(target=self._run, name="replay-prefetch", daemon=True)
        self.t.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                ts = time.perf_counter()
                got = self.source.try_sample(self.b)
                if got is None:
                    time.sleep(0.005)
                    continue
                self.sample_ms = (time.perf_counter() - ts) * 1e3
                item = got.to_device(self.device)
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the training thread, which raises it
            self.error = e

    def next(self, timeout_s: float) -> Optional[tuple]:
        t0 = time.perf_counter()
        while True:
            if self.error is not None:
                raise RuntimeError(f"replay sampling failed: {self.error!r}") from self.error
            try:
                item = self.q.get(timeout=0.05)
                if self.delivered:  # waiting for the replay's first fill is warm-up, not starvation
                    self.wait_s += time.perf_counter() - t0
                self.delivered += 1
                return item
            except queue.Empty:
                if time.perf_counter() - t0 > timeout_s:
                    if self.delivered:
                        self.wait_s += time.perf_counter() - t0
                    return None

    def update(self, u: PriorityUpdate) -> None:
        self.source.update(u)

    def close(self) -> None:
        self.stop.set()
        self.t.join(timeout=5)


def make_source(shards: list, specs: list, node_id: str, rank: int, world: int, shard_cfg, seed: int):
    """This worker's data route: the shards on its node (split between the node's workers by
    rank), attached in place; or every shard by RPC when none shares its node. `specs` are
    the shards' handles when the run began (their nodes); the memory attached is the current."""
    local = [i for i, s in enumerate(specs) if s is not None and s.node_id == node_id]
    if local:
        mine = local[rank::world] if len(local) >= world else [local[rank % len(local)]]
        # The memory as of now: a shard restarted since the run began (a learner group
        # restarted by Ray Train starts here) has new memory; a silent one is attached later.
        now = answers([shards[i].shared_spec.remote() for i in mine], 30.0) if shards is not None else \
            [specs[i] for i in mine]
        return LocalShardSource(now, shard_cfg.capacity, shard_cfg.fields, shard_cfg.limiter,
                                shard_cfg.alpha, shard_cfg.beta0, shard_cfg.beta_steps, seed + 101 * rank,
                                handles=[shards[i] for i in mine] if shards is not None else None), mine
    return RemoteShardSource(shards), list(range(len(shards)))


def _agree(rank: int, stop: bool, checkpoint: bool, have_batch: bool, world: int,
           device: torch.device) -> tuple[bool, bool, bool]:
    """One small all-reduce per iteration keeps the ranks in lock step: rank 0 decides when to
    stop and when to checkpoint, and a step runs only when every rank has its batch (so
    every rank issues the same collectives, and `ray.train.report`, in the same order).
    Returns (stop, checkpoint, step)."""
    if world == 1:
        return stop, checkpoint, have_batch
    import torch.distributed as dist
    lead = 1.0 if rank == 0 else 0.0
    flag = torch.tensor([lead * stop, lead * checkpoint, float(not have_batch)], device=device)
    dist.all_reduce(flag)
    return bool(flag[0] > 0), bool(flag[1] > 0), bool(flag[2] == 0)


class FixedBatches:
    """A recorded list of group batches (SampledBatch) instead of replay: each rank trains on
    its rows of batch i at step i, and the run ends after the list (offline replays of a
    recorded stream; the local-vs-Ray equivalence test)."""

    route = "fixed"

    def __init__(self, batches: list, rank: int, per_worker: int) -> None:
        self.batches, self.i = batches, 0
        self.lo, self.hi = rank * per_worker, (rank + 1) * per_worker

    def exhausted(self) -> bool:
        return self.i >= len(self.batches)

    def next(self, timeout_s: float) -> Optional[SampledBatch]:
        if self.exhausted():
            return None
        b = self.batches[self.i].rows(self.lo, self.hi)
        self.i += 1
        return b

    def update(self, u: PriorityUpdate) -> None:
        pass  # nothing samples these again

    def close(self) -> None:
        pass


class LearnerWorker:
    """One Ray Train worker of the learner group: the shared `Learner.step` between a batch
    source and the weight store. Rank 0 publishes, reports and checkpoints; every rank
    steps in lock step with the others (`_agree`)."""

    def __init__(self, lc: LearnerLoopConfig) -> None:
        import ray
        import ray.train
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.lc = lc
        if not isinstance(lc.cfg, TrainConfig):
            raise TypeError(f"LearnerLoopConfig.cfg must be a TrainConfig, got {type(lc.cfg).__name__}")
        self.cfg = cfg = lc.cfg
        torch.set_num_threads(max(1, int(lc.torch_threads)))
        device = torch.device("cuda", torch.cuda.current_device()) if lc.use_gpu and torch.cuda.is_available() \
            else torch.device("cpu")
        self.per_worker = max(1, cfg.agent.batch_size // self.world)
        self.pref_actor = lc.preference
        self.use_pref = self.pref_actor is not None and cfg.pref.beta > 0
        # Resume: the driver's checkpoint, or (a worker group restarted by Ray Train's
        # FailureConfig) the last checkpoint this group reported; the updates since that one
        # are the steps lost to the failure. max_updates counts from the driver's resume point.
        resume, self.restored_from = lc.resume, None
        self.base_updates = int(resume["learner"].get("updates", 0)) if resume else 0
        got = ray.train.get_checkpoint()
        if got is not None:
            from apex_bdq.checkpoint import load_checkpoint
            with got.as_directory() as d:
                resume = load_checkpoint(os.path.join(d, CHECKPOINT_NAME))
            self.restored_from = int(resume["learner"].get("updates", 0))
        # The network, seeded with cfg.seed on every rank (same initial weights) or resumed,
        # the backend around it and the target copy: the same Learner as the one-process
        # trainer. Weights load before the backend wraps them (DeepSpeed keeps its own copy).
        self.learner = make_components(cfg).learner(device=device, backend=lc.backend, micro_batch=self.per_worker,
                                                    keep_pref_head=self.use_pref,
                                                    net_state=resume["learner"]["net"] if resume else None)
        if resume:
            # Another backend's optimiser layout (ZeRO-2 checkpoints keep none) starts afresh.
            self.learner.load_state_dict(resume["learner"], strict_optimizer=False)
        self.store = lc.store
        if self.store is not None and self.restored_from is not None:  # versions only go forward for readers
            try:
                self.learner.version = max(self.learner.version,
                                           int(ray.get(self.store.get_version.remote(), timeout=60)))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        self.start_id = f"{os.getpid()}-{time.time_ns()}"
        self.node_id = ray.get_runtime_context().get_node_id()
        # Data: recorded batches, or this worker's replay route behind a prefetch thread.
        if lc.batches is not None:
            self.source = FixedBatches(lc.batches, self.rank, self.per_worker)
        else:
            src, _ = make_source(lc.shards, lc.specs, self.node_id, ctx.get_local_rank(), ctx.get_local_world_size(),
                                 lc.shard_cfg, cfg.seed)
            self.source = Prefetcher(src, self.per_worker, self.learner.device, depth=lc.prefetch)
        # The time budget runs from the first group's start; a restarted group stops when the
        # first one would have (the weight store keeps the deadline).
        self.deadline = time.time() + float(cfg.minutes if lc.minutes is None else lc.minutes) * 60.0
        if self.store is not None:
            try:
                self.deadline = float(ray.get(self.store.deadline.remote(self.deadline), timeout=60))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        self.report_every = max(1, lc.publish_every // 5)
        self.t0 = time.perf_counter()
        self.compute_s = 0.0
        self.steps = 0  # steps of this incarnation
        self.last = StepResult(priorities=None, loss=float("nan"), grad_norm=float("nan"))
        self.last_pref = (float("nan"), float("nan"))  # (loss, accuracy) of the last step that had a PreferenceBatch
        self.publishes = 0
        self._m_last = (0, 0)
        self.pref_batch, self.pref_next = None, None
        # The driver can stop the group early (a run aborted because its actors died): rank 0
        # reads the weight store's stop flag about once a second, without waiting on it.
        self.stop_probe, self.aborted, self.next_probe = None, False, time.time() + 1.0

    # -- links ------------------------------------------------------------------------------
    def publish(self) -> None:
        """Rank 0: the current weights to the weight store (and, every tenth time, to the
        preference actor, whose ensemble picks the queries)."""
        if self.store is None or self.rank != 0:
            return
        from learner.weight_store import state_to_numpy
        state = state_to_numpy(self.learner.net)
        self.store.put.remote(self.learner.version, state)
        if self.pref_actor is not None and self.publishes % 10 == 0:
            self.pref_actor.set_weights.remote(state, self.learner.version)
        self.publishes += 1

    def preference_batch(self):
        """The newest PreferenceBatch that has arrived (fetched one ahead; None before
        pref.min_pairs exist), every pref.update_every steps."""
        import ray
        if not self.use_pref or self.learner.updates % self.cfg.pref.update_every != 0:
            return None
        if self.pref_next is None:
            self.pref_next = self.pref_actor.sample.remote()
        ready, _ = ray.wait([self.pref_next], timeout=0)
        if ready:
            try:
                self.pref_batch = ray.get(self.pref_next) or self.pref_batch
            except ray.exceptions.RayActorError:
                pass  # the preference actor is restarting (it replays its log): ask again
            self.pref_next = self.pref_actor.sample.remote()
        return self.pref_batch

    def report(self, final: bool) -> LearnerReport:
        el = time.perf_counter() - self.t0
        pre = self.source if isinstance(self.source, Prefetcher) else None
        waited = pre.wait_s if pre is not None else 0.0
        return LearnerReport(updates=self.learner.updates, version=self.learner.version, td_loss=self.last.loss,
                             q_mean=self.last.q_mean, pref_loss=self.last_pref[0],
                             pref_accuracy=self.last_pref[1], updates_per_s=self.steps / max(el, 1e-9),
                             learner_wait_share=waited / max(waited + self.compute_s, 1e-9),
                             sample_ms=pre.sample_ms if pre is not None else float("nan"), elapsed_s=el,
                             route=pre.source.route if pre is not None else self.source.route,
                             backend=self.learner.backend.name, rank=self.rank, world_size=self.world, final=final,
                             start_id=self.start_id, restored_from_updates=self.restored_from,
                             replay_reattached=getattr(pre.source, "reattached", 0) if pre is not None else 0,
                             optimizer_resets=self.learner.optimizer_resets,
                             pid=os.getpid(), node_id=self.node_id)

    def checkpoint(self, final: bool) -> None:
        """Every rank reports to Ray Train (it expects all of them); rank 0 attaches the
        checkpoint (launch.train --local's file format) and tells the weight store."""
        import ray.train
        report = self.report(final)
        ck = None
        if self.rank == 0:
            if self.store is not None:
                self.store.report.remote(report)
            d = tempfile.mkdtemp(prefix="apex_bdq_ckpt_")
            # ZeRO-2 shards the optimiser state across ranks (and it holds DeepSpeed objects a
            # weights-only load refuses): the portable file keeps weights and counters.
            state = self.learner.state_dict(with_optimizer=self.learner.backend.name != "deepspeed")
            save_checkpoint(os.path.join(d, CHECKPOINT_NAME), config_to_dict(self.cfg), state,
                            {"updates": self.learner.updates, "decisions": 0, "env_steps": 0, "history": []})
            ck = ray.train.Checkpoint.from_directory(d)
        ray.train.report(report.as_dict(), checkpoint=ck)
        if ck is not None:  # Ray Train has copied it into the run's storage
            shutil.rmtree(ck.path, ignore_errors=True)

    def record_metrics(self) -> None:
        from apex_bdq import metrics as M
        r, el = self.rank, time.perf_counter() - self.t0
        M.record(M.LEARNER_UPDATES, self.learner.updates - self._m_last[0], "learner", r)
        M.record(M.TRANSITIONS_SAMPLED, (self.steps - self._m_last[1]) * self.per_worker, "learner", r)
        M.record(M.LEARNER_UPDATES_PER_S, self.steps / max(el, 1e-9), "learner", r)
        M.record(M.TD_LOSS, self.last.loss, "learner", r)
        M.record(M.MEAN_Q, self.last.q_mean, "learner", r)
        if self.use_pref and self.last_pref[0] == self.last_pref[0]:
            M.record(M.PREF_LOSS, self.last_pref[0], "learner", r)
            M.record(M.PREF_ACCURACY, self.last_pref[1], "learner", r)
        pre = self.source if isinstance(self.source, Prefetcher) else None
        if pre is not None and pre.sample_ms == pre.sample_ms:
            M.record(M.SAMPLE_LATENCY_MS, pre.sample_ms, "learner", r)
        self._m_last = (self.learner.updates, self.steps)

    def over(self) -> bool:
        """Rank 0's view: the driver's stop flag, the deadline, the update budget, the data."""
        import ray
        if self.store is not None and self.rank == 0 and not self.aborted:
            if self.stop_probe is None and time.time() >= self.next_probe:
                self.stop_probe, self.next_probe = self.store.should_stop.remote(), time.time() + 1.0
            if self.stop_probe is not None and ray.wait([self.stop_probe], timeout=0)[0]:
                try:
                    self.aborted = bool(ray.get(self.stop_probe))
                except ray.exceptions.RayActorError:
                    pass
                self.stop_probe = None
        mx = self.lc.max_updates
        return self.aborted or time.time() >= self.deadline or \
            (mx is not None and self.learner.updates - self.base_updates >= mx) or \
            (isinstance(self.source, FixedBatches) and self.source.exhausted())

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        lc = self.lc
        last_ckpt = time.perf_counter()
        held: Optional[SampledBatch] = None
        self.publish()  # version 0 (or the resumed one): actors act with the learner's weights
        try:
            while True:
                over = self.over()
                if held is None and not over:
                    held = self.source.next(timeout_s=0.05 if self.world > 1 else 0.5)
                stop, ck, go = _agree(self.rank, over, time.perf_counter() - last_ckpt >= lc.checkpoint_every_s,
                                      held is not None, self.world, self.learner.device)
                if stop:
                    break
                if ck:
                    self.checkpoint(final=False)
                    last_ckpt = time.perf_counter()
                if not go:
                    continue  # some rank is still waiting for data (replay filling, rate limiter)
                batch, held = held, None
                tc = time.perf_counter()
                self.last = self.learner.step(batch, self.preference_batch(), where=f"on rank {self.rank}")
                self.compute_s += time.perf_counter() - tc
                if self.last.pref_loss == self.last.pref_loss:
                    self.last_pref = (self.last.pref_loss, self.last.pref_accuracy)
                self.source.update(batch.update(self.last.priorities))
                self.steps += 1
                if self.learner.updates % lc.publish_every == 0:
                    self.publish()
                    self.record_metrics()
                if self.store is not None and self.rank == 0 and self.learner.updates % self.report_every == 0:
                    self.store.report.remote(self.report(False))  # live figures: progress line, weight lag
        finally:
            self.source.close()
        self.publish()
        self.checkpoint(final=True)


LOOP_KEY = "loop"
"""Ray Train's `train_loop_config` is a dict: the LearnerLoopConfig travels under this key."""


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point: `TorchTrainer(train_loop_per_worker,
    train_loop_config={LOOP_KEY: LearnerLoopConfig(...)})`."""
    lc = config.get(LOOP_KEY) if isinstance(config, dict) else None
    if not isinstance(lc, LearnerLoopConfig):
        raise TypeError(f"train_loop_per_worker needs train_loop_config={{{LOOP_KEY!r}: LearnerLoopConfig}}, "
                        f"got {type(lc).__name__} under {LOOP_KEY!r}")
    LearnerWorker(lc).run()
