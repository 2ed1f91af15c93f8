"""One attempt of a detached run, in its own process: ``python -m ... runner FOLDER``.

The supervisor starts it with the launching process's interpreter, environment and working
directory (``launch.json``). It runs the folder's work through the normal launch engine
(:func:`nbaccel.launch.run.run_function`, restarts included) with a
:class:`~nbaccel.launch.detached.recorder.RecordingRenderer`, then writes the call report to
``result.pkl`` and the final state to ``run.json``. Its stdin is a pipe from the supervisor:
when the supervisor goes, the pipe closes and the run is stopped as the stop button stops a
launch (SIGINT), marked as stopped because its supervisor ended. SIGINT is the stop request,
SIGTERM too; SIGUSR2 writes every thread's stack to ``runner.log``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import traceback
from typing import Any

from nbaccel.launch.detached.folder import RunFolder, RunState

__all__ = ["main", "run_attempt"]

#: why this attempt is being stopped, when it is nobody's stop request
_SUPERVISOR_GONE = "its supervisor ended"


class _Stop:
    """Why the attempt is being stopped (set before SIGINT reaches the main thread)."""

    reason = "stopped"


def _watch_supervisor(stop: _Stop) -> None:
    """Stop the run when the supervisor's pipe (our stdin) closes."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    stop.reason = _SUPERVISOR_GONE
    os.kill(os.getpid(), signal.SIGINT)


def _on_term(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _prepare(folder: RunFolder) -> None:
    """This process as the launching one was: its sys.path; full logs into the folder."""
    launch = folder.read_json("launch.json")
    for entry in reversed(launch.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    logs = folder.file("logs")
    logs.mkdir(mode=0o700, exist_ok=True)
    os.environ["NBACCEL_LOG_DIR"] = str(logs)
    os.environ["NBACCEL_KEEP_LOGS"] = "1"


def run_attempt(folder: RunFolder, stop: _Stop) -> None:
    """Run the folder's work once (with its own restarts); record the outcome."""
    import time

    from nbaccel.launch.detached.recorder import RecordingRenderer
    from nbaccel.launch.driver.loop import CallState
    from nbaccel.launch.plan import LaunchPlan
    from nbaccel.launch.request import Front
    from nbaccel.launch.run import run_function
    from nbaccel.launch.wire.errors import failure_text

    info = folder.info()
    attempt = info.attempts + 1
    folder.file("result.pkl").unlink(missing_ok=True)  # the last attempt's: not this one's
    folder.update(state=RunState.RUNNING, runner_pid=os.getpid(), attempts=attempt,
                  ended=None, reason="")  # fmt: skip
    renderer = RecordingRenderer(folder)
    state, reason, result = RunState.FAILED, "", None
    try:
        if attempt > 1:
            renderer.notice(f"resumed: attempt {attempt}, the same function and arguments on "
                            "fresh ranks.")  # fmt: skip
        work = folder.read_pickle("work.pkl")
        request = work["request"]
        plan = LaunchPlan.create(Front.LAUNCHER, request)
        folder.update(num_processes=plan.num_processes)
        report = run_function(
            plan,
            work["function"],
            work["args"],
            work.get("kwargs") or {},
            renderer=renderer,
            setup=work.get("setup", ()),
            preload=work.get("preload", ()),
            timeout=request.timeout,
            max_restarts=request.max_restarts,
            interval=request.monitor_interval,
        )
        if report.state == CallState.INTERRUPTED:
            state, reason, result = RunState.STOPPED, stop.reason, {"stopped": stop.reason}
        else:
            failure = report.exception()
            state = RunState.FINISHED if failure is None else RunState.FAILED
            reason = "" if failure is None else failure_text(failure)
            result = {"report": report}
    except KeyboardInterrupt:
        state, reason, result = RunState.STOPPED, stop.reason, {"stopped": stop.reason}
    except BaseException as exc:  # the launch could not run: keep why, for result()
        traceback.print_exc()
        state, reason, result = RunState.FAILED, f"{type(exc).__name__}: {exc}", {"error": exc}
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the outcome is being written: keep it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        renderer.close()
        if result is not None:
            try:
                folder.write_pickle("result.pkl", result)
            except Exception as exc:  # an unpicklable result: say so instead
                traceback.print_exc()
                lost = RuntimeError(f"the run ended ({state}); its result could not be kept: {exc}")
                folder.write_pickle("result.pkl", {"error": lost})
        folder.update(state=state, reason=reason.splitlines()[0][:300] if reason else "",
                      ended=time.time(), runner_pid=None)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the attempt of the folder given as the only argument."""
    argv = sys.argv[1:] if argv is None else argv
    folder = RunFolder(argv[0])
    stop = _Stop()
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # runner.log: where it is stuck
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_watch_supervisor, args=(stop,), daemon=True).start()
    try:
        _prepare(folder)
        run_attempt(folder, stop)
    except KeyboardInterrupt:  # stopped before the attempt began: say so, nobody else may
        import time

        if not folder.info().ended_:
            folder.update(state=RunState.STOPPED, reason=stop.reason, ended=time.time(),
                          runner_pid=None)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
