"""Trace-driven platform simulator (numpy, no Ray).

`make_sim(cfg, ...)` builds the simulator of `cfg.platform`: `PlatformSimV2` (one pool per
class, the default) or `PlatformSim` (v1, kept for checkpoints trained on it). Both take the
same arguments (split, rates, copy_obs, eval_replicas, phases) and return the same
`Observation` and info keys.
"""

import gymnasium as _gym

from apex_bdq.sim.platform import ActionError, Observation, PlatformSim  # noqa: F401
from apex_bdq.sim.platform_v2 import PlatformSimV2  # noqa: F401
from apex_bdq.sim.trace import TraceError, load_trace  # noqa: F401


def make_sim(cfg, **kwargs):
    """The simulator of `cfg.platform` ("v2" or "v1"). `warmup_ticks` (v2 only) starts evenly
    phased shards that many ticks early."""
    if cfg.platform == "v2":
        return PlatformSimV2(cfg, **kwargs)
    if kwargs.pop("warmup_ticks", 0):
        raise ValueError("warmup_ticks is a platform v2 option")
    return PlatformSim(cfg, **kwargs)


def observation_sizes(cfg) -> tuple[int, int]:
    """(macro features, micro features per class and tick) of `cfg.platform`."""
    if cfg.platform == "v2":
        from apex_bdq.sim.platform_v2 import MICRO_FEATURES_V2, macro_names
        return len(macro_names(cfg)), len(MICRO_FEATURES_V2)
    from apex_bdq.sim.platform import MACRO_FEATURES, MICRO_FEATURES
    return len(MACRO_FEATURES), len(MICRO_FEATURES)


if "apex_bdq/Platform-v0" not in _gym.registry:
    _gym.register(id="apex_bdq/Platform-v0", entry_point="apex_bdq.sim.gym_env:PlatformEnv",
                  max_episode_steps=None)
