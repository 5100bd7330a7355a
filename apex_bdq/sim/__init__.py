"""Trace-driven platform simulator (numpy, no Ray)."""

import gymnasium as _gym

from apex_bdq.sim.platform import ActionError, Observation, PlatformSim  # noqa: F401
from apex_bdq.sim.trace import TraceError, load_trace  # noqa: F401

if "apex_bdq/Platform-v0" not in _gym.registry:
    _gym.register(id="apex_bdq/Platform-v0", entry_point="apex_bdq.sim.gym_env:PlatformEnv",
                  max_episode_steps=None)
