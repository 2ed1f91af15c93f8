"""A rank's one background thread: it notices the driver hang up, and does periodic duties
while calls run (a notebook's memory sampler).

A rank's main thread reads its calls itself (see :mod:`nbaccel.launch.rank.worker`), so this thread
sleeps in ``poll`` on the driver's connection without asking to read: messages do not wake it,
a hang-up does, even while a call runs. Duties are registered with :func:`every`; one thread
serves them all (a thread costs a forked rank page faults on the thread-local storage of
torch's libraries as it starts). Between calls it looks every ``_LOOK`` seconds while
calls come in quick succession (a call's start then wakes no thread), and sleeps once none came
for ``_SLEEP_AFTER`` seconds (an idle pool's ranks wake for nothing); a call's start wakes it
only then. Without duties it only waits for the hang-up.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WATCHER", "call_ended", "call_started", "every", "start"]

WATCHER = "nbaccel-rank-watch"  # the thread's name
_LOOK = 0.05  # s between looks for a new call while calls come quickly
_SLEEP_AFTER = 2.0  # s without a call after which the thread sleeps until the next one
# what ``poll`` reports when the driver's end closes: POLLRDHUP (Linux) says so for TCP too
_RDHUP = getattr(select, "POLLRDHUP", 0)
_HANGUP = _RDHUP | select.POLLHUP | select.POLLERR


@dataclass
class _Duty:
    hook: Callable[[], None]
    first: float  # s into a call
    interval: float  # s between runs after the first
    due: float | None = None  # when it runs next during the current call


class _State:
    """The watcher's state in this rank process: written by the main thread without waking
    the watcher (except from its sleep)."""

    def __init__(self) -> None:
        self.started: float | None = None  # the running call's start (None between calls)
        self.calls = 0  # calls begun so far: quick ones end before the watcher looks
        self.sleeping = False
        self.duties: list[_Duty] = []
        self.wake_r = self.wake_w = -1


_state = _State()  # the one watcher of this process holds it


def every(hook: Callable[[], None], first: float, interval: float) -> None:
    """Run ``hook()`` on the watcher thread while a call runs: ``first`` seconds into it, then
    every ``interval`` seconds. A hook that raises is dropped."""
    _state.duties.append(_Duty(hook, first, interval))
    _wake()  # a sleeping watcher takes up its new duty


def call_started() -> None:
    """The main thread begins a call."""
    _state.started = time.monotonic()
    _state.calls += 1
    if _state.sleeping:
        _wake()


def call_ended() -> None:
    """The main thread ended its call."""
    _state.started = None


def _wake() -> None:
    if _state.wake_w >= 0:
        try:
            os.write(_state.wake_w, b"\0")
        except BlockingIOError:  # already awake or about to be
            pass


def start(sock: socket.socket, on_hangup: Callable[[], None]) -> threading.Thread:
    """Start the watcher on the driver's connection ``sock``; ``on_hangup()`` when it closes."""
    _state.wake_r, _state.wake_w = os.pipe()  # not inherited by what the rank starts
    os.set_blocking(_state.wake_r, False)
    os.set_blocking(_state.wake_w, False)
    thread = threading.Thread(target=_run, args=(sock, on_hangup), daemon=True, name=WATCHER)
    thread.start()
    return thread


def _run(sock: socket.socket, on_hangup: Callable[[], None]) -> None:
    poller = select.poll()
    poller.register(sock.fileno(), _HANGUP)
    poller.register(_state.wake_r, select.POLLIN)
    last_call, seen = time.monotonic(), 0
    while True:
        timeout = _next_timeout(last_call, seen)
        if timeout is not None and not _RDHUP:
            timeout = min(timeout, 1.0)  # no hang-up report here: look once a second
        for fd, flags in poller.poll(None if timeout is None else timeout * 1000):
            if fd == _state.wake_r:
                while True:
                    try:
                        os.read(_state.wake_r, 64)
                    except BlockingIOError:
                        break
            elif flags & select.POLLNVAL:
                return  # this process closed the connection itself: it is on its way out
            else:
                on_hangup()
        if not _RDHUP and _peer_closed(sock):
            on_hangup()
        _state.sleeping = False
        if _state.calls != seen:
            last_call, seen = time.monotonic(), _state.calls
            for duty in _state.duties:
                duty.due = None  # a new call: its own first run
        _run_due()


def _next_timeout(last_call: float, seen: int) -> float | None:
    """Seconds until something is due; None to sleep until woken (or the hang-up)."""
    if not _state.duties:
        return None
    started, now = _state.started, time.monotonic()
    if started is None:
        if now - last_call < _SLEEP_AFTER:
            return _LOOK
        _state.sleeping = True
        if _state.started is None and _state.calls == seen:
            return None  # checked after saying so: no call's start goes unseen
        return 0.0
    dues = [d.due if d.due is not None else started + d.first for d in _state.duties]
    return max(0.0, min(dues) - now)


def _run_due() -> None:
    started, now = _state.started, time.monotonic()
    if started is None:
        return
    for duty in list(_state.duties):
        if duty.due is None:
            duty.due = started + duty.first
        if now < duty.due:
            continue
        try:
            duty.hook()
        except Exception:  # the driver went away or a backend failed: stop this duty quietly
            _state.duties.remove(duty)
            continue
        duty.due = time.monotonic() + duty.interval


def _peer_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
