"""The learner step (no Ray): BDQ TD loss on a prioritized batch, Adam, target network."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from apex_bdq.config import AgentConfig
from apex_bdq.messages import SampledBatch
from apex_bdq.losses import bdq_td_loss, preference_loss, segment_scores
from apex_bdq.networks import BDQNetwork, NetConfig


def batch_td_loss(forward, module: BDQNetwork, target: BDQNetwork, data: dict, weights: torch.Tensor,
                  cfg: AgentConfig, where: str = "", pref_batch=None, pref_beta: float = 0.0,
                  keep_pref_head: bool = False) -> tuple[torch.Tensor, dict]:
    """The learner's loss on a sampled batch: BDQ TD, plus pref_beta x Bradley-Terry on a
    PreferenceBatch when one is given. `forward` (the trained model, possibly wrapped by DDP /
    DeepSpeed / Accelerate) gives Q(s) — and the preference utilities of the batch's segments,
    in the same pass — with gradients; the bare `module` picks a* at s' and `target`
    evaluates it. keep_pref_head: with no PreferenceBatch yet, still run the head on one row
    at weight 0, so a wrapper that expects every parameter to get a gradient (DDP, ZeRO) sees
    the same graph on every step. A non-finite loss raises, naming `where`."""
    ex_pref: dict = {}
    if pref_batch is not None or keep_pref_head:
        if pref_batch is not None:
            pm, pu, acts, label = pref_batch_tensors(pref_batch, data["macro"].device)
        else:
            pm, pu = data["macro"][:1], data["micro"][:1]
        q, u = forward(data["macro"], data["micro"], pm, pu)  # [B, D, n], [E, Bp, D, n]
    else:
        q = forward(data["macro"], data["micro"])  # [B, D, n]
    with torch.no_grad():
        q_next_online = module(data["next_macro"], data["next_micro"])
        q_next_target = target(data["next_macro"], data["next_micro"])
    loss, ex = bdq_td_loss(q, data["action"].long(), data["reward"], data["discount"], q_next_online,
                           q_next_target, weights, huber_delta=cfg.huber_delta, priority=cfg.priority_rule)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"TD loss is {loss.item()} {where}: check rewards and lr")
    if pref_batch is not None:
        pl, ex_pref = _bt_loss(u, acts, label)
        if not torch.isfinite(pl):
            raise FloatingPointError(f"preference loss is {pl.item()} {where}")
        loss = loss + pref_beta * pl
        ex_pref["pref_loss"] = pl.detach()
    elif keep_pref_head:
        loss = loss + 0.0 * u.sum()
    ex.update(ex_pref)
    return loss, ex


def pref_batch_tensors(batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A PreferenceBatch as model inputs: both sides' decisions flattened, A first.
    Returns macro [2PT, Fm], micro [2PT, K, H, Fu], actions [2P, T, D], label [P]."""
    P, T = batch.action_a.shape[:2]
    macro = torch.as_tensor(np.concatenate([batch.macro_a, batch.macro_b]), device=device)  # [2P, T, Fm]
    micro = torch.as_tensor(np.concatenate([batch.micro_a, batch.micro_b]), device=device)  # [2P, T, K, H, Fu]
    acts = torch.as_tensor(np.concatenate([batch.action_a, batch.action_b]), device=device)  # [2P, T, D]
    return (macro.reshape(2 * P * T, -1), micro.reshape((2 * P * T,) + tuple(micro.shape[2:])), acts,
            torch.as_tensor(batch.label, device=device))


def _bt_loss(u: torch.Tensor, acts: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, dict]:
    P2, T = acts.shape[:2]
    u = u.reshape(u.shape[0], P2, T, u.shape[-2], u.shape[-1])  # [E, 2P, T, D, n]
    s = segment_scores(u, acts)  # [E, 2P]
    return preference_loss(s[:, :P2 // 2], s[:, P2 // 2:], label)


def batch_preference_loss(forward_utilities, batch, device: torch.device) -> tuple[torch.Tensor, dict]:
    """The Bradley-Terry loss of a PreferenceBatch alone; `forward_utilities` maps (macro,
    micro) to utilities [E, B, D, n] (e.g. `net.utilities`)."""
    macro, micro, acts, label = pref_batch_tensors(batch, device)
    return _bt_loss(forward_utilities(macro, micro), acts, label)


@torch.no_grad()
def ranking_accuracy(forward_utilities, pairs: list, segments: dict, device: torch.device) -> float:
    """Share of the strict pairs (label 1 or 0; ties left out) whose order the ensemble-mean
    utilities give as labelled; NaN when there is none."""
    strict = [p for p in pairs if p.label != 0.5]
    if not strict:
        return float("nan")
    from apex_bdq.preference import PreferenceBatch
    _, ex = batch_preference_loss(forward_utilities, PreferenceBatch.from_pairs(strict, segments), device)
    return float(ex["accuracy"])


def apply_initial_policy(net: BDQNetwork, agent_cfg: AgentConfig, sim_cfg=None) -> BDQNetwork:
    """agent.initial_policy="default": the untrained network's greedy choice becomes the
    platform's default setting (BranchingDuelingHead.start_from); "network" leaves it be.
    Every place that builds a network to train calls this (the local learner, the Ray Train
    learner, the Ape-X driver's version 0), so all start from the same weights."""
    if agent_cfg.initial_policy == "default":
        from apex_bdq.sim.baselines import default_action
        if sim_cfg is None:
            raise ValueError("agent.initial_policy='default' needs the simulator config (its default action)")
        net.head.start_from(default_action(sim_cfg))
    return net


@dataclass
class StepResult:
    """What one learner step gives back: new priorities [B] for the sampled slots (None on
    a preference-only step) and the step's figures."""

    priorities: Optional[torch.Tensor]
    loss: float
    grad_norm: float
    q_mean: float = float("nan")
    pref_loss: float = float("nan")
    pref_accuracy: float = float("nan")


class Learner:
    """The learner step, the same on both paths: BDQ TD loss on a SampledBatch (plus
    pref_beta x Bradley-Terry on a PreferenceBatch), one optimiser step through the backend
    (`learner.backends`: plain in one process; DDP / DeepSpeed / Accelerate inside a Ray
    Train worker), the target network refreshed every `target_update` steps.

    The network is built here, seeded with `seed` and started from agent.initial_policy, so
    that the one-process trainer, every Ray Train rank and the Ape-X driver's version 0 hold
    the same initial weights."""

    def __init__(self, net_cfg: NetConfig, agent_cfg: AgentConfig, device: str | torch.device = "cpu",
                 seed: int = 0, pref_beta: float = 0.0, sim_cfg=None, backend: str = "plain",
                 micro_batch: int = 1, keep_pref_head: bool = False, net_state: Optional[dict] = None) -> None:
        """keep_pref_head: run the preference head on every step even without a
        PreferenceBatch (at weight 0), for wrappers that need every parameter in every
        step's graph (DDP, ZeRO) when preferences are on. net_state: weights to start from
        (a resume), loaded before the backend wraps the network."""
        from learner.backends import make_backend
        torch.manual_seed(seed)
        self.cfg = agent_cfg
        self.pref_beta = pref_beta
        self.keep_pref_head = keep_pref_head and pref_beta > 0
        net = apply_initial_policy(BDQNetwork(net_cfg), agent_cfg, sim_cfg)
        if net_state is not None:
            net.load_state_dict(net_state)
        self.backend = make_backend(backend, net, agent_cfg, torch.device(device), micro_batch=micro_batch)
        self.net = self.backend.module  # the bare network: acting, checkpoints, publishing
        self.device = self.backend.device
        self.target = copy.deepcopy(self.net).requires_grad_(False)
        self.updates = 0
        self.optimizer_resets = 0
        self.version = 0  # bumped whenever the weights change; stamped on what they produce

    def step(self, batch: Optional[SampledBatch], pref_batch=None, where: str = "") -> StepResult:
        """One gradient step on a sampled batch (TD) and/or a PreferenceBatch (weighted by
        pref_beta; alone when batch is None)."""
        pb = pref_batch if self.pref_beta > 0 else None
        at = f"{where} at update {self.updates}".strip()
        res = {}
        priorities = None
        if batch is not None:
            b = batch.to_device(self.device)
            loss, ex = batch_td_loss(self.backend.forward, self.net, self.target, b.fields(), b.weights, self.cfg,
                                     at, pref_batch=pb, pref_beta=self.pref_beta,
                                     keep_pref_head=self.keep_pref_head)
            priorities = ex["priorities"].detach()
            res["q_mean"] = float(ex["q_mean"])
            if pb is not None:
                res.update(pref_loss=float(ex["pref_loss"]), pref_accuracy=float(ex["accuracy"]))
        elif pb is not None:
            pl, pex = batch_preference_loss(self.net.utilities, pb, self.device)
            loss = self.pref_beta * pl
            res.update(pref_loss=float(pl.detach()), pref_accuracy=float(pex["accuracy"]))
        else:
            raise ValueError("a learner step needs a replay batch, a preference batch, or both")
        grad_norm = self.backend.step(loss)
        self.updates += 1
        self.version += 1
        if self.updates % self.cfg.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())
        return StepResult(priorities=priorities, loss=float(loss.detach()), grad_norm=grad_norm, **res)

    def state_dict(self, with_optimizer: bool = True) -> dict:
        return {"net": self.net.state_dict(), "target": self.target.state_dict(),
                "opt": self.backend.optimizer_state() if with_optimizer else {},
                "updates": self.updates, "version": self.version}

    def load_state_dict(self, state: dict, strict_optimizer: bool = True) -> None:
        """strict_optimizer=False: an optimiser state of another backend's layout (or none)
        starts the optimiser afresh instead of failing, with a warning and a count
        (`optimizer_resets`, reported in LearnerReport)."""
        self.net.load_state_dict(state["net"])
        self.target.load_state_dict(state["target"])
        try:
            self.backend.load_optimizer_state(state["opt"])
        except (ValueError, KeyError, RuntimeError) as e:
            if strict_optimizer:
                raise
            self.optimizer_resets += 1
            warnings.warn(f"the checkpoint's optimiser state does not load into the {self.backend.name} backend "
                          f"({type(e).__name__}: {str(e)[:200]}); the optimiser starts afresh (Adam moments lost)",
                          RuntimeWarning, stacklevel=2)
        self.updates = int(state.get("updates", 0))
        self.version = int(state.get("version", self.updates))


def _explore_choice(rng: np.random.Generator, shape: tuple, n: int, utilities: Optional[np.ndarray],
                    temperature: float) -> np.ndarray:
    """Exploratory sub-actions [S, D]: uniform, or drawn from softmax(u_d / temperature) when
    preference utilities [S, D, n] are given (Gumbel-max: argmax of u/T + Gumbel noise)."""
    if utilities is None:
        return rng.integers(0, n, size=shape)
    g = rng.gumbel(size=utilities.shape)
    return (utilities / temperature + g).argmax(-1)


@torch.no_grad()
def act_values(net: BDQNetwork, macro: np.ndarray, micro: np.ndarray, want_u: bool,
               device: Optional[torch.device] = None) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Q-values [S, D, n] of a batch of observations, and the preference utilities of the
    same pass when wanted and the network has a head (else None), as numpy arrays."""
    dev = device or next(net.parameters()).device
    m, u = torch.as_tensor(macro, device=dev), torch.as_tensor(micro, device=dev)
    if want_u and net.pref is not None:
        q, ut = net.q_and_utilities(m, u)
        return q.cpu().numpy(), ut.cpu().numpy()
    return net(m, u).cpu().numpy(), None


class Explorer:
    """Per-branch epsilon-greedy over S shards: each branch explores on its own with its
    shard's eps, optionally steered by the preference head (softmax over its utilities, not
    uniform)."""

    def __init__(self, num_shards: int, num_branches: int, eps: np.ndarray, rng: np.random.Generator,
                 softmax_temperature: float = 0.0) -> None:
        self.eps = np.asarray(eps, dtype=np.float64)
        if self.eps.shape != (num_shards,):
            raise ValueError(f"epsilons must be one per shard ({num_shards}), got {self.eps.shape}")
        self.rng = rng
        self.temperature = float(softmax_temperature)
        self.utilities: Optional[np.ndarray] = None  # [S, D, n] of the last act, when computed

    def act(self, net: BDQNetwork, macro: np.ndarray, micro: np.ndarray,
            want_utilities: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Returns (actions [S, D] int64, q [S, D, n] float32); the preference utilities of
        the same pass are left in `self.utilities` (None without a head)."""
        q, u = act_values(net, macro, micro, want_utilities or self.temperature > 0)
        return self.choose(q, u), q

    def choose(self, q: np.ndarray, u: Optional[np.ndarray] = None) -> np.ndarray:
        """Actions [S, D] from Q-values [S, D, n] computed already (and the preference
        utilities of the same pass, kept in `self.utilities`)."""
        self.utilities = u
        soft = u if self.temperature > 0 else None
        S, D, n = q.shape
        explore = self.rng.random((S, D)) < self.eps[:, None]
        return np.where(explore, _explore_choice(self.rng, (S, D), n, soft, self.temperature), q.argmax(-1))
