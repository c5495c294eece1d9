"""Test doubles shared by the tests, the benchmarks and the scripts: a scripted policy, a sleep-per-token
engine, scripted and failing environments, a math environment whose grading workers are killed, fake NeMo
Gym agent servers, the faults they inject, and the reference forward pass that engine logprobs are checked
against.

They implement the real interfaces (`GenerationInterface`, `EnvironmentInterface`) in full, so a double
works wherever a backend or an environment does; a test's own special behaviour is a parameter or a small
subclass of these, never another copy. A stand-in for vLLM's engine (`testing.vllm_engine`) is imported from
its module (it imports the vLLM backend).
"""

from nemo_rl_ext.testing.environments import FailingEnvironment, RolloutStep, ScriptedEnvironment
from nemo_rl_ext.testing.faults import Fault
from nemo_rl_ext.testing.grading import KilledGradingMathEnvironment
from nemo_rl_ext.testing.gym_agents import FakeAgents, UnusedPolicy
from nemo_rl_ext.testing.reference import forward_logprobs
from nemo_rl_ext.testing.scripted_generation import ScriptedCall, ScriptedGeneration, ScriptedRequest
from nemo_rl_ext.testing.sleep_engine import LongTail, SleepGeneration, make_sleep_engine

__all__ = [
    "FailingEnvironment",
    "FakeAgents",
    "Fault",
    "KilledGradingMathEnvironment",
    "LongTail",
    "RolloutStep",
    "ScriptedCall",
    "ScriptedEnvironment",
    "ScriptedGeneration",
    "ScriptedRequest",
    "SleepGeneration",
    "UnusedPolicy",
    "forward_logprobs",
    "make_sleep_engine",
]
