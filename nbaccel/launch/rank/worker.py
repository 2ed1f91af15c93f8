"""The rank side of a launch: connect back, redirect output, run the work, report.

A worker connects three authenticated streams to the driver: its fd 1 and fd 2 (so C extensions'
writes reach the notebook too, line by line) and an event stream. It then either runs one call
(``Mode.CALL``: a one-shot launch) or serves calls until told to stop (``Mode.SERVE``: a
persistent pool). What it is told arrives as a :class:`~nbaccel.launch.wire.spec.WorkerSpec`. When
the driver disappears (the kernel died or restarted), the event stream closes and the worker
exits at once: no orphans.

The main thread reads the driver's messages itself between calls (a call costs no thread
switch); the rank's one background thread (:mod:`nbaccel.launch.rank.watch`) notices the
driver's end hang up, even while a call runs.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import io
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from nbaccel.launch.rank import notebook_state
from nbaccel.launch.rank import watch as rank_watch
from nbaccel.launch.wire.channel import Connection, connect
from nbaccel.launch.wire.errors import describe_exception
from nbaccel.launch.wire.protocol import STACKS_SIGNAL, EventKind, Message, Stream
from nbaccel.launch.wire.spec import Mode, WorkerSpec, load_work
from nbaccel.launch.wire.transport import SharedTensors, on_the_wire, pack, unpack
from nbaccel.launch.wire.unpicklable import ResultNotSendable, UnpicklableError

__all__ = [
    "after_each_call",
    "before_each_call",
    "current_rank",
    "emit",
    "flush_output",
    "on_worker",
    "run_worker",
]

_events: Connection | None = None
_send_lock = threading.Lock()
_held: list[Any] | None = None  # main-thread messages held until a call's outcome
_main_thread: int | None = None  # the ident of the thread that serves calls (run_worker's)
_rank: int | None = None
_EXIT_DRIVER_GONE = 70
_shared_results = True  # the driver can map this host's shared files (same host, no relay)
# shared files of results the driver may not have taken yet: this rank holds their lock (a sweep
# reclaims them if it dies) until its next call or its exit
_result_files: list[SharedTensors] = []
_NONE = on_the_wire(pack(None)[0])  # a None result, packed once
_sigint_at: float | None = None  # when SIGINT last arrived (None: not during this call)
# what the main thread waits for, if anything: between calls an interrupt has nothing to stop
# (and must not cost the message being read); after a one-shot launch's call it ends the wait
_waiting: str | None = None
_BETWEEN_CALLS, _FOR_RELEASE = "between calls", "for release"


def on_worker() -> bool:
    """True inside a process started by nbaccel's launcher or pool."""
    return _events is not None


def current_rank() -> int | None:
    return _rank


def emit(kind: EventKind, payload: Any) -> None:
    """Send an event (progress, memory sample, display bundle...) to the notebook.

    A no-op outside nbaccel workers, so instrumented code runs anywhere.
    """
    if _events is None:
        return
    _send((Message.EVENT, EventKind(kind), payload))


def _send(message: Any) -> None:
    with _send_lock:
        if _held is not None and threading.get_ident() == _main_thread:
            _held.append(message)  # leaves with the call's outcome (see _end_call)
            return
        _events.send(message)


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    fflush = _c_fflush()
    if fflush is not None:
        fflush(None)  # C-level stdio buffers of extensions


@functools.cache
def _c_fflush() -> Callable[[Any], int] | None:
    """libc's ``fflush`` (looked up once: a ``CDLL`` costs a dlopen and a class per call)."""
    try:
        return ctypes.CDLL(None).fflush
    except (OSError, AttributeError):
        return None


def flush_output() -> None:
    """Push what this rank printed so far (Python and C-level buffers) to the driver, so that
    an event sent next arrives after it."""
    _flush_all()


def _redirect(fd: int, conn: Connection) -> io.TextIOWrapper:
    os.dup2(conn.fileno(), fd)
    conn.close()
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="replace", line_buffering=True
    )


def _prepare_process(spec: WorkerSpec) -> list[str]:
    """Make this process the rank ``spec`` describes; what of the notebook's state could not be
    restored (said on stderr once it reaches the notebook)."""
    for name in [name for name in os.environ if name not in spec.env]:
        del os.environ[name]
    for name, value in spec.env.items():  # only what differs: each change is a putenv
        if os.environ.get(name) != value:
            os.environ[name] = value
    sys.path[:] = spec.sys_path
    sys.argv[:] = spec.argv or [""]  # Python always has argv[0]
    try:
        os.chdir(spec.cwd)
    except OSError:
        pass
    import torch

    torch.set_num_threads(spec.threads)
    return notebook_state.apply(spec.notebook_state)


def _driver_gone() -> None:
    """The driver's connection closed (the kernel died or restarted): exit now."""
    _flush_all()
    _drop_results()
    os._exit(_EXIT_DRIVER_GONE)


def _next_message(waiting: str) -> Any:
    """The driver's next message, read on the main thread (see ``_waiting``)."""
    global _waiting
    _waiting = waiting
    try:
        return _events.recv()
    except (EOFError, OSError):
        _driver_gone()


def _on_sigint(signum: int, frame: Any) -> None:
    """The stop button (or the driver) interrupted this rank: remember that it was a signal, so
    a ``KeyboardInterrupt`` raised by the rank's own code is not taken for the stop button."""
    global _sigint_at
    import time

    if _waiting == _BETWEEN_CALLS:
        return  # nothing to stop; the stop button's driver sees this rank is idle
    _sigint_at = time.time()
    raise KeyboardInterrupt


def _drop_results() -> None:
    """Remove the shared files of earlier results (taken by the driver, or never to be)."""
    while _result_files:
        _result_files.pop().release()


def _report_error(call_id: int, exc: BaseException) -> None:
    info = describe_exception(exc)
    if isinstance(exc, KeyboardInterrupt):
        info["signalled"] = _sigint_at is not None
    _send((Message.ERROR, call_id, info))


_before_call: list[Callable[[], None]] = []
_after_call: list[Callable[[], None]] = []


def before_each_call(hook: Callable[[], None]) -> None:
    """Run ``hook()`` on this rank just before each call starts (a sampler wakes up)."""
    if hook not in _before_call:
        _before_call.append(hook)


def after_each_call(hook: Callable[[], None]) -> None:
    """Run ``hook()`` on this rank when each call ends, before its result or error is sent
    (worker hooks use it for a last event, e.g. a final memory sample, that quick calls would
    otherwise never send)."""
    if hook not in _after_call:
        _after_call.append(hook)


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception:  # a hook's failure must not replace the call's own outcome
            pass


def _run_call(call_id: int, function: Callable, args: tuple, kwargs: dict) -> bool:
    global _sigint_at
    if _result_files:
        _drop_results()
    _sigint_at = None
    rank_watch.call_started()
    if _before_call:
        _run_hooks(_before_call)
    try:
        value = function(*args, **kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):  # sys.exit(3): a failure with its code
            return _end_call(call_id, error=exc)
        value = None  # sys.exit(0) / exit(): the function is done, successfully
    except BaseException as exc:
        return _end_call(call_id, error=exc)
    return _end_call(call_id, value=value)


def _end_call(call_id: int, value: Any = None, error: BaseException | None = None) -> bool:
    """Run the after-call hooks, flush the output, report the outcome. The hooks' events and
    the outcome leave in one write: a quick call on many ranks costs the driver one wake-up
    per rank, not two."""
    global _held
    _held = []
    rank_watch.call_ended()
    try:
        if _after_call:
            _run_hooks(_after_call)
        _flush_all()
        if error is not None:
            _report_error(call_id, error)
            return False
        return _send_result(call_id, value)
    finally:
        held, _held = _held, None
        if held:
            with _send_lock:
                _events.send_many(held)


def _send_result(call_id: int, value: Any) -> bool:
    """Send the return value; large CPU tensors in it travel through a shared file that the
    driver maps (``transport.take``), written once here, never copied through the socket."""
    if value is None:  # a cell or a function that returns nothing: the same bytes each time
        _send((Message.RESULT, call_id, _NONE))
        return True
    try:
        packed, shared = pack(
            value, name=ResultNotSendable.value_name, share=_shared_results, toward="notebook"
        )
    except UnpicklableError as exc:
        error = ResultNotSendable(f"the function succeeded, but {exc}")
        error.where, error.culprit, error.cause = exc.where, exc.culprit, exc.cause
        _send((Message.ERROR, call_id, describe_exception(error)))
        return False
    if shared is not None and shared.path is not None:
        _result_files.append(shared)
    _send((Message.RESULT, call_id, on_the_wire(packed)))
    return True


def _serve() -> int:
    global _waiting
    while True:
        message = _next_message(_BETWEEN_CALLS)
        if message[0] == Message.STOP:
            return 0
        if message[0] != Message.CALL:
            continue
        _, call_id, packed = message
        try:
            _waiting = None  # from here the stop button stops this call
            try:
                function, args, kwargs = unpack(packed)
            except BaseException as exc:
                _send((Message.ERROR, call_id, describe_exception(exc)))
                continue
            _run_call(call_id, function, args, kwargs)
        except KeyboardInterrupt as exc:  # raised between the call and its report
            _report_error(call_id, exc)


def _report_no_connection(spec: WorkerSpec, exc: BaseException) -> None:
    """This rank cannot reach the driver: leave the reason where the driver looks for it."""
    where = spec.address.location
    text = f"it could not connect to the notebook's channel at {where}: {type(exc).__name__}: {exc}"
    if spec.error_path:
        try:
            with open(spec.error_path, "w") as handle:
                handle.write(text)
        except OSError:
            pass
    print(f"[nbaccel] rank {spec.rank}: {text}", file=sys.stderr, flush=True)


def _connect_streams(
    address: Any, secret: bytes, header: dict[str, Any]
) -> tuple[Connection, Connection, Connection]:
    """This rank's stdout, stderr and events connections to the driver. On a Unix socket one
    authenticated connection (events) carries the driver's ends of two socket pairs for the
    output (one handshake per rank instead of three); over TCP, or through a host agent's
    relay, each stream connects."""
    if not address.driver_on_this_host:
        return tuple(  # type: ignore[return-value]
            connect(address, secret, {**header, "stream": stream.value})
            for stream in (Stream.STDOUT, Stream.STDERR, Stream.EVENTS)
        )
    pairs = [socket.socketpair() for _ in range(2)]
    carries = [Stream.STDOUT.value, Stream.STDERR.value]
    try:
        events = connect(
            address,
            secret,
            {**header, "stream": Stream.EVENTS.value, "carries": carries},
            fds=[far.fileno() for _, far in pairs],
        )
    except BaseException:
        for near, _ in pairs:
            near.close()
        raise
    finally:
        for _, far in pairs:
            far.close()
    return Connection(pairs[0][0]), Connection(pairs[1][0]), events


def run_worker(spec: WorkerSpec) -> int:
    """Entry point of every worker process; returns the process exit code."""
    global _events, _rank, _shared_results, _main_thread
    _rank = spec.rank
    _main_thread = threading.get_ident()
    _shared_results = spec.address.driver_on_this_host  # else it cannot map this host's files
    # A crash in native code (SIGSEGV, abort...) prints the Python stack of every thread to fd 2,
    # and so does STACKS_SIGNAL (the driver's, when a call times out): once the streams are
    # connected fd 2 is the driver's stderr stream, so the notebook shows where the rank was.
    faulthandler.enable(2)
    if STACKS_SIGNAL is not None:
        faulthandler.register(STACKS_SIGNAL, 2, all_threads=True)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
    problems = _prepare_process(spec)
    header = {"rank": spec.rank, "launch": spec.launch_id}
    address, secret = spec.address, spec.secret
    try:
        out, err, events = _connect_streams(address, secret, header)
    except (OSError, EOFError, ConnectionError) as exc:
        _report_no_connection(spec, exc)
        return 1
    sys.stdout = _redirect(1, out)
    sys.stderr = _redirect(2, err)
    for problem in problems:
        print(problem, file=sys.stderr)
    _events = events
    _send((Message.HELLO, os.getpid()))
    rank_watch.start(events.sock, _driver_gone)
    for setup in spec.setup:
        setup()
    if spec.mode == Mode.SERVE:
        _send((Message.READY,))
        code = _serve()
    else:
        try:
            function, args, kwargs = load_work(spec.work)
        except BaseException as exc:
            _send((Message.ERROR, 0, describe_exception(exc)))
            return 1
        _send((Message.READY,))
        code = 0 if _run_call(0, function, args, kwargs) else 1
        _flush_all()
        if code != 0 or _peers_may_need_this_rank():
            _wait_for_release()
    _flush_all()
    _drop_results()
    return code


def _peers_may_need_this_rank() -> bool:
    """Whether this rank, its call done, must stay until every rank has reported.

    It must while it holds something another rank or the driver may still use: a process group
    (a slower peer may still be connecting to its end, or reading what it sent), an RPC agent,
    torch-xla's runtime (rank 0 hosts its coordination service), or shared files of a result the
    driver has not mapped yet. A rank holding none of these exits as soon as it has reported, as
    a process of ``torch.multiprocessing`` does: its exit then overlaps the slower ranks' work
    instead of following it (an 8-rank launch on 2 cores ends about 15% sooner).
    """
    if _result_files or "torch_xla" in sys.modules:
        return True
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    rpc = sys.modules.get("torch.distributed.rpc")
    agent_set = getattr(getattr(rpc, "api", None), "_is_current_rpc_agent_set", None)
    return bool(agent_set is not None and agent_set())


def _wait_for_release() -> None:
    """Stay alive (process group included) until the driver says every rank has reported.

    Exiting as soon as this rank's function returned would tear down its end of the process
    group while a slower peer may still be connecting to it (gloo's "connectFullMesh failed ...
    Connection closed by peer"); see :func:`_peers_may_need_this_rank`. The wait cannot outlive
    the driver: the watcher thread exits the process when the driver's connection closes, and
    the driver stops ranks that fail.
    """
    while True:
        try:
            message = _next_message(_FOR_RELEASE)
        except KeyboardInterrupt:  # the stop button after this rank had reported
            return
        if message[0] in (Message.RELEASE, Message.STOP):
            return
