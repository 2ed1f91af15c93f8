"""The kernel's handle on a node's agent that a Ray actor runs: what ``warm.py`` asks of the
``ssh``/``srun`` process it keeps for each host (``poll``, ``wait``, ``kill``, ``terminate``).

A thread waits on the actor's ``wait_agent`` call: it returns when the agent exits, and fails
at once when the actor is gone (killed, OOM-killed, or its node's raylet died: Ray says so in
about two seconds), which counts the node's agent, and the ranks on it, lost.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections import deque
from typing import Any

from nbaccel.launch.wire.tracebacks import safe_message

__all__ = ["ActorPopen"]


class ActorPopen:
    """The agent run by ``keeper`` on node ``node``; ``tail`` gets its last lines when it ends."""

    stdin = None  # its stdin is the keeper's to hold: closing it is ending the keeper
    stdout = None

    def __init__(self, ray: Any, keeper: Any, node: str, tail: deque) -> None:
        self._ray = ray
        self._keeper = keeper
        self.node = node
        self.tail = tail
        self.returncode: int | None = None
        self._ended = ray_call(keeper.wait_agent)
        self._thread = threading.Thread(target=self._wait, daemon=True, name="nbaccel-ray-agent")
        self._thread.start()

    def _wait(self) -> None:
        code = -int(signal.SIGKILL)  # unless the agent's own exit code comes back
        try:
            code, lines = self._ray.get(self._ended)
            self.tail.extend(lines)
        except BaseException as exc:  # the actor is gone (or Ray was shut down in this process)
            text = safe_message(exc).strip()
            first = text.splitlines()[0] if text else ""
            self.tail.append(
                f"its Ray actor on {self.node} is gone ({type(exc).__name__}: {first[:200]})"
            )
        finally:  # whatever ended the wait, the handle reads as ended: wait() relies on it
            self.returncode = code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(f"agent on {self.node}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            ray_call(self._keeper.signal_agent, int(sig))

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def ray_call(method: Any, *args: Any) -> Any:
    """``method.remote(*args)``: an actor call, its result to ``ray.get`` (or to drop)."""
    return method.remote(*args)
