"""Preemption: on SIGTERM, finish the save in flight, save the newest state, then exit with the signal's status.

Apart from the manager so that the rules about when the handler may run are in one place: the handler runs once (a
second SIGTERM while it runs is ignored), and a signal that arrives while the main thread is inside a manager call
that saves or waits is handled when the outermost such call returns (never a save inside a save).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

__all__ = ["SigtermSave", "StateAndStep"]

#: The user's callback: the step and the state to save at preemption.
StateAndStep = Callable[[], tuple[int, Mapping[str, Any]]]


class SigtermSave:
    """The SIGTERM handling of one manager. ``finish(state_and_step)`` is the manager's work on a signal: wait for
    the save in flight, then save ``state_and_step()`` synchronously; afterwards the process exits by the signal."""

    def __init__(self, finish: Callable[[StateAndStep], None]) -> None:
        self._finish = finish
        self._callback: StateAndStep | None = None  # save_on_sigterm's callback (None: not installed)
        self._signalled: int | None = None  # the signal being handled
        self._deferring = 0  # deferred() blocks in progress on the main thread: a signal waits for them
        self._terminating = False

    def install(self, state_and_step: StateAndStep) -> None:
        """Handle SIGTERM from now on (call from the main thread)."""
        def handler(signum: int, frame: FrameType | None) -> None:
            if self._signalled is not None:
                return  # a second signal while the first is handled (or about to be): ignored
            self._signalled = signum
            if self._deferring:
                return  # inside a deferred() block: it finishes first, then terminates
            self._terminate(signum, state_and_step)

        self._callback = state_and_step
        signal.signal(signal.SIGTERM, handler)

    def _terminate(self, signum: int, state_and_step: StateAndStep) -> None:
        """The handler's work: the manager's ``finish``, then exit with ``signum``. If ``finish`` fails the error
        propagates and a later signal is handled again."""
        self._terminating = True
        try:
            self._finish(state_and_step)
        except BaseException:
            self._signalled, self._terminating = None, False
            raise
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Around the manager's ``save`` and ``wait`` on the main thread: a SIGTERM that arrives meanwhile is handled
        when the outermost of them returns (or fails), so the handler never runs a save inside a save nor misses the
        save in flight that ``wait`` has taken over."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            signum = self._signalled
            if not self._deferring and signum is not None and not self._terminating and self._callback is not None:
                self._terminate(signum, self._callback)
