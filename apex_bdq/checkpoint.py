"""Checkpoints of the local trainer, and the greedy policy `launch.evaluate` loads from one.

A checkpoint is one `torch.save` file: format tag, the full config as plain data, learner
state (online + target weights, optimiser), step counters. Loading checks the format and
that the network fits the simulator it will act in, and names any mismatch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from apex_bdq.config import SimConfig, TrainConfig, net_config_from_dict, train_config_from_dict
from apex_bdq.durable import atomic_write
from apex_bdq.networks import BDQNetwork, NetConfig

FORMAT = "apex-bdq-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, of another format, or does not fit the config."""


def save_checkpoint(path: str | Path, config: dict, learner_state: dict, counters: dict) -> None:
    # atomic and durable (a unique temp file, fsync of file and directory): a crash mid-write
    # never leaves a torn checkpoint, and two writers never share a temp file
    atomic_write(path, lambda f: torch.save({"format": FORMAT, "config": config, "learner": learner_state,
                                             "counters": counters}, f))


def load_checkpoint(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    try:
        ck = torch.load(p, map_location="cpu", weights_only=True)  # tensors and plain data only: no code runs
    except Exception as e:  # truncated / not a torch file
        raise CheckpointError(f"checkpoint {str(p)!r} is corrupt or not a checkpoint: {type(e).__name__}: {e}") from e
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        got = ck.get("format") if isinstance(ck, dict) else type(ck).__name__
        raise CheckpointError(f"checkpoint {str(p)!r} has format {got!r}, expected {FORMAT!r}")
    return ck


def train_config_of(ck: dict, path: str | Path) -> TrainConfig:
    """The full training config a loaded checkpoint was saved with; CheckpointError naming
    the file and what does not load (e.g. a key this version does not know)."""
    try:
        return train_config_from_dict(ck["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"checkpoint {str(path)!r}: its config does not load in this version: {e}") from e


def net_config_of(ck: dict) -> NetConfig:
    return net_config_from_dict(ck["config"]["net"])


def platform_of(ck: dict) -> str:
    """The platform a checkpoint was trained on ("v1" when it predates platform v2)."""
    return (ck.get("config", {}).get("sim") or {}).get("platform", "v1")


def check_platform(ck: dict, sim_cfg: SimConfig, what: str) -> None:
    """A checkpoint acts only on the platform it was trained on."""
    got = platform_of(ck)
    if got != sim_cfg.platform:
        raise CheckpointError(f"{what} was trained on platform {got}, this run's platform is {sim_cfg.platform}: "
                              f"evaluate it with --set sim.platform={got} (launch.evaluate takes the checkpoint's "
                              f"own platform when given only checkpoints of one platform)")


def check_fits(net_cfg: NetConfig, sim_cfg: SimConfig, what: str) -> None:
    want = NetConfig.for_sim(sim_cfg)
    diffs = [f"{f}: checkpoint {getattr(net_cfg, f)} vs config {getattr(want, f)}"
             for f in NetConfig.SHAPE_FIELDS if getattr(net_cfg, f) != getattr(want, f)]
    if diffs:
        raise CheckpointError(f"{what} does not fit this simulator config: " + "; ".join(diffs))


class GreedyPolicy:
    """argmax_a Q_d per branch, re-decided every `decision_ticks` ticks and held in between:
    the learned policy as `evaluate_policy` runs it."""

    def __init__(self, net: BDQNetwork, decision_ticks: int = 1, name: str = "learned",
                 platform: Optional[str] = None) -> None:
        self.net = net.eval()
        self.k = int(decision_ticks)
        self.name = name
        self.platform = platform  # the one it was trained on (None: not checked beyond the shapes)

    def reset(self, sim) -> None:
        if self.platform is not None and self.platform != sim.cfg.platform:
            raise CheckpointError(f"policy {self.name!r} was trained on platform {self.platform}, the simulator "
                                  f"runs platform {sim.cfg.platform}")
        check_fits(self.net.cfg, sim.cfg, f"policy {self.name!r}")
        self.actions = None
        self.t = 0

    @torch.no_grad()
    def act(self, sim, obs):
        if self.actions is None or self.t % self.k == 0:
            q = self.net(torch.from_numpy(np.ascontiguousarray(obs.macro)),
                         torch.from_numpy(np.ascontiguousarray(obs.micro)))
            self.actions = q.argmax(-1).numpy()
        self.t += 1
        return self.actions, None


def network_of(ck: dict, path: str | Path, sim_cfg: Optional[SimConfig] = None) -> BDQNetwork:
    """The network a loaded checkpoint holds (its config and weights), in eval mode; a
    missing or mismatched part raises CheckpointError naming the file."""
    try:
        net_cfg = net_config_of(ck)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"checkpoint {str(path)!r} has no usable network config: {e}") from e
    if sim_cfg is not None:
        check_platform(ck, sim_cfg, f"checkpoint {str(path)!r}")
        check_fits(net_cfg, sim_cfg, f"checkpoint {str(path)!r}")
    net = BDQNetwork(net_cfg)
    try:
        net.load_state_dict(ck["learner"]["net"])
    except (KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: weights do not match its network config: {e}") from e
    return net.eval()


def load_policy(path: str | Path, sim_cfg: Optional[SimConfig] = None) -> GreedyPolicy:
    ck = load_checkpoint(path)
    net = network_of(ck, path, sim_cfg)
    k = int(ck["config"].get("agent", {}).get("decision_ticks", 1))
    return GreedyPolicy(net, decision_ticks=k, name=f"checkpoint:{Path(path).name}", platform=platform_of(ck))


def config_to_dict(obj) -> dict:
    return dataclasses.asdict(obj)
