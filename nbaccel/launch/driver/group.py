"""The driver's side of a set of ranks: start them, pump their streams, stop them.

``WorkerGroup`` is the one process engine shared by every front: one-shot launches
(``notebook_launcher``, ``nbaccel.testing.run_on_ranks``, XLA: one call, then the workers exit)
and the persistent ``%%distributed`` pool (many calls on long-lived workers). A launcher variant
(``nbaccel.launch.launchers``) starts the processes; the driver loop that waits on a call, settles
stragglers and raises the first failure is ``nbaccel.launch.driver.loop``. Everything runs on the
calling thread: a ``selectors`` loop accepts authenticated connections, turns output
bytes into whole rank-labelled lines, decodes events, and watches for processes that end, so
that the notebook's stop button (``KeyboardInterrupt``) lands where it can be handled.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import secrets
import selectors
import signal
import sys
import time
from collections.abc import Callable, Iterable

from nbaccel.launch.driver.output_budget import OutputBudget
from nbaccel.launch.driver.output_reader import OutputReader
from nbaccel.launch.driver.rank_connections import EVENTS, HANDSHAKE, LISTENER, ConnectionTable
from nbaccel.launch.driver.rank_ends import EndWatcher, still_draining
from nbaccel.launch.driver.rank_state import Outcome, RankState
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.rank import notebook_state
from nbaccel.launch.wire.channel import INCOMPLETE, encode, new_secret
from nbaccel.launch.wire.errors import result_not_loadable
from nbaccel.launch.wire.labels import RankLabels
from nbaccel.launch.wire.protocol import Message, OutcomeKind
from nbaccel.launch.wire.spec import Mode, Work, WorkerSpec
from nbaccel.launch.wire.transport import (
    Packed,
    SharedTensors,
    Wire,
    discard,
    on_the_wire,
    pack,
    sweep_segments,
    take,
)

__all__ = ["Outcome", "WorkerGroup"]

# what a ready selector key is (the key's data is (source, rank, stream)); the others: see
# rank_connections
_WAKE = "wake"
# ranks asked of the launcher at once: enough that a launch of a few ranks costs one round trip
# to the fork server, few enough that the ranks already up are authenticated between batches
_START_BATCH = 16
# The processes are checked when one may have ended (a wake-up, a stream's end), in an idle
# round, or at least every _CHECK_EVERY s: not at each of a launch's hundred socket events.
_CHECK_EVERY = 0.05


class WorkerGroup:
    """``num_processes`` worker processes connected to this driver.

    It holds the parts that do the work: how its ranks connect,
    :attr:`connections` (:class:`~nbaccel.launch.driver.rank_connections.ConnectionTable`);
    how their ends are seen and how they are stopped, :attr:`ends`
    (:class:`~nbaccel.launch.driver.rank_ends.EndWatcher`); what they print becomes lines
    through an :class:`~nbaccel.launch.driver.output_reader.OutputReader`.

    Args:
        num_processes: ranks started on this machine.
        env_for_rank: the full environment of each local rank (RANK, WORLD_SIZE, ...).
        renderer: where lines and events go.
        launcher: the launcher variant that starts the processes.
        mode: ``Mode.CALL`` (run ``work`` once, as call 0) or ``Mode.SERVE`` (persistent pool).
        work: for ``Mode.CALL``, the packed (or, for fork-based launchers, inline) work.
        global_rank: maps a local index to the rank shown to the user.
        threads: torch threads per rank (default: the cores shared among the ranks).
        setup: worker hooks, importable callables run in each rank before its work.
        local_rendezvous: all ranks are on this machine: initialise their process group through
            a private file store rather than a TCP listener.
        output: the limits of what each call shows (the rest goes to a log file, with a notice).
        line_prefix: a template for the prefix of each output line (``RankLabels``).
    """

    def __init__(
        self,
        num_processes: int,
        env_for_rank: Callable[[int], dict[str, str]],
        renderer: Renderer,
        launcher: ProcessLauncher,
        mode: Mode = Mode.CALL,
        work: Work | None = None,
        global_rank: Callable[[int], int] = lambda i: i,
        threads: int | None = None,
        setup: Iterable[Callable[[], None]] = (),
        local_rendezvous: bool = False,
        output: OutputBudget | None = None,
        line_prefix: str | None = None,
    ) -> None:
        self.num_processes = num_processes
        self.mode = mode
        self.launcher = launcher
        #: how this group's ranks are named in its output and errors (``rank 5 @ node2``)
        self.labels = RankLabels(
            launcher.hosts_by_rank, line_prefix, {global_rank(i): i for i in range(num_processes)}
        )
        self.output = output or OutputBudget()
        self.output.notice = lambda text: self.renderer.notice(text)
        self.output.labels = self.labels
        self._env_for_rank = env_for_rank
        self._work = work
        self._global_rank = global_rank
        self._threads = threads or max(1, (os.cpu_count() or 1) // num_processes)
        self._setup = tuple(setup)
        self._notebook_state = notebook_state.capture()  # what a fork of it would give ranks
        launcher.add_preload(notebook_state.modules(self._notebook_state))
        self._local_rendezvous = local_rendezvous
        self._secret = new_secret()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._news, self._checked_at = True, 0.0  # see _CHECK_EVERY
        self._ranks = [RankState(global_rank(i)) for i in range(num_processes)]
        self._by_rank = {r.rank: r for r in self._ranks}
        #: the listener, the handshakes and the ranks' connections
        self.connections = ConnectionTable(
            self._selector, self._by_rank, secrets.token_hex(6), self._notice
        )
        #: sees the ranks' ends and stops them
        self.ends = EndWatcher(
            self._ranks, self._selector, self.pump_until, self.connections.error_path
        )
        self._reader = OutputReader(self.connections, self.output, renderer)
        self.renderer = renderer
        self._call_ids = itertools.count(1)
        self._current_call: int | None = None
        self.outcomes_recorded = 0  # all calls and ranks: a waiter looks again when it grows
        self._shared: list[SharedTensors] = []
        self.started_at = time.time()
        self.closed = False

    # ------------------------------------------------------------------ start
    @property
    def renderer(self) -> Renderer:
        """Where this group's lines and events go; it names ranks with :attr:`labels`."""
        return self._renderer

    @renderer.setter
    def renderer(self, renderer: Renderer) -> None:
        renderer.use_labels(self.labels)
        self._renderer = renderer
        self._reader.renderer = renderer

    def _notice(self, text: str) -> None:
        self._renderer.notice(text)

    @property
    def ranks(self) -> list[int]:
        return [r.rank for r in self._ranks]

    @property
    def pids(self) -> dict[int, int]:
        return {r.rank: r.process.pid for r in self._ranks if r.process is not None}

    def wake(self) -> None:
        """Make the thread pumping this group return from its selector round now (another
        thread needs the group: the pool's restart or shutdown)."""
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def start(self, timeout: float = 180.0) -> None:
        """Start every worker and wait until each has connected and loaded its work."""
        sweep_segments()  # shared memory left by a kernel that died mid-launch
        self.connections.listen(
            self._secret, self.launcher.channel_host, backlog=3 * self.num_processes + 16
        )
        self._selector.register(self._wake_r, selectors.EVENT_READ, (_WAKE, None, None))
        self.launcher.prepare()
        self.launcher.add_wakeup(self._wake)
        deadline = time.monotonic() + timeout
        for first in range(0, len(self._ranks), _START_BATCH):
            if time.monotonic() > deadline:
                break  # timeout= bounds the start too: the ranks not started count as late
            batch = self._ranks[first : first + _START_BATCH]
            specs = [self._spec(index, state) for index, state in enumerate(batch, first)]
            started = self.launcher.start_many(specs, while_waiting=self.pump)
            for state, process in zip(batch, started):
                state.process = process
            # authenticate the ranks already up while the others start: every connection that
            # waits (three per rank), so that none of them reaches its handshake timeout
            for _ in range(4 * len(batch)):
                if not self.pump(0):
                    break
        self.pump_until(
            lambda: all(r.ready or r.outcomes for r in self._ranks),
            max(0.0, deadline - time.monotonic()),
        )
        self.release_shared()

    def _spec(self, index: int, state: RankState) -> WorkerSpec:
        """What the rank at ``index`` is started with."""
        env, listener = self._env_for_rank(index), self.connections.listener
        if self._local_rendezvous:
            # One machine: the process group meets in a file inside the listener's private
            # directory instead of torch's TCPStore, which would listen on every interface.
            env["NBACCEL_INIT_METHOD"] = f"file://{listener.private_path('store')}"
        return WorkerSpec(
            rank=state.rank,
            index=index,
            env=env,
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            address=listener.address,
            secret=self._secret,
            launch_id=self.connections.launch_id,
            mode=self.mode,
            work=self._work,
            threads=self._threads,
            setup=self._setup,
            error_path=self.connections.error_path(state.rank),
            argv=list(sys.argv),
            notebook_state=self._notebook_state,
        )

    # ------------------------------------------------------------------ pumping
    def pump(self, timeout: float) -> int:
        """Handle what is ready within ``timeout`` s (one selector round); how many sources were."""
        ready = self._selector.select(timeout)
        for key, _ in ready:
            kind, rank, stream = key.data
            if kind == LISTENER:
                self.connections.start_handshake()
            elif kind == HANDSHAKE:
                self.connections.accept(key.fileobj)
            elif kind == _WAKE:
                self._news = True
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif kind == EVENTS:
                self._read_event(self._by_rank[rank])
            elif self._reader.read(self._by_rank[rank], stream, key.fileobj):
                self._news = True  # a stream's end: its process may have ended
        if self.connections.handshakes:
            self.connections.expire_handshakes()
        for text in self.launcher.take_notices():
            self.renderer.notice(text)
        now = time.monotonic()
        if self._news or not ready or now - self._checked_at > _CHECK_EVERY:
            self._news, self._checked_at = False, now
            self.outcomes_recorded += self.ends.check(self._current_call)
        return len(ready)

    def pump_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Pump until ``done()``; False when ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            self.pump(wait)
        return True

    def _read_event(self, state: RankState) -> None:
        """Handle the messages that woke the selector: one read, then every whole message it
        brought (a rank's last events and its outcome come in one write). A message not whole
        yet waits in the connection's buffer for the next wake-up."""
        while True:
            try:
                message = state.events.recv_ready()
                if message is INCOMPLETE:
                    return
            except (EOFError, OSError, pickle.UnpicklingError):
                self._news = True
                self.connections.close_events(state)
                return
            self._handle_event(state, message)
            if not state.events.buffered():
                return

    def _handle_event(self, state: RankState, message: tuple) -> None:
        still_draining(state)
        tag = message[0]
        if tag == Message.READY:
            state.ready = True
        elif tag in (Message.RESULT, Message.ERROR):
            _, call_id, value = message
            kind = OutcomeKind.RESULT if tag == Message.RESULT else OutcomeKind.ERROR
            if kind == OutcomeKind.RESULT:
                value, kind = self._load_result(state, call_id, value)
            at = value.get("time", time.time()) if kind == OutcomeKind.ERROR else time.time()
            state.outcomes[call_id] = Outcome(kind, value, at)
            self.outcomes_recorded += 1
            state.busy_since = None
        elif tag == Message.EVENT:
            self.renderer.event(state.rank, message[1], message[2])

    def _load_result(self, state: RankState, call_id: int, packed: Wire) -> tuple[object, str]:
        """A rank's return value (its tensors mapped from the shared file it wrote), or the
        error saying the function succeeded but its value cannot be loaded here."""
        if call_id != self._current_call or call_id in state.outcomes:
            discard(packed)  # a late answer to a call already settled: nobody will read it
            return None, OutcomeKind.RESULT
        try:
            return take(packed), OutcomeKind.RESULT
        except Exception as exc:
            return result_not_loadable(state.rank, exc), OutcomeKind.ERROR

    # ------------------------------------------------------------------ calls
    def expect_call(self, call_id: int = 0) -> None:
        """Mark every rank busy with ``call_id`` (``Mode.CALL``'s single call is id 0)."""
        self._current_call = call_id
        self.output.begin(self._output_label)
        now = time.monotonic()
        for state in self._ranks:
            if call_id not in state.outcomes:
                state.busy_since = now

    def send_call(
        self,
        function: Callable,
        args: tuple = (),
        kwargs: dict | None = None,
        ranks: Iterable[int] | None = None,
    ) -> tuple[int, list[int]]:
        """Ask ``ranks`` (default all) of a serving group to run ``function(*args, **kwargs)``."""
        call_id = next(self._call_ids)
        for state in self._ranks:  # earlier calls' outcomes (their values) are not kept
            first = state.outcomes.get(0)  # but call 0's: how the rank's start ended
            state.outcomes = {} if first is None else {0: first}
        packed, shared = pack(
            (function, tuple(args), dict(kwargs or {})),
            element_names=("function", "args", "kwargs"),
        )
        if shared is not None:
            self._shared.append(shared)
        targets = list(self.ranks if ranks is None else ranks)
        placed = self.launcher.place_work(packed, targets)
        self._current_call = call_id
        self.output.begin(self._output_label)
        now, frames = time.monotonic(), {}  # each distinct work pickled once
        for rank in targets:
            state, work = self._by_rank[rank], placed[rank]
            state.busy_since = now
            if id(work) not in frames:
                wire = on_the_wire(work) if isinstance(work, Packed) else work
                frames[id(work)] = encode([(Message.CALL, call_id, wire)])
            state.events.send_encoded(frames[id(work)])
        return call_id, targets

    @property
    def _output_label(self) -> str:
        return "launch" if self.mode == Mode.CALL else "cell"

    def end_call(self) -> None:
        """A call is over: show what its ranks printed last, partial lines included (a
        ``print(..., end="")`` must not wait for the next call's newline), and say what the
        output limit held back."""
        self._reader.drain()
        self._reader.flush_printed(self._ranks)
        self.output.end()

    def outcomes(self, call_id: int, ranks: Iterable[int] | None = None) -> dict[int, Outcome]:
        targets = self.ranks if ranks is None else ranks
        return {
            r: self._by_rank[r].outcomes[call_id]
            for r in targets
            if call_id in self._by_rank[r].outcomes
        }

    def busy(self, rank: int) -> bool:
        return self._by_rank[rank].busy_since is not None

    def output_at(self, ranks: Iterable[int]) -> float:
        """When (monotonic) output last came from any of ``ranks`` (0.0: never)."""
        return max((self._by_rank[r].output_at for r in ranks), default=0.0)

    def running_ranks(self) -> list[int]:
        """Ranks whose process has not ended (as its launcher knows it)."""
        return [r.rank for r in self._ranks if r.process is not None and r.process.poll() is None]

    def alive(self) -> bool:
        for state in self._ranks:  # a loop, not all(...): asked before every pool call
            if state.process is None or state.process.poll() is not None:
                return False
        self._checked_at = time.monotonic()  # none ended: the next pump need not look again
        return True

    # ------------------------------------------------------------------ ends (see EndWatcher)
    def dead_unreported(self, call_id: int) -> list[int]:
        """Ranks whose process has ended without an outcome for ``call_id`` recorded yet."""
        return self.ends.dead_unreported(call_id)

    def signal_all(self, sig: int, ranks: Iterable[int] | None = None) -> None:
        """Send ``sig`` to ``ranks`` (default all) and everything they started."""
        self.ends.signal_all(sig, ranks)

    def dump_stacks(self, ranks: Iterable[int]) -> bool:
        """Ask ``ranks`` to print their threads' stacks; False where no signal does it."""
        return self.ends.dump_stacks(ranks)

    def ignoring(self, sig: int, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose process ignores ``sig``."""
        return self.ends.ignoring(sig, ranks)

    def release(self) -> None:
        """Tell one-shot ranks that every rank has reported: they may exit now."""
        self.ends.release()

    def wait_exit(self, timeout: float) -> bool:
        """Pump until every rank's process has ended; False when ``timeout`` s passed first."""
        return self.ends.wait_exit(timeout)

    def stop(self, grace: float = 2.0, first: int = signal.SIGTERM) -> None:
        """Stop every rank: ``first`` signal, then SIGKILL after ``grace`` seconds."""
        self.ends.stop(grace, first)

    def release_shared(self) -> None:
        """Unlink shared tensor files once every rank has mapped them."""
        for shared in self._shared:
            shared.release()
        self._shared.clear()
        self.launcher.release_work()

    def close(self, grace: float = 2.0) -> None:
        """Stop the workers (politely for a pool), drain output, free every resource."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.mode == Mode.SERVE:
                for state in self._ranks:
                    if state.events is not None and not state.events_closed:
                        try:
                            state.events.send((Message.STOP,))
                        except OSError:
                            pass
                if not self.wait_exit(grace):
                    self.stop(grace)
            else:
                self.release()  # ranks that reported wait for this before they exit
                if not self.wait_exit(grace):
                    self.stop(grace)
            self.pump_until(lambda: all(r.finished_io for r in self._ranks), 0.5)
            self.output.end()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        # the values the ranks returned belong to the caller's report now: a closed group must
        # not keep them (a kernel launching all day would hold every result until a GC pass)
        for state in self._ranks:
            state.outcomes = {
                k: o for k, o in state.outcomes.items() if o.kind != OutcomeKind.RESULT
            }
        self.launcher.remove_wakeup(self._wake)
        self.launcher.close()
        self.connections.close()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.release_shared()
