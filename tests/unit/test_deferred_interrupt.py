"""The driver's wait turns the stop button into a count and gives the handler back after."""

from __future__ import annotations

import os
import signal

import pytest

from nbaccel.notebook.kernel.deferred_interrupt import DeferredInterrupt


def test_sigint_is_counted_inside_and_the_previous_handler_is_back_after():
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGINT, previous)
    try:
        with DeferredInterrupt() as interrupt:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.count == 2 and seen == []
        assert signal.getsignal(signal.SIGINT) is previous
        os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("before", [signal.SIG_IGN, signal.SIG_DFL, signal.default_int_handler])
def test_the_builtin_handlers_are_restored_as_they_were(before):
    old = signal.signal(signal.SIGINT, before)
    try:
        with DeferredInterrupt():
            assert signal.getsignal(signal.SIGINT) not in (before,)
        assert signal.getsignal(signal.SIGINT) == before
    finally:
        signal.signal(signal.SIGINT, old)
