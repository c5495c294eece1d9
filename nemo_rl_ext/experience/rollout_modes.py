"""Rollout modes by name: `rollouts.mode` (and `RolloutManager(mode=...)`) picks a registered `RolloutImpl`.

    from nemo_rl_ext.experience.rollout_modes import register_rollout_mode
    register_rollout_mode("my_mode", MyRolloutImpl)     # a RolloutImpl subclass; rollouts.mode: my_mode

`native` (the in-process turn loop) and `nemo_gym` (NeMo Gym agents over HTTP) are registered here.
"""

from __future__ import annotations

from nemo_rl_ext.experience.gym_rollouts import AsyncNemoGymRolloutImpl
from nemo_rl_ext.experience.native_rollouts import AsyncRolloutImpl
from nemo_rl_ext.experience.rollout_impl import RolloutImpl

NATIVE = "native"
"""The in-process generate -> environment step loop (`AsyncRolloutImpl`)."""
NEMO_GYM = "nemo_gym"
"""NeMo Gym agents own the turn loop and the reward (`AsyncNemoGymRolloutImpl`)."""

_MODES: dict[str, type[RolloutImpl]] = {}


def register_rollout_mode(name: str, cls: type[RolloutImpl]) -> type[RolloutImpl]:
    """Make `cls` (a `RolloutImpl` subclass) the rollout mode `name`; re-registering the same class is a no-op,
    another class under a taken name is a ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"rollout mode name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, RolloutImpl)):
        raise TypeError(f"register_rollout_mode({name!r}) needs a RolloutImpl subclass, got {cls!r}")
    known = _MODES.get(name)
    if known is not None and _qualified_name(known) != _qualified_name(cls):
        raise ValueError(f"rollout mode {name!r} is already registered to {_qualified_name(known)}; "
                         f"cannot register {_qualified_name(cls)}")
    _MODES[name] = cls
    return cls


def rollout_mode_class(name: str) -> type[RolloutImpl]:
    """The implementation registered as `name`; an unknown name lists the registered ones (ValueError)."""
    cls = _MODES.get(name)
    if cls is None:
        raise ValueError(f"unknown rollout mode {name!r}; registered modes: {', '.join(available_rollout_modes())}")
    return cls


def available_rollout_modes() -> tuple[str, ...]:
    """The registered mode names, sorted."""
    return tuple(sorted(_MODES))


def mode_name(mode: str | None, use_nemo_gym: bool) -> str:
    """The mode a RolloutManager runs: `mode` when given, else NeMo-RL's `use_nemo_gym` flag as a name
    (a `mode` other than nemo_gym together with `use_nemo_gym=True` is a ValueError)."""
    if mode is None:
        return NEMO_GYM if use_nemo_gym else NATIVE
    if use_nemo_gym and mode != NEMO_GYM:
        raise ValueError(f"RolloutManager: use_nemo_gym=True contradicts mode={mode!r}; give one of them")
    rollout_mode_class(mode)
    return mode


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


register_rollout_mode(NATIVE, AsyncRolloutImpl)
register_rollout_mode(NEMO_GYM, AsyncNemoGymRolloutImpl)
