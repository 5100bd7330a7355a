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

import copy
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Optional

import torch

from apex_bdq.checkpoint import config_to_dict, save_checkpoint
from apex_bdq.config import train_config_from_dict
from apex_bdq.networks import BDQNetwork
from apex_bdq.ray_util import answers
from learner.learner import apply_initial_policy, batch_td_loss
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
                s = rb.sample(b)
                return j, s.indices, s.generations, s.weights, s.data
        return None

    def update(self, j: int, indices, generations, priorities) -> None:
        # A batch sampled before its shard was re-attached updates the old memory: harmless.
        self.replays[j].update_priorities(indices, generations, priorities)

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
        if out is None:
            return None
        return (j, torch.from_numpy(out["indices"]), torch.from_numpy(out["generations"]),
                torch.from_numpy(out["weights"]), {k: torch.from_numpy(v) for k, v in out["data"].items()})

    def update(self, j: int, indices, generations, priorities) -> None:
        self.shards[j].update_priorities.remote(indices.numpy(), generations.numpy(), priorities.cpu().numpy())

    def sizes(self) -> list[int]:
        import ray
        return [s["size"] for s in ray.get([sh.stats.remote() for sh in self.shards])]


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
                j, idx, gen, w, data = got
                if self.device.type == "cuda":
                    data = {k: v.to(self.device, non_blocking=True) for k, v in data.items()}
                    w = w.to(self.device, non_blocking=True)
                while not self.stop.is_set():
                    try:
                        self.q.put((j, idx, gen, w, data), timeout=0.1)
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


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point. config keys: cfg (TrainConfig as dict), backend, shards (handles),
    specs (their SharedSpecs), shard_cfg, store (WeightStore handle), minutes, max_updates,
    publish_every, checkpoint_every_s, use_gpu, resume (state dict or None),
    fixed_batches (tests: a list of global batches used instead of replay),
    params_out (tests: rank 0 saves the final parameters here)."""
    import ray
    import ray.train
    from learner.backends import make_backend
    from learner.weight_store import state_to_numpy

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = train_config_from_dict(config["cfg"])
    a = cfg.agent
    torch.set_num_threads(max(1, int(config.get("torch_threads", 1))))
    device = torch.device("cuda", torch.cuda.current_device()) if config.get("use_gpu") and torch.cuda.is_available() \
        else torch.device("cpu")
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    net = apply_initial_policy(BDQNetwork(cfg.net), cfg.agent, cfg.sim)
    resume = config.get("resume")
    base_updates = int(resume["learner"].get("updates", 0)) if resume else 0  # max_updates counts from here
    # A restarted worker group (Ray Train's FailureConfig) starts from the last checkpoint it
    # reported; the updates since then are the steps lost to the failure.
    restored_from = None
    got = ray.train.get_checkpoint()
    if got is not None:
        from apex_bdq.checkpoint import load_checkpoint
        with got.as_directory() as d:
            resume = load_checkpoint(os.path.join(d, CHECKPOINT_NAME))
        restored_from = int(resume["learner"].get("updates", 0))
    if resume:
        net.load_state_dict(resume["learner"]["net"])
    per_worker = max(1, a.batch_size // world)
    backend = make_backend(config.get("backend", "ddp"), net, a, device, micro_batch=per_worker)
    target = copy.deepcopy(backend.module).requires_grad_(False)
    updates, version = 0, 0
    if resume:
        target.load_state_dict(resume["learner"]["target"])
        try:
            backend.load_optimizer_state(resume["learner"]["opt"])
        except (ValueError, KeyError, RuntimeError):
            pass  # another backend's optimiser layout: start the optimiser afresh
        updates = int(resume["learner"].get("updates", 0))
        version = int(resume["learner"].get("version", updates))
    store = config.get("store")
    if store is not None and restored_from is not None:  # versions only go forward for readers
        try:
            version = max(version, int(ray.get(store.get_version.remote(), timeout=60)))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
    start_id = f"{os.getpid()}-{time.time_ns()}"
    fixed = config.get("fixed_batches")
    pre = None
    route = "fixed"
    if fixed is None:
        source, mine = make_source(config["shards"], config["specs"], ray.get_runtime_context().get_node_id(),
                                   ctx.get_local_rank(), ctx.get_local_world_size(), config["shard_cfg"], cfg.seed)
        route = source.route
        pre = Prefetcher(source, per_worker, device, depth=int(config.get("prefetch", 2)))
    # Preference batches (pref.enabled): fetched one ahead from the preference actor; a step
    # uses the newest one that has arrived (none before pref.min_pairs exist).
    pref_actor = config.get("preference")
    use_pref = pref_actor is not None and cfg.pref.beta > 0
    pref_batch, pref_next = None, None
    # The time budget runs from the first group's start; a restarted group stops when the
    # first one would have (the weight store keeps the deadline).
    deadline = time.time() + float(config.get("minutes", cfg.minutes)) * 60.0
    if store is not None:
        try:
            deadline = float(ray.get(store.deadline.remote(deadline), timeout=60))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
    max_updates = config.get("max_updates")
    publish_every = int(config.get("publish_every", 50))
    report_every = max(1, publish_every // 5)
    ckpt_every = float(config.get("checkpoint_every_s", 60.0))
    t0 = time.perf_counter()
    last_ckpt = t0
    compute_s = 0.0
    last = {"loss": float("nan"), "q_mean": float("nan"), "pref_loss": float("nan"), "pref_accuracy": float("nan")}
    step_i = 0

    publishes = [0]

    def publish() -> None:
        if store is not None and rank == 0:
            state = state_to_numpy(backend.module)
            store.put.remote(version, state)
            if pref_actor is not None and publishes[0] % 10 == 0:  # its ensemble picks the queries
                pref_actor.set_weights.remote(state, version)
            publishes[0] += 1

    m_last = [0, 0]

    def record_metrics() -> None:
        from apex_bdq import metrics as M
        el = time.perf_counter() - t0
        M.record(M.LEARNER_UPDATES, updates - m_last[0], "learner", rank)
        M.record(M.TRANSITIONS_SAMPLED, (step_i - m_last[1]) * per_worker, "learner", rank)
        M.record(M.LEARNER_UPDATES_PER_S, step_i / max(el, 1e-9), "learner", rank)
        M.record(M.TD_LOSS, last["loss"], "learner", rank)
        M.record(M.MEAN_Q, last["q_mean"], "learner", rank)
        if use_pref and last["pref_loss"] == last["pref_loss"]:
            M.record(M.PREF_LOSS, last["pref_loss"], "learner", rank)
            M.record(M.PREF_ACCURACY, last["pref_accuracy"], "learner", rank)
        if pre is not None and pre.sample_ms == pre.sample_ms:
            M.record(M.SAMPLE_LATENCY_MS, pre.sample_ms, "learner", rank)
        m_last[:] = [updates, step_i]

    def current_metrics(final: bool) -> dict:
        el = time.perf_counter() - t0
        waited = pre.wait_s if pre is not None else 0.0
        return {"updates": updates, "version": version, "td_loss": last["loss"], "q_mean": last["q_mean"],
                "start_id": start_id, "restored_from_updates": restored_from, "pid": os.getpid(),
                "replay_reattached": getattr(pre.source, "reattached", 0) if pre is not None else 0,
                "pref_loss": last["pref_loss"], "pref_accuracy": last["pref_accuracy"],
                   "updates_per_s": step_i / max(el, 1e-9), "learner_wait_share": waited / max(waited + compute_s, 1e-9),
                   "route": route, "rank": rank, "world_size": world, "final": final, "elapsed_s": el,
                   "node_id": ray.get_runtime_context().get_node_id(), "backend": backend.name,
                   "sample_ms": pre.sample_ms if pre is not None else float("nan")}

    def report(final: bool) -> None:
        metrics = current_metrics(final)
        ck = None
        if rank == 0:
            if store is not None:
                store.report.remote(metrics)
            d = tempfile.mkdtemp(prefix="apex_bdq_ckpt_")
            save_checkpoint(os.path.join(d, CHECKPOINT_NAME), config_to_dict(cfg),
                            {"net": backend.module.state_dict(), "target": target.state_dict(),
                             # ZeRO-2 shards the optimiser state across ranks (and it holds DeepSpeed objects
                             # a weights-only load refuses): the portable file keeps weights and counters.
                             "opt": backend.optimizer_state() if backend.name != "deepspeed" else {},
                             "updates": updates, "version": version},
                            {"updates": updates, "decisions": 0, "env_steps": 0, "history": []})
            ck = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=ck)
        if ck is not None:  # Ray Train has copied it into the run's storage
            shutil.rmtree(ck.path, ignore_errors=True)

    # The driver can stop the group early (a run aborted because its actors died): rank 0
    # reads the weight store's stop flag about once a second, without waiting on it.
    stop_probe, aborted, next_probe = None, False, time.time() + 1.0
    publish()
    try:
        held = None
        while True:
            if store is not None and rank == 0 and not aborted:
                if stop_probe is None and time.time() >= next_probe:
                    stop_probe, next_probe = store.should_stop.remote(), time.time() + 1.0
                if stop_probe is not None and ray.wait([stop_probe], timeout=0)[0]:
                    try:
                        aborted = bool(ray.get(stop_probe))
                    except ray.exceptions.RayActorError:
                        pass
                    stop_probe = None
            over = aborted or (time.time() >= deadline) or \
                (max_updates is not None and updates - base_updates >= max_updates) \
                or (fixed is not None and step_i >= len(fixed))
            if fixed is not None:
                if not over:
                    g = fixed[step_i]
                    lo, hi = rank * per_worker, (rank + 1) * per_worker
                    held = (None, None, None, torch.as_tensor(g["weights"][lo:hi]).to(device),
                            {k: torch.as_tensor(v[lo:hi]).to(device) for k, v in g["data"].items()})
            elif held is None:
                held = pre.next(timeout_s=0.05 if world > 1 else 0.5)
            stop, ck, go = _agree(rank, over, time.perf_counter() - last_ckpt >= ckpt_every, held is not None,
                                  world, device)
            if stop:
                break
            if ck:
                report(final=False)
                last_ckpt = time.perf_counter()
            if not go:
                continue  # some rank is still waiting for data (replay filling, rate limiter)
            j, idx, gen, w, data = held
            held = None
            step_pref = None
            if use_pref and updates % cfg.pref.update_every == 0:
                if pref_next is None:
                    pref_next = pref_actor.sample.remote()
                ready, _ = ray.wait([pref_next], timeout=0)
                if ready:
                    try:
                        pref_batch = ray.get(pref_next) or pref_batch
                    except ray.exceptions.RayActorError:
                        pass  # the preference actor is restarting (it replays its log): ask again
                    pref_next = pref_actor.sample.remote()
                step_pref = pref_batch
            tc = time.perf_counter()
            loss, ex = batch_td_loss(backend.forward, backend.module, target, data, w, a,
                                     f"on rank {rank} at update {updates}", pref_batch=step_pref,
                                     pref_beta=cfg.pref.beta, keep_pref_head=use_pref)
            backend.step(loss)
            compute_s += time.perf_counter() - tc
            if j is not None:
                pre.source.update(j, idx, gen, ex["priorities"].detach())
            updates += 1
            version += 1
            step_i += 1
            last.update(loss=float(loss.detach()), q_mean=float(ex["q_mean"]))
            if "pref_loss" in ex:
                last.update(pref_loss=float(ex["pref_loss"]), pref_accuracy=float(ex["accuracy"]))
            if updates % a.target_update == 0:
                target.load_state_dict(backend.module.state_dict())
            if updates % publish_every == 0:
                publish()
                record_metrics()
            if store is not None and rank == 0 and updates % report_every == 0:
                store.report.remote(current_metrics(False))  # live figures: progress line, weight lag
    finally:
        if pre is not None:
            pre.close()
    publish()
    if config.get("params_out") and rank == 0:
        torch.save({k: v.detach().cpu() for k, v in backend.module.state_dict().items()}, config["params_out"])
    report(final=True)
