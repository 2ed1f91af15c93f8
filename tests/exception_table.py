"""Exceptions people meet in ranks, each raised for real: the table the exception tests share.

``raised(kind)`` returns the exception, caught right after its raise (so it has a traceback);
``raise_on_rank(kind, rank)`` raises it on one rank of a launch (the fronts' tests launch it).
The user classes live here, importable by name on both sides, as a notebook's classes are.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass


class NeedsKeyword(Exception):
    """A keyword-only constructor (pickle cannot call it again from args)."""

    def __init__(self, *, code: int) -> None:
        super().__init__(f"failed with code {code}")
        self.code = code


class ShardError(ValueError):
    """An __init__ that takes other arguments than it passes up, plus extra attributes."""

    def __init__(self, shard: int, reason: str) -> None:
        super().__init__(f"shard {shard}: {reason}")
        self.shard, self.reason = shard, reason
        self.retries = [1, 2, 3]


class HoldsALock(RuntimeError):
    """An unpicklable member (a lock) beside picklable ones."""

    def __init__(self, path: str) -> None:
        super().__init__(f"cannot write {path}")
        self.path = path
        self.lock = threading.Lock()


class ReduceRaises(Exception):
    """A ``__reduce__`` that raises: pickle cannot send it at all."""

    def __reduce__(self):  # type: ignore[override]
        raise TypeError("this exception refuses to be pickled")


class OwnStr(Exception):
    """A ``__str__`` that reads attributes, not args."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step

    def __str__(self) -> str:
        return f"loss became NaN at step {self.step}"


class CheckpointMissing(FileNotFoundError):
    """A user subclass of an errno exception with its own constructor."""

    def __init__(self, folder: str) -> None:
        super().__init__(errno.ENOENT, "no checkpoint in folder", folder)
        self.folder = folder


@dataclass(frozen=True)
class Case:
    origin: str
    make: Callable[[], BaseException | None]  # returns the exception, or raises it itself


def _chained() -> None:
    try:
        try:
            {}["weights"]
        except KeyError:
            err = FileNotFoundError(errno.ENOENT, "No such file or directory", "/nope/weights.bin")
            err.add_note("while loading shard 3")
            raise err  # noqa: B904 - while handling the KeyError: its context, on purpose
    except FileNotFoundError as err:
        raise RuntimeError("could not load the checkpoint") from err


def _group() -> BaseException:  # Python 3.11+
    timeout = OSError("store unreachable")
    try:
        raise timeout from TimeoutError("no answer in 30 s")
    except OSError as err:
        timeout = err
    return builtins.ExceptionGroup(
        "two ranks failed", [ValueError("bad lr"), timeout, KeyError("w")]
    )


def _torch_oom() -> BaseException:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _dist(name: str) -> Callable[[], BaseException]:
    def make() -> BaseException:
        import torch.distributed as dist

        return getattr(dist, name)("Connection reset by peer (gloo)")

    return make


def _transformers_missing() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    AutoConfig.from_pretrained("/nope/models/foo-bar")


def _hub(name: str) -> Callable[[], BaseException]:
    def make() -> BaseException:
        import httpx2
        from huggingface_hub import errors

        request = httpx2.Request("GET", "https://huggingface.co/api/models/someone/missing")
        response = httpx2.Response(404, request=request, headers={"X-Error-Code": "RepoNotFound"})
        return getattr(errors, name)("404 Client Error: Repository Not Found", response=response)

    return make


def _hub_validation() -> None:
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id("/nope/models/foo-bar")


def _safetensors_corrupt() -> None:
    import tempfile

    from safetensors import safe_open

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as handle:
        handle.write(b"\xff" * 64)
        handle.flush()
        safe_open(handle.name, "pt")


def _deepspeed() -> BaseException:
    from deepspeed.runtime.config import DeepSpeedConfigError

    return DeepSpeedConfigError("train_batch_size is not equal to micro_batch * grad_acc * world")


def _subprocess_failed() -> BaseException:
    # as subprocess.run(..., check=True) builds it (no process started: the unit tier runs it)
    return subprocess.CalledProcessError(3, [sys.executable, "train.py"], b"out", b"err")


def _subprocess_timeout() -> BaseException:
    return subprocess.TimeoutExpired(["sleep", "60"], 0.5, output=b"partial")


def _nested_function_class() -> BaseException:
    class LocalError(LookupError):
        pass

    return LocalError("defined inside a function")


CASES: dict[str, Case] = {
    # the standard library
    "oserror_message": Case("stdlib", lambda: OSError("model foo/bar not found")),
    "oserror_errno": Case("stdlib", lambda: OSError(errno.ENOSPC, "No space left on device")),
    "oserror_filename": Case("stdlib", lambda: OSError(errno.EACCES, "Permission denied", "/x")),
    "oserror_two_files": Case(
        "stdlib", lambda: OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")
    ),
    "file_not_found_message": Case("stdlib", lambda: FileNotFoundError("weights.bin missing")),
    "file_not_found_real": Case("stdlib", lambda: open("/nope/really/not/here")),  # noqa: SIM115
    "timeout_message": Case("stdlib", lambda: TimeoutError("no answer after 30 s")),
    "connection_refused": Case(
        "stdlib", lambda: ConnectionRefusedError("connection refused by 10.0.0.2:29500")
    ),
    "connection_reset_errno": Case(
        "stdlib", lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    ),
    "blocking_io": Case("stdlib", lambda: BlockingIOError(errno.EAGAIN, "busy", 7)),
    "key_error": Case("stdlib", lambda: {}["learning_rate"]),
    "value_int": Case("stdlib", lambda: ValueError(42)),
    "value_two_args": Case("stdlib", lambda: ValueError("bad", 7)),
    "unicode_decode": Case("stdlib", lambda: b"\xff\xfe".decode("utf-8")),
    "called_process": Case("stdlib", _subprocess_failed),
    "timeout_expired": Case("stdlib", _subprocess_timeout),
    "json_decode": Case("stdlib", lambda: json.loads("{bad")),
    "syntax": Case("stdlib", lambda: compile("x = (", "cell.py", "exec")),
    "module_not_found": Case("stdlib", lambda: __import__("nbaccel_no_such_module")),
    "attribute": Case("stdlib", lambda: None.shape),  # type: ignore[attr-defined]
    "zero_division": Case("stdlib", lambda: 1 / 0),
    "stop_iteration": Case("stdlib", lambda: StopIteration(5)),
    "keyboard_interrupt": Case("stdlib", lambda: KeyboardInterrupt("raised by the code")),
    "chained": Case("stdlib", _chained),
    **({"exception_group": Case("stdlib", _group)} if hasattr(builtins, "ExceptionGroup") else {}),
    # torch
    "torch_oom": Case("torch", _torch_oom),
    "dist_backend": Case("torch", _dist("DistBackendError")),
    "dist_network": Case("torch", _dist("DistNetworkError")),
    # transformers: from_pretrained of a local path that is not there
    "transformers_missing": Case("transformers", _transformers_missing),
    # huggingface_hub, built without the network
    "hub_repo_not_found": Case("huggingface_hub", _hub("RepositoryNotFoundError")),
    "hub_http": Case("huggingface_hub", _hub("HfHubHTTPError")),
    "hub_validation": Case("huggingface_hub", _hub_validation),
    # safetensors: a corrupt file
    "safetensors_corrupt": Case("safetensors", _safetensors_corrupt),
    # DeepSpeed
    "deepspeed_config": Case("deepspeed", _deepspeed),
    # user classes
    "keyword_only": Case("user", lambda: NeedsKeyword(code=3)),
    "extra_attributes": Case("user", lambda: ShardError(3, "checksum mismatch")),
    "unpicklable_member": Case("user", lambda: HoldsALock("/data/shard-3")),
    "reduce_raises": Case("user", lambda: ReduceRaises("cannot be pickled whole")),
    "own_str": Case("user", lambda: OwnStr(120)),
    "errno_subclass": Case("user", lambda: CheckpointMissing("/ckpt/step-9")),
    "class_in_a_function": Case("user", _nested_function_class),
}


def raised(kind: str) -> BaseException:
    """The table's exception ``kind``, raised and caught (with its traceback)."""
    try:
        made = CASES[kind].make()
        if made is not None:
            raise made
    except BaseException as exc:
        return exc
    raise AssertionError(f"{kind} raised nothing")


def raise_on_rank(kind: str, rank: int = 1) -> str:
    """Raise the table's exception ``kind`` on ``rank`` (RANK from the environment); the other
    ranks return "ok"."""
    if int(os.environ.get("RANK", "0")) == rank:
        raise raised(kind)
    return "ok"
