"""A run folder: everything a detached run keeps, and the one place that names its files.

::

    <runs root>/<run id>/
        run.json       RunInfo: name, state, ranks, hosts, times, last line (atomic rewrites)
        work.pkl       the function, its arguments and the launch request (for resume)
        launch.json    the launching process's environment, working directory and sys.path
        journal.bin    every line, event and notice, in order (nbaccel.launch.detached.journal)
        result.pkl     the last attempt's call report: per-rank results or the failure
        runner.log     the runner process's own stdout/stderr (nbaccel's errors, if any)
        logs/          full output logs beyond what a launch shows (as a kernel keeps them)

Folders are private (0700 under a 0700 root) and stay until removed (:func:`remove_runs`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbaccel.launch.detached.paths import runs_root

__all__ = ["ENDED", "RunFolder", "RunInfo", "RunState", "list_runs", "remove_runs", "write_atomic"]


class RunState:
    """The states of a run (plain strings in ``run.json``)."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


ENDED = frozenset({RunState.FINISHED, RunState.FAILED, RunState.STOPPED})


@dataclass
class RunInfo:
    """What ``runs()`` shows of a run: ``run.json``."""

    id: str
    name: str
    state: str = RunState.STARTING
    num_processes: int | None = None
    hosts: str = "localhost"
    started: float = field(default_factory=time.time)
    ended: float | None = None
    last_line: str = ""
    reason: str = ""  # why it failed or was stopped, in one line
    attempts: int = 0  # launches of the work so far (1 + resumes)
    runner_pid: int | None = None

    @property
    def ended_(self) -> bool:
        """True once the run is finished, failed or stopped."""
        return self.state in ENDED

    def row(self) -> dict[str, Any]:
        """The listing's columns, as text."""
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state,
            "ranks": "" if self.num_processes is None else str(self.num_processes),
            "hosts": self.hosts,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)),
            "last line": self.last_line,
        }


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (0600) through a rename: a reader sees the old or the new."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(partial, path)


class RunFolder:
    """One run's folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.id = self.path.name

    # ------------------------------------------------------------------ finding
    @classmethod
    def create(cls, name: str, root: Path | None = None) -> RunFolder:
        """A new, empty, private folder with a fresh id (``YYYYmmdd-HHMMSS-xxxx``)."""
        root = runs_root() if root is None else root
        while True:
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            try:
                (root / run_id).mkdir(mode=0o700)
            except FileExistsError:
                continue
            folder = cls(root / run_id)
            folder.write_info(RunInfo(id=run_id, name=name))
            return folder

    @classmethod
    def find(cls, run_id: str, root: Path | None = None) -> RunFolder:
        """The folder of ``run_id`` (or of the one run whose id starts with it)."""
        root = runs_root() if root is None else root
        exact = root / run_id
        if run_id and (exact / "run.json").is_file():
            return cls(exact)
        matches = [p for p in root.iterdir() if p.name.startswith(run_id) and
                   (p / "run.json").is_file()] if run_id else []  # fmt: skip
        if len(matches) == 1:
            return cls(matches[0])
        known = ", ".join(sorted(p.name for p in root.iterdir() if (p / "run.json").is_file()))
        what = "matches several runs" if matches else "is not a run"
        raise KeyError(f"{run_id!r} {what} in {root}; the runs are: {known or 'none'}.")

    # ------------------------------------------------------------------ files
    def file(self, name: str) -> Path:
        """The path of one of the folder's files (see the module docstring)."""
        return self.path / name

    def info(self) -> RunInfo:
        """The run's ``run.json``."""
        data = json.loads(self.file("run.json").read_text())
        known = {f.name for f in dataclasses.fields(RunInfo)}
        return RunInfo(**{k: v for k, v in data.items() if k in known})

    def write_info(self, info: RunInfo) -> None:
        """Replace ``run.json`` (atomically)."""
        write_atomic(self.file("run.json"), json.dumps(dataclasses.asdict(info)).encode())

    def update(self, **changes: Any) -> RunInfo:
        """Change some fields of ``run.json``; the new info."""
        info = dataclasses.replace(self.info(), **changes)
        self.write_info(info)
        return info

    def write_pickle(self, name: str, value: Any) -> None:
        """Pickle ``value`` (cloudpickle: notebook functions by value) into file ``name``."""
        import cloudpickle

        write_atomic(self.file(name), cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def read_pickle(self, name: str) -> Any:
        """The value pickled in file ``name``."""
        with open(self.file(name), "rb") as handle:
            return pickle.load(handle)

    def write_json(self, name: str, value: Any) -> None:
        """``value`` as JSON in file ``name`` (atomically, 0600)."""
        write_atomic(self.file(name), json.dumps(value).encode())

    def read_json(self, name: str) -> Any:
        """The JSON value in file ``name``."""
        return json.loads(self.file(name).read_text())


def list_runs(root: Path | None = None) -> list[RunInfo]:
    """Every run under ``root`` (default: this user's), oldest first."""
    root = runs_root() if root is None else root
    found = []
    for path in root.iterdir():
        if (path / "run.json").is_file():
            try:
                found.append(RunFolder(path).info())
            except (OSError, ValueError, TypeError):
                continue  # a folder being written or damaged: not a run to show
    return sorted(found, key=lambda info: (info.started, info.id))


def remove_runs(
    run_ids: list[str] | None = None, older_than_days: float | None = None,
    root: Path | None = None,
) -> list[str]:  # fmt: skip
    """Remove ended runs' folders: those named, and/or those ended more than
    ``older_than_days`` ago; the ids removed. A run still going is refused (stop it first)."""
    root = runs_root() if root is None else root
    chosen: list[RunFolder] = [RunFolder.find(r, root) for r in run_ids or []]
    if older_than_days is not None:
        limit = time.time() - older_than_days * 86400
        chosen += [
            RunFolder(root / info.id)
            for info in list_runs(root)
            if info.ended_ and (info.ended or info.started) < limit
        ]
    removed = []
    for folder in {f.path: f for f in chosen}.values():
        info = folder.info()
        if not info.ended_:
            raise ValueError(
                f"run {info.id} is {info.state}: stop it first (nbaccel runs stop {info.id})."
            )
        shutil.rmtree(folder.path, ignore_errors=True)
        removed.append(info.id)
    return removed
