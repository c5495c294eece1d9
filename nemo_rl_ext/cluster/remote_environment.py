"""`RemoteEnvironment`: an environment hosted in a Ray actor, its step deadline enforced by the caller.

An environment that can hang or crash (a grader, a sandbox) runs in its own actor; cheap ones stay
in-process (the caller chooses per environment). A step past `step_timeout_s` kills the actor (the hung
call cannot be interrupted from inside) and starts a fresh one, then raises TimeoutError: the rollout's
fault policy decides what the failed step does. A dead actor is restarted the same way, up to
`max_restarts` times in a row. A new actor's start (its process, its imports, the environment's constructor)
is bounded by `ready_timeout_s`, not by the step deadline: the next call waits for it, then its step gets the
whole `step_timeout_s`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn

if TYPE_CHECKING:
    from nemo_rl_ext.data.records import Message

logger = logging.getLogger(__name__)

EnvironmentFactory = Callable[[], EnvironmentInterface]
"""Builds the environment inside the actor; must pickle (a module-level function or a partial)."""


class _EnvironmentHost:
    """The actor's object: one environment."""

    def __init__(self, factory: EnvironmentFactory) -> None:
        self.env = factory()

    def ready(self) -> bool:
        return True

    async def step(self, message_logs: Any, metadata: Any) -> EnvironmentReturn:
        return await self.env.step(message_logs, metadata)

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        return await self.env.vote_keys(answers)

    def shutdown(self) -> None:
        self.env.shutdown()


def _registered(name: str, kwargs: Mapping[str, Any]) -> EnvironmentInterface:
    # lazy: the environment registry imports every implementation
    from nemo_rl_ext.environments import create_environment

    return create_environment(name, **kwargs)


class RemoteEnvironment(EnvironmentInterface):
    """Forwards `step` / `vote_keys` to an actor; kills and restarts it when a call passes `step_timeout_s`.

    `owns_ray`: `shutdown` also ends Ray (the builder started it for this environment alone).
    """

    def __init__(
        self,
        factory: EnvironmentFactory,
        *,
        step_timeout_s: float = 300.0,
        max_restarts: int = 3,
        num_cpus: float = 0.0,
        ready_timeout_s: float = 300.0,
        owns_ray: bool = False,
    ) -> None:
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        if not ray.is_initialized():
            raise RuntimeError("RemoteEnvironment needs Ray: call nemo_rl_ext.cluster.init_ray(cfg) first")
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        self._ray = ray
        self._factory = factory
        self.step_timeout_s = step_timeout_s
        self.max_restarts = max_restarts
        self._actor_class = ray.remote(_EnvironmentHost).options(num_cpus=num_cpus, max_restarts=0)
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0
        """Actors replaced so far (after a timeout or a death)."""
        self.timeouts = 0
        """Calls that passed `step_timeout_s`."""
        self._failures_in_a_row = 0
        self._owns_ray = owns_ray
        self.ready_timeout_s = ready_timeout_s
        self._starting: Any = None
        """The `ready` call of an actor `_replace` started, until it has answered."""
        self._actor = self._actor_class.remote(factory)
        try:
            ray.get(self._actor.ready.remote(), timeout=ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_registry(cls, name: str, env_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> RemoteEnvironment:
        """The registered environment `name`, built with `env_kwargs` inside the actor."""
        return cls(functools.partial(_registered, name, dict(env_kwargs or {})), **kwargs)

    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        return await self._call("step", list(message_logs), list(metadata))

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        return await self._call("vote_keys", list(answers))

    async def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise RuntimeError("RemoteEnvironment was shut down")
        actor = self._actor
        await self._until_ready(actor)
        ref = getattr(actor, method).remote(*args)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.step_timeout_s)
        except TimeoutError:
            self.timeouts += 1
            self._replace(actor, f"{method} passed its {self.step_timeout_s:g}s deadline")
            raise TimeoutError(
                f"environment {method} took longer than {self.step_timeout_s:g}s; its actor was killed and restarted"
            ) from None
        except asyncio.CancelledError:
            self._ray.cancel(ref)
            raise
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorUnavailableError) as exc:
            self._replace(actor, f"its actor died ({type(exc).__name__})")
            raise RuntimeError(f"environment actor died during {method}; it was restarted") from exc
        self._failures_in_a_row = 0
        return result

    async def _until_ready(self, actor: Any) -> None:
        """Wait (up to `ready_timeout_s`) for `actor` to finish starting, if `_replace` started it."""
        starting = self._starting
        if starting is None:
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(starting.future()), self.ready_timeout_s)
        except TimeoutError:
            self._replace(actor, f"its new actor did not start within {self.ready_timeout_s:g}s")
            raise RuntimeError(f"environment actor did not start within {self.ready_timeout_s:g}s; "
                               "it was restarted") from None
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorUnavailableError) as exc:
            self._replace(actor, f"its new actor died while starting ({type(exc).__name__})")
            raise RuntimeError("environment actor died while starting; it was restarted") from exc
        with self._lock:
            if self._starting is starting:
                self._starting = None

    def _replace(self, actor: Any, why: str) -> None:
        """Kill `actor` (if still the current one) and start a fresh one, up to `max_restarts` in a row."""
        with self._lock:
            if actor is not self._actor or self._closed:
                return
            self._ray.kill(actor, no_restart=True)
            self._failures_in_a_row += 1
            if self._failures_in_a_row > self.max_restarts:
                self._closed = True
                logger.error("remote environment taken out: %s, %d times in a row", why, self._failures_in_a_row)
                return
            self.restarts += 1
            logger.warning("remote environment: %s; killed its actor and started a new one", why)
            self._actor = self._actor_class.remote(self._factory)
            self._starting = self._actor.ready.remote()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed and self._actor is None:
                return
            self._closed = True
            actor, self._actor = self._actor, None
        if actor is not None:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._owns_ray:  # this environment's builder started Ray: nothing else uses it
            self._owns_ray = False
            self._ray.shutdown()
