"""The fork server process itself: preload, then fork one rank per request.

Protocol on the server's stdin/stdout pipes (private to the kernel): length-prefixed pickles of
tuples led by a :class:`~nbaccel.launch.wire.protocol.ServerMessage`:
  driver -> server: (SPAWN, request_id, spec_bytes) | (PRELOAD, modules)
  server -> driver: (READY,) | (STARTED, request_id, pid) | (FAILED, request_id, why)
                    | (REFUSED, request_id, reason) | (EXITED, pid, returncode, at)
The server runs in a session of its own and ignores SIGINT: the notebook's stop button reaches
the ranks through the driver. When its stdin closes (the kernel closed it, or died), it kills its
workers and exits at once; SIGTERM does the same.
A module whose import initialises CUDA (a library doing ``torch.cuda.init()`` at import, or one
that torch's backend autoload pulls in) would leave every forked rank unable to use the GPU
("Cannot re-initialize CUDA in forked subprocess"): the server notices it after each import and
refuses to fork (REFUSED), naming the module and the fix (:class:`CudaInitializedInServer`).
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import struct
import sys
import time
from collections.abc import Iterable
from typing import Any

from nbaccel.launch.host.log_store import reclaim_after
from nbaccel.launch.launchers.huge_pages import collapse_writable_memory
from nbaccel.launch.launchers.reaper import Reaper, become_subreaper
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
    for fd in server_fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    become_subreaper()  # what this rank starts stays below it (see launchers.reaper)
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

    cuda_culprit: str | None = None  # the first module whose import initialised CUDA
    inherited: frozenset[str] | None = None  # the modules every rank forked now gets


_preloaded = _Preloaded()


def inherited_modules() -> frozenset[str] | None:
    """In a rank forked by the server: the modules it had imported for it (what ``sys.modules``
    held at the fork); None elsewhere. What a rank imports beyond them is its own start-up
    cost, paid again by every rank of every launch."""
    return _preloaded.inherited


def _preload(modules: Iterable[str], strict: bool) -> None:
    for module in modules:
        try:
            __import__(module)
        except Exception as exc:
            if strict:
                raise
            # Preloading only saves time: the worker imports the module itself and fails there
            # (or does without it: IPython's display on a host that lacks IPython).
            if not _not_installed(exc, module):
                print(f"[nbaccel] fork server could not preload {module}: {exc}", file=sys.stderr)
        if _preloaded.cuda_culprit is None and _cuda_initialized():
            _preloaded.cuda_culprit = module
    _preloaded.inherited = frozenset(sys.modules)


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


def _handle(request: tuple, stdout: int, server_fds: tuple[int, ...], reaper: Reaper) -> bool:
    """Answer one request; True when it changed what ranks would inherit (a preload)."""
    if request[0] == ServerMessage.PRELOAD:
        _preload(request[1], strict=False)
        return True
    if _preloaded.cuda_culprit is not None:
        refusal = cuda_refusal(_preloaded.cuda_culprit)
        write_frame(stdout, (ServerMessage.REFUSED, request[1], refusal))
        return False
    _fork_rank(request, stdout, server_fds, reaper)
    return False


def serve(preload: Iterable[str] = ENGINE_PRELOAD) -> None:
    """Run the fork server loop (called in the server process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _preload(ENGINE_PRELOAD, strict=True)
    _preload(preload, strict=False)
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
                    request = read_frame(stdin)
                except EOFError:
                    break
                settle = _handle(request, stdout, (wake_r, wake_w, stdout), reaper) or settle
    finally:
        # stopping now: a late SIGTERM must not raise inside the interpreter's shutdown
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        reaper.kill_all()
        reclaim_after(owner)  # a dead kernel (killed): its logs go with it
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown of torch: the kernel may be waiting on this exit
