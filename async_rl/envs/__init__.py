"""Multi-turn environments: the interface users bring (:class:`BaseEnvironment`,
:class:`EnvironmentConfig`), the episode record (:class:`Trajectory`), the registry
(``rollout.env.name``) and the environment processes and the episode runner with their failure isolation."""

from async_rl.envs.base import BaseEnvironment, EnvironmentConfig, Trajectory
from async_rl.envs.registry import ENVIRONMENTS, builtin_names, load_environment, make_environment
from async_rl.envs.runner import EnvEpisode, EnvFailed, EnvLost, EnvPool, EnvStartupError, run_episode

from async_rl.envs import builtin as _builtin  # noqa: E402,F401 - registers the built-in environments

__all__ = [
    "BaseEnvironment",
    "ENVIRONMENTS",
    "EnvEpisode",
    "EnvFailed",
    "EnvLost",
    "EnvPool",
    "EnvStartupError",
    "EnvironmentConfig",
    "Trajectory",
    "builtin_names",
    "load_environment",
    "make_environment",
    "run_episode",
]
