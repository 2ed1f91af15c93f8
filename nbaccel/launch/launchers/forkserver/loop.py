"""The fork server process itself: preload, then fork one rank per request.

Protocol on the server's stdin/stdout pipes (private to the kernel): length-prefixed pickles of
tuples led by a :class:`~nbaccel.launch.wire.protocol.ServerMessage`:
  driver -> server: (SPAWN, request_id, spec_bytes) | (PRELOAD, modules)
                    | (PRELOAD, modules, {"path": [...], "quiet": bool, "environ": {...}}):
                    imports with the kernel's ``sys.path`` (and its ``os.environ`` when it
                    changed); quiet: a module that fails to import is passed over without a
                    word (the kernel's own modules, mirrored: see ``kernel_modules``)
  server -> driver: (READY,) | (STARTED, request_id, pid) | (FAILED, request_id, why)
                    | (REFUSED, request_id, reason) | (EXITED, pid, returncode, at)
                    | (PRELOADED, top_level_names, seconds, count[, stamps]): what a PRELOAD of
                    count modules imported anew; with ``{"stamps": True}`` among its options,
                    also ``{module: (file, mtime_ns)}`` of the user files it imported (a host's
                    server: the kernel cannot see that host's files, its agent compares them)
                    | (UNSAFE, [(module, why), ...]): those imports made forking unsafe
The server runs in a session of its own and ignores SIGINT: the notebook's stop button reaches
the ranks through the driver. A signal makes it step aside while ranks forked from the kernel
itself start on the same cores (:mod:`.hold`). When its stdin closes (the kernel closed
it, or died), it kills its workers and exits at once; SIGTERM does the same.
A module whose import makes forking unsafe (initialises CUDA, as a library doing
``torch.cuda.init()`` at import, or one that torch's backend autoload pulls in: every forked rank
would fail with "Cannot re-initialize CUDA in forked subprocess"; starts a thread, which the ranks
would lack, with its locks maybe held; opens a socket, which every rank would share) is noticed
after its import: the server says so (UNSAFE), goes on checking the other imports (so that
one new server leaves out every culprit) and refuses to fork (REFUSED). The driver then starts
a new server without those modules (the ranks import them themselves), or, when torch itself
did it, fails naming the fix (:class:`CudaInitializedInServer`).
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

from nbaccel.launch.host.log_store import reclaim_after
from nbaccel.launch.launchers.forkserver import hold as server_hold
from nbaccel.launch.launchers.forkserver.huge_pages import collapse_writable_memory
from nbaccel.launch.launchers.forkserver.kernel_modules import file_stamps, is_candidate
from nbaccel.launch.launchers.forkserver.reaper import Reaper
from nbaccel.launch.rank.inherited import note_inherited
from nbaccel.launch.wire.protocol import ServerMessage

__all__ = [
    "ENGINE_PRELOAD",
    "CudaInitializedInServer",
    "cuda_refusal",
    "read_frame",
    "serve",
    "write_frame",
]

_HEADER = struct.Struct("!I")


#: What every server imports: torch and the rank side of the engine. Fronts add their own.
ENGINE_PRELOAD = ("torch", "torch.distributed", "nbaccel.launch.rank.worker")


def write_frame(fd: int, message: Any) -> None:
    data = pickle.dumps(message)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, size))


# ----------------------------------------------------------------------------- server side
def _child_main(spec_bytes: bytes, server_fds: tuple[int, ...]) -> None:
    signal.set_wakeup_fd(-1)
    server_hold.remove()
    for fd in server_fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    code = 1
    try:
        from nbaccel.launch.rank.worker import run_worker

        code = run_worker(pickle.loads(spec_bytes))
    finally:
        os._exit(code)


class CudaInitializedInServer(RuntimeError):
    """The fork server's process initialised CUDA (a preloaded module did it at import), so
    ranks forked from it could not use the GPU; raised before any rank starts."""


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def cuda_refusal(module: str) -> str:
    """Why the server refuses to fork once ``module``'s import initialised CUDA, and the fix."""
    return (
        f"importing {module!r} in nbaccel's fork server initialised CUDA, so ranks forked from "
        "it could not use the GPU (CUDA cannot be re-initialised in a forked child). Make that "
        "library initialise CUDA lazily (or import it inside the launched function, not at "
        "the top of a preloaded module), or pass start_method='spawn' to start each rank "
        "fresh."
    )


class _Preloaded:
    """What the server's preloading did (server side; a rank forked from it inherits it)."""

    unsafe: list[tuple[str, str]] = []  # the imports that made forking unsafe, and how
    told = 0  # how many of ``unsafe`` the driver was told of
    threads: frozenset[int] = frozenset()  # the threads and sockets before the checked imports
    sockets: frozenset[str] = frozenset()


_preloaded = _Preloaded()


def _sockets() -> frozenset[str]:
    """This process's open sockets (``socket:[inode]``; empty where ``/proc`` is missing)."""
    found = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return frozenset(found)


def _take_baseline() -> None:
    """What the server holds before the checked imports (torch's own threads, say)."""
    _preloaded.threads = frozenset(t.ident for t in threading.enumerate() if t.ident)
    _preloaded.sockets = _sockets()


_CUDA_HAZARD = "its import initialised CUDA (CUDA cannot be re-initialised in a forked rank)"


def _hazard() -> str | None:
    """How the imports since the baseline made forking this process unsafe, or None."""
    if _cuda_initialized() and not any(why == _CUDA_HAZARD for _, why in _preloaded.unsafe):
        return _CUDA_HAZARD
    threads = [t.name for t in threading.enumerate() if t.ident not in _preloaded.threads]
    if threads:
        return (
            f"its import started a thread ({threads[0]!r}), which forked ranks would lack, its "
            "locks maybe held"
        )
    if _sockets() - _preloaded.sockets:
        return "its import opened a socket, which every forked rank would share"
    return None


def _preload(
    modules: Iterable[str], strict: bool = False, checked: bool = True, quiet: bool = False
) -> None:
    """Import ``modules`` (``strict``: an error propagates). ``checked``: each import is
    checked for what makes forking unsafe (else only for CUDA: torch's own threads are the
    baseline); ``quiet``: failures and warnings pass without a word."""
    for module in modules:
        if module in sys.modules:
            continue  # imported already (by an earlier module): nothing new to check
        held = len(sys.modules)
        try:
            if quiet:
                with warnings.catch_warnings():  # the kernel showed them already
                    warnings.simplefilter("ignore")
                    __import__(module)
            else:
                __import__(module)
        except Exception as exc:
            if strict:
                raise
            # Preloading only saves time: the worker imports the module itself and fails there
            # (or does without it: IPython's display on a host that lacks IPython).
            if not quiet and not _not_installed(exc, module):
                print(f"[nbaccel] fork server could not preload {module}: {exc}", file=sys.stderr)
        except BaseException:  # SystemExit and the like at import: never worth the server
            if strict or not quiet:
                raise
        if len(sys.modules) == held:
            continue  # it failed before importing anything
        why = _hazard() if checked else (_CUDA_HAZARD if _cuda_initialized() else None)
        if why:
            _preloaded.unsafe = [*_preloaded.unsafe, (module, why)]
            _take_baseline()  # the next module is judged on what it adds
    note_inherited()


def _not_installed(exc: Exception, module: str) -> bool:
    """``exc`` says that ``module``'s package is not installed (not that it failed to import)."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return missing is not None and (module == missing or module.startswith(missing + "."))


def _fork_rank(request: tuple, stdout: int, server_fds: tuple[int, ...], reaper: Reaper) -> None:
    """Fork the rank a SPAWN request asks for and say so (or why the system refused)."""
    _, request_id, spec_bytes = request
    try:
        pid = os.fork()
    except OSError as exc:  # the process limit, or no memory for a new process
        why = f"{type(exc).__name__}: {exc}"
        write_frame(stdout, (ServerMessage.FAILED, request_id, why))
        return
    if pid == 0:
        _child_main(spec_bytes, server_fds)
    reaper.ranks.add(pid)
    write_frame(stdout, (ServerMessage.STARTED, request_id, pid))


def _settle_memory() -> None:
    """What the server did since its last fork (imports) stays shared and cheap to fork: its
    objects frozen out of the cyclic GC (a rank's collections do not write to their pages) and
    its writable memory in huge pages (see :mod:`.huge_pages`)."""
    gc.collect()
    gc.freeze()
    collapse_writable_memory()


def _top(name: str) -> str:
    return name.partition(".")[0]


def _tell_unsafe(stdout: int) -> None:
    """Tell the driver which imports made this server unsafe to fork (the news since last)."""
    if len(_preloaded.unsafe) > _preloaded.told:
        write_frame(stdout, (ServerMessage.UNSAFE, _preloaded.unsafe[_preloaded.told :]))
        _preloaded.told = len(_preloaded.unsafe)


def _handle(request: tuple, stdout: int, server_fds: tuple[int, ...], reaper: Reaper) -> bool:
    """Answer one request; True when it changed what ranks would inherit (a preload)."""
    if request[0] == ServerMessage.PRELOAD:
        options = request[2] if len(request) > 2 else {}
        if options.get("path"):
            sys.path[:] = options["path"]  # the kernel's, now: folders added since the start
        if "environ" in options:  # the kernel's variables now, as its imports read them
            os.environ.clear()
            os.environ.update(options["environ"])
        held, started = set(sys.modules), time.perf_counter()
        _preload(request[1], quiet=bool(options.get("quiet")))
        new = sorted({_top(m) for m in sys.modules} - {_top(m) for m in held})
        seconds = time.perf_counter() - started
        answer: tuple = (ServerMessage.PRELOADED, new, seconds, len(request[1]))
        if options.get("stamps"):
            imported = [m for m in list(sys.modules) if m not in held and is_candidate(m)]
            answer += (file_stamps(imported),)
        write_frame(stdout, answer)
        _tell_unsafe(stdout)
        return True
    if _preloaded.unsafe:
        module, why = _preloaded.unsafe[0]
        refusal = cuda_refusal(module) if why == _CUDA_HAZARD else f"importing {module!r}: {why}"
        write_frame(stdout, (ServerMessage.REFUSED, request[1], refusal))
        return False
    _fork_rank(request, stdout, server_fds, reaper)
    return False


def _read_requests(stdin: int) -> list[tuple]:
    """The requests waiting on ``stdin`` (at least one), consecutive PRELOADs merged into one:
    the kernel's import hook sends one per import, and each answer costs a scan of
    ``sys.modules``."""
    requests = [read_frame(stdin)]
    while select.select([stdin], [], [], 0)[0]:
        try:
            request = read_frame(stdin)
        except EOFError:
            break  # the pipe closed: the loop sees it at its next read
        last = requests[-1]
        same = request[0] == last[0] == ServerMessage.PRELOAD and request[2:] == last[2:]
        if same:
            requests[-1] = (last[0], [*last[1], *request[1]], *last[2:])
        else:
            requests.append(request)
    return requests


def serve(preload: Iterable[str] = ENGINE_PRELOAD) -> None:
    """Run the fork server loop (called in the server process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server_hold.install()  # where the bootstrap has not already (a server forked from an agent)
    _preload(ENGINE_PRELOAD, strict=True, checked=False)
    _take_baseline()
    _preload(preload)
    stdin, stdout = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the pipe
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    reaper = Reaper()
    owner = os.getppid()  # the kernel: its logs go when it does (log_store.reclaim_after)

    def terminate(*_: Any) -> None:
        # SIGTERM (Jupyter shutting the kernel down signals its process group, then polls until
        # no child is left): end the workers and exit at once, without the interpreter's slow
        # teardown of torch, so the kernel's shutdown does not wait on this process.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        reaper.kill_all()
        reclaim_after(owner)  # a kernel already gone leaves no logs; no waiting here
        os._exit(0)

    signal.signal(signal.SIGTERM, terminate)
    write_frame(stdout, (ServerMessage.READY,))
    _tell_unsafe(stdout)

    def reap() -> None:
        for pid, code in reaper.reap():
            write_frame(stdout, (ServerMessage.EXITED, pid, code, time.time()))
        reaper.end_orphans()  # after the report: a rank's death is never held up by its orphans

    settle = True  # memory to settle for cheap forks, at the first idle moment
    try:
        while True:
            due = reaper.next_due()
            wait = 1.0 if due is None else min(1.0, due + 0.01)
            ready, _, _ = select.select([stdin, wake_r], [], [], 0.02 if settle else wait)
            if wake_r in ready:
                os.read(wake_r, 4096)
            reap()
            if settle and not ready:
                settle = False
                _settle_memory()
            if stdin in ready:
                try:
                    requests = _read_requests(stdin)
                except EOFError:
                    break
                for request in requests:
                    settle = _handle(request, stdout, (wake_r, wake_w, stdout), reaper) or settle
    finally:
        # stopping now: a late SIGTERM must not raise inside the interpreter's shutdown
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        reaper.kill_all()
        reclaim_after(owner)  # a dead kernel (killed): its logs go with it
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown of torch: the kernel may be waiting on this exit
