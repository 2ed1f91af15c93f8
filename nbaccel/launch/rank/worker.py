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
from typing import Any, ClassVar

from nbaccel.launch.host.descendants import become_subreaper, end_descendants
from nbaccel.launch.rank import allocator, notebook_state, rendezvous
from nbaccel.launch.rank import watch as rank_watch
from nbaccel.launch.wire.channel import Connection, connect
from nbaccel.launch.wire.errors import describe_exception
from nbaccel.launch.wire.protocol import STACKS_SIGNAL, EventKind, Message, Stream
from nbaccel.launch.wire.spec import Mode, WorkerSpec, load_work
from nbaccel.launch.wire.transport import SharedTensors, on_the_wire, pack, unpack
from nbaccel.launch.wire.unpicklable import ResultNotSendable, UnpicklableError

__all__ = [
    "RankLoop",
    "after_each_call",
    "before_each_call",
    "current_rank",
    "emit",
    "flush_output",
    "on_worker",
    "run_worker",
]

_EXIT_DRIVER_GONE = 70
_NONE = on_the_wire(pack(None)[0])  # a None result, packed once
# what the main thread waits for, if anything (see RankLoop._waiting)
_BETWEEN_CALLS, _FOR_RELEASE = "between calls", "for release"


def on_worker() -> bool:
    """True inside a process started by nbaccel's launcher or pool."""
    loop = RankLoop.current
    return loop is not None and loop.events is not None


def current_rank() -> int | None:
    """This process's rank, or None outside nbaccel's workers."""
    loop = RankLoop.current
    return None if loop is None else loop.rank


def emit(kind: EventKind, payload: Any) -> None:
    """Send an event (progress, memory sample, display bundle...) to the notebook.

    A no-op outside nbaccel workers, so instrumented code runs anywhere.
    """
    loop = RankLoop.current
    if loop is None or loop.events is None:
        return
    loop.send((Message.EVENT, EventKind(kind), payload))


def before_each_call(hook: Callable[[], None]) -> None:
    """Run ``hook()`` on this rank just before each call starts (a sampler wakes up); a no-op
    outside nbaccel workers."""
    if RankLoop.current is not None:
        RankLoop.current.before_each_call(hook)


def after_each_call(hook: Callable[[], None]) -> None:
    """Run ``hook()`` on this rank when each call ends, before its result or error is sent
    (worker hooks use it for a last event, e.g. a final memory sample, that quick calls would
    otherwise never send); a no-op outside nbaccel workers."""
    if RankLoop.current is not None:
        RankLoop.current.after_each_call(hook)


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
    allocator.apply(os.environ)  # freed memory kept for the next step
    rendezvous.install()  # init_process_group() does not sleep on torch's retry
    return notebook_state.apply(spec.notebook_state)


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


def _say_ended(ended: list[str]) -> None:
    """Tell the notebook (this rank's stderr) which processes the rank left running and were
    ended with its launch, and how to keep one."""
    if ended:
        print(
            f"nbaccel: ended {len(ended)} process(es) this rank started and left running: "
            f"{', '.join(ended)}. A launch's processes end with it; start one with "
            "NBACCEL_DETACH=1 in its environment to keep it.",
            file=sys.stderr,
        )


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception:  # a hook's failure must not replace the call's own outcome
            pass


class RankLoop:
    """One rank's main loop and all it holds: its connection to the driver, the calls it
    serves, the results it keeps until the driver took them.

    :func:`run_worker` creates the one instance of a rank's process and makes it
    :attr:`current`; the module's functions (:func:`emit`, :func:`current_rank`, ...) that code
    running on the rank calls go to it.
    """

    #: the loop of this process's rank (None outside nbaccel's workers)
    current: ClassVar[RankLoop | None] = None

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        #: the event stream to the driver, once connected
        self.events: Connection | None = None
        self._send_lock = threading.Lock()
        self._held: list[Any] | None = None  # main-thread messages held until a call's outcome
        self._main_thread = threading.get_ident()  # the thread that serves calls
        # the driver can map this host's shared files (same host, no relay)
        self._shared_results = spec.address.driver_on_this_host
        # shared files of results the driver may not have taken yet: this rank holds their lock
        # (a sweep reclaims them if it dies) until its next call or its exit
        self._result_files: list[SharedTensors] = []
        self._sigint_at: float | None = None  # when SIGINT last arrived (None: not this call)
        # what the main thread waits for, if anything: between calls an interrupt has nothing
        # to stop (and must not cost the message being read); after a one-shot launch's call it
        # ends the wait
        self._waiting: str | None = None
        self._before_call: list[Callable[[], None]] = []
        self._after_call: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ sending
    def send(self, message: Any) -> None:
        """Send ``message`` to the driver; on the main thread during a call's end, it waits
        to leave with the call's outcome."""
        with self._send_lock:
            if self._held is not None and threading.get_ident() == self._main_thread:
                self._held.append(message)  # leaves with the call's outcome (see _end_call)
                return
            self.events.send(message)

    def before_each_call(self, hook: Callable[[], None]) -> None:
        """See the module's :func:`before_each_call`."""
        if hook not in self._before_call:
            self._before_call.append(hook)

    def after_each_call(self, hook: Callable[[], None]) -> None:
        """See the module's :func:`after_each_call`."""
        if hook not in self._after_call:
            self._after_call.append(hook)

    # ------------------------------------------------------------------ the driver
    def _driver_gone(self) -> None:
        """The driver's connection closed (the kernel died or restarted): exit now."""
        _flush_all()
        self._drop_results()
        os._exit(_EXIT_DRIVER_GONE)

    def _next_message(self, waiting: str) -> Any:
        """The driver's next message, read on the main thread (see ``_waiting``)."""
        self._waiting = waiting
        try:
            return self.events.recv()
        except (EOFError, OSError):
            self._driver_gone()

    def on_sigint(self, signum: int, frame: Any) -> None:
        """The stop button (or the driver) interrupted this rank: remember that it was a
        signal, so a ``KeyboardInterrupt`` raised by the rank's own code is not taken for the
        stop button."""
        import time

        if self._waiting == _BETWEEN_CALLS:
            return  # nothing to stop; the stop button's driver sees this rank is idle
        self._sigint_at = time.time()
        raise KeyboardInterrupt

    def _drop_results(self) -> None:
        """Remove the shared files of earlier results (taken by the driver, or never to be)."""
        while self._result_files:
            self._result_files.pop().release()

    # ------------------------------------------------------------------ calls
    def _report_error(self, call_id: int, exc: BaseException) -> None:
        info = describe_exception(exc)
        if isinstance(exc, KeyboardInterrupt):
            info["signalled"] = self._sigint_at is not None
        self.send((Message.ERROR, call_id, info))

    def run_call(self, call_id: int, function: Callable, args: tuple, kwargs: dict) -> bool:
        """Run one call and report its outcome; True when it returned a value."""
        if self._result_files:
            self._drop_results()
        self._sigint_at = None
        rank_watch.call_started()
        if self._before_call:
            _run_hooks(self._before_call)
        try:
            value = function(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):  # sys.exit(3): a failure with its code
                return self._end_call(call_id, error=exc)
            value = None  # sys.exit(0) / exit(): the function is done, successfully
        except BaseException as exc:
            return self._end_call(call_id, error=exc)
        return self._end_call(call_id, value=value)

    def _end_call(
        self, call_id: int, value: Any = None, error: BaseException | None = None
    ) -> bool:
        """Run the after-call hooks, flush the output, report the outcome. The hooks' events
        and the outcome leave in one write: a quick call on many ranks costs the driver one
        wake-up per rank, not two."""
        self._held = []
        rank_watch.call_ended()
        try:
            if self._after_call:
                _run_hooks(self._after_call)
            if self.spec.mode == Mode.CALL:  # a one-shot launch: what it started ends now
                _say_ended(end_descendants())
            _flush_all()
            if error is not None:
                self._report_error(call_id, error)
                return False
            return self._send_result(call_id, value)
        finally:
            held, self._held = self._held, None
            if held:
                with self._send_lock:
                    self.events.send_many(held)

    def _send_result(self, call_id: int, value: Any) -> bool:
        """Send the return value; large CPU tensors in it travel through a shared file that
        the driver maps (``transport.take``), written once here, never copied through the
        socket."""
        if value is None:  # a cell or a function that returns nothing: the same bytes each time
            self.send((Message.RESULT, call_id, _NONE))
            return True
        try:
            packed, shared = pack(
                value,
                name=ResultNotSendable.value_name,
                share=self._shared_results,
                toward="notebook",
            )
        except UnpicklableError as exc:
            error = ResultNotSendable(f"the function succeeded, but {exc}")
            error.where, error.culprit, error.cause = exc.where, exc.culprit, exc.cause
            self.send((Message.ERROR, call_id, describe_exception(error)))
            return False
        if shared is not None and shared.path is not None:
            self._result_files.append(shared)
        self.send((Message.RESULT, call_id, on_the_wire(packed)))
        return True

    def serve(self) -> int:
        """Serve calls until the driver says stop (``Mode.SERVE``)."""
        while True:
            message = self._next_message(_BETWEEN_CALLS)
            if message[0] == Message.STOP:  # the pool shuts down: what its cells started ends
                _say_ended(end_descendants())
                _flush_all()
                return 0
            if message[0] != Message.CALL:
                continue
            _, call_id, packed = message
            try:
                self._waiting = None  # from here the stop button stops this call
                try:
                    function, args, kwargs = unpack(packed)
                except BaseException as exc:
                    self.send((Message.ERROR, call_id, describe_exception(exc)))
                    continue
                self.run_call(call_id, function, args, kwargs)
            except KeyboardInterrupt as exc:  # raised between the call and its report
                self._report_error(call_id, exc)

    # ------------------------------------------------------------------ the whole life
    def run(self) -> int:
        """Connect, run the work (one call, or a pool's calls), report; the exit code."""
        spec = self.spec
        # A crash in native code (SIGSEGV, abort...) prints the Python stack of every thread
        # to fd 2, and so does STACKS_SIGNAL (the driver's, when a call times out): once the
        # streams are connected fd 2 is the driver's stderr stream, so the notebook shows where
        # the rank was.
        faulthandler.enable(2)
        if STACKS_SIGNAL is not None:
            faulthandler.register(STACKS_SIGNAL, 2, all_threads=True)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.on_sigint)
        problems = _prepare_process(spec)
        header = {"rank": spec.rank, "launch": spec.launch_id}
        try:
            out, err, events = _connect_streams(spec.address, spec.secret, header)
        except (OSError, EOFError, ConnectionError) as exc:
            _report_no_connection(spec, exc)
            return 1
        sys.stdout = _redirect(1, out)
        sys.stderr = _redirect(2, err)
        for problem in problems:
            print(problem, file=sys.stderr)
        self.events = events
        self.send((Message.HELLO, os.getpid()))
        rank_watch.start(events.sock, self._driver_gone)
        for setup in spec.setup:
            setup()
        if spec.mode == Mode.SERVE:
            self.send((Message.READY,))
            code = self.serve()
        else:
            try:
                function, args, kwargs = load_work(spec.work)
            except BaseException as exc:
                self.send((Message.ERROR, 0, describe_exception(exc)))
                return 1
            self.send((Message.READY,))
            code = 0 if self.run_call(0, function, args, kwargs) else 1
            _flush_all()
            if code != 0 or self._peers_may_need_this_rank():
                self._wait_for_release()
        _flush_all()
        self._drop_results()
        return code

    def _peers_may_need_this_rank(self) -> bool:
        """Whether this rank, its call done, must stay until every rank has reported.

        It must while it holds something another rank or the driver may still use: a process group
        (a slower peer may still be connecting to its end, or reading what it sent), an RPC agent,
        torch-xla's runtime (rank 0 hosts its coordination service), or shared files of a result the
        driver has not mapped yet. A rank holding none of these exits as soon as it has reported, as
        a process of ``torch.multiprocessing`` does: its exit then overlaps the slower ranks' work
        instead of following it (a launch of many ranks on few cores ends sooner).
        """
        if self._result_files or "torch_xla" in sys.modules:
            return True
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available():
            return False
        if dist.is_initialized():
            return True
        rpc = sys.modules.get("torch.distributed.rpc")
        agent_set = getattr(getattr(rpc, "api", None), "_is_current_rpc_agent_set", None)
        return bool(agent_set is not None and agent_set())

    def _wait_for_release(self) -> None:
        """Stay alive (process group included) until the driver says every rank has reported.

        Exiting as soon as this rank's function returned would tear down its end of the process
        group while a slower peer may still be connecting to it (gloo's "connectFullMesh failed ...
        Connection closed by peer"); see :func:`_peers_may_need_this_rank`. The wait cannot outlive
        the driver: the watcher thread exits the process when the driver's connection closes, and
        the driver stops ranks that fail.
        """
        while True:
            try:
                message = self._next_message(_FOR_RELEASE)
            except KeyboardInterrupt:  # the stop button after this rank had reported
                return
            if message[0] in (Message.RELEASE, Message.STOP):
                return


def run_worker(spec: WorkerSpec) -> int:
    """Entry point of every worker process; returns the process exit code. Whatever the rank
    started ends with it, however it was started (``host.descendants``)."""
    become_subreaper()  # what this rank starts stays below it, setsid'd daemons included
    loop = RankLoop(spec)
    RankLoop.current = loop
    try:
        return loop.run()
    finally:
        end_descendants()
