"""Environments that score and continue rollouts, found by name through a registry.

Importing this package registers the built-in environments: "math", "tool_calculator",
"string_match", "guess_number" and "signal_word".
"""

from nemo_rl_ext.environments.grading_pool import GradingUnavailableError
from nemo_rl_ext.environments.guess_number import GuessNumberEnvironment
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Observation
from nemo_rl_ext.environments.math_env import MathEnvironment
from nemo_rl_ext.environments.registry import (
    EnvironmentEntry,
    available_environments,
    create_environment,
    environment_entry,
    register_environment,
)
from nemo_rl_ext.environments.signal_word import SignalWordEnvironment
from nemo_rl_ext.environments.string_match import StringMatchEnvironment
from nemo_rl_ext.environments.tool_env import ToolCalculatorEnvironment

__all__ = [
    "EnvironmentEntry",
    "EnvironmentInterface",
    "EnvironmentReturn",
    "GradingUnavailableError",
    "GuessNumberEnvironment",
    "MathEnvironment",
    "Observation",
    "SignalWordEnvironment",
    "StringMatchEnvironment",
    "ToolCalculatorEnvironment",
    "available_environments",
    "create_environment",
    "environment_entry",
    "register_environment",
]
