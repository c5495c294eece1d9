"""The error a Gym launch raises, apart from the launcher: the CLIs catch it without importing the launcher (and
its HTTP client) at start-up."""

from __future__ import annotations


class GymLaunchError(RuntimeError):
    """Gym could not be started; the message is one line naming the servers, their log files and the error
    their logs end with (`log_tails`: the logs' last lines)."""

    def __init__(self, message: str, log_tails: str = "") -> None:
        super().__init__(message)
        self.log_tails = log_tails
        """The last lines of the logs of the servers concerned ("" when none)."""
