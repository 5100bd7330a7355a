"""Gymnasium front-ends of the platform simulator (`make_sim`: v2 or v1), so other RL
libraries can use it.

- `PlatformVectorEnv`: a `gymnasium.vector.VectorEnv` over the S shards of one simulator
  (MultiDiscrete actions, Dict observations {"macro", "micro"}), autoreset NEXT_STEP.
- `PlatformEnv`: one shard as a `gymnasium.Env`, registered as ``apex_bdq/Platform-v0``.
"""

from __future__ import annotations

from typing import Any, Optional

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from apex_bdq.config import SimConfig
from apex_bdq.sim import make_sim, observation_sizes

ENV_ID = "apex_bdq/Platform-v0"


def observation_space(cfg: SimConfig) -> spaces.Dict:
    fm, fu = observation_sizes(cfg)
    return spaces.Dict({
        "macro": spaces.Box(-np.inf, np.inf, shape=(fm,), dtype=np.float32),
        "micro": spaces.Box(-np.inf, np.inf, shape=(cfg.num_classes, cfg.history, fu), dtype=np.float32),
    })


def action_space(cfg: SimConfig) -> spaces.MultiDiscrete:
    return spaces.MultiDiscrete(np.full(cfg.num_branches, cfg.sub_actions, dtype=np.int64))


class PlatformVectorEnv(VectorEnv):
    """S shards of one vectorised simulator behind the gymnasium VectorEnv API."""

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(self, cfg: SimConfig = SimConfig(), split: str = "train", copy: bool = True) -> None:
        self.sim = make_sim(cfg, split=split, copy_obs=copy)
        self.cfg = cfg
        self.num_envs = cfg.num_shards
        self.single_observation_space = observation_space(cfg)
        self.single_action_space = action_space(cfg)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self._needs_reset = False

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        obs = self.sim.reset(seed=seed)
        self._needs_reset = False
        return {"macro": obs.macro, "micro": obs.micro}, {}

    def step(self, actions):
        S = self.num_envs
        if self._needs_reset:
            # NEXT_STEP autoreset: the step after an episode end resets and ignores actions.
            obs, _ = self.reset()
            zeros = np.zeros(S, dtype=bool)
            return obs, np.zeros(S), zeros, zeros.copy(), {}
        obs, reward, truncated, info = self.sim.step(actions)
        self._needs_reset = truncated
        infos = {k: v for k, v in info.items() if v is not None}
        return ({"macro": obs.macro, "micro": obs.micro}, reward, np.zeros(S, dtype=bool),
                np.full(S, truncated), infos)


class PlatformEnv(gym.Env):
    """One platform shard as a plain gymnasium Env."""

    metadata = {"render_modes": []}

    def __init__(self, cfg: Optional[SimConfig] = None, split: str = "train", **overrides: Any) -> None:
        cfg = (cfg or SimConfig()).replace(num_shards=1, **overrides)
        self.cfg = cfg
        self.sim = make_sim(cfg, split=split)
        self.observation_space = observation_space(cfg)
        self.action_space = action_space(cfg)

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        if seed is None and not hasattr(self, "_seeded"):
            seed = self.cfg.seed
        self._seeded = True
        obs = self.sim.reset(seed=seed)
        return {"macro": obs.macro[0], "micro": obs.micro[0]}, {}

    def step(self, action):
        a = np.asarray(action)
        if a.shape != (self.cfg.num_branches,):
            from apex_bdq.sim.platform import ActionError
            raise ActionError(f"action must have shape [D={self.cfg.num_branches}] "
                              f"(branches {self.cfg.branch_names}), got {a.shape}")
        obs, reward, truncated, info = self.sim.step(a[None])
        one = {k: (v[0] if isinstance(v, np.ndarray) else v) for k, v in info.items() if v is not None}
        return ({"macro": obs.macro[0], "micro": obs.micro[0]}, float(reward[0]), False, bool(truncated), one)
