"""Gymnasium front-ends: the env checker, registration, the VectorEnv contract."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import apex_bdq.sim  # noqa: F401  (registers the env id)
from apex_bdq.config import SimConfig
from apex_bdq.sim.gym_env import ENV_ID, PlatformEnv, PlatformVectorEnv
from apex_bdq.sim.platform import ActionError


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_single_shard_env_passes_the_gymnasium_checker():
    env = gym.make(ENV_ID)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    obs2, r, term, trunc, info = env.step(env.action_space.sample())
    assert isinstance(r, float) and term is False and "slo_violation" in info


def test_single_env_is_deterministic_and_rejects_bad_actions():
    D = SimConfig().num_branches

    def roll(seed):
        env = PlatformEnv()
        env.reset(seed=seed)
        return [env.step(np.arange(D) % 5)[1] for _ in range(30)]

    assert roll(4) == roll(4)
    env = PlatformEnv()
    env.reset(seed=0)
    with pytest.raises(ActionError, match=rf"shape \[D={D}\]"):
        env.step(np.array([1, 2]))
    with pytest.raises(ActionError, match="out of range"):
        env.step(np.array([9] + [0] * (D - 1)))


def test_vector_env_contract_and_next_step_autoreset():
    env = PlatformVectorEnv(SimConfig(num_shards=3, episode_s=5.0))
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert env.action_space.shape == (3, SimConfig().num_branches)
    truncs = []
    for _ in range(7):
        obs, r, term, trunc, info = env.step(env.action_space.sample())
        assert r.shape == (3,) and term.shape == (3,) and trunc.shape == (3,)
        truncs.append(bool(trunc.all()))
    # Five ticks, then the autoreset step (reward 0, no truncation), then a fresh episode.
    assert truncs == [False, False, False, False, True, False, False]
    assert env.sim.t == 1
