"""Ctrl-C during training: finish the step, checkpoint, stop."""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class _StopFlag:
    def __init__(self) -> None:
        self.requested = False


@contextmanager
def _graceful_interrupt(acknowledge: Callable[[], None] | None = None) -> Iterator[_StopFlag]:
    """The first SIGINT asks the loop to stop after the current step (a step interrupted halfway
    would leave the device state half updated), said at once by `acknowledge`; a second one
    interrupts at once."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True
        if acknowledge is not None:
            acknowledge()

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)

