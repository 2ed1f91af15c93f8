"""The preload setting (``preload=``, ``NBACCEL_PRELOAD``) and which of a process's modules the
fork server imports for the ranks (``launch.launchers.forkserver.kernel_modules``)."""

from __future__ import annotations

import types

import pytest

from nbaccel.launch.launchers.forkserver.kernel_modules import (
    changed_files,
    check_preload,
    file_stamps,
    kernel_modules,
    preload_setting,
)
from nbaccel.launch.request import Front, LaunchRequest


def test_the_setting_from_the_option_else_the_environment():
    assert preload_setting(None, {}).mirror is None  # auto: mirror inside a kernel
    assert preload_setting(None, {"NBACCEL_PRELOAD": "off"}).mirror is False
    setting = preload_setting(check_preload("peft,-mylib"), {"NBACCEL_PRELOAD": "off"})
    assert setting.mirror is None and setting.add == ("peft",)
    assert setting.exclude == frozenset({"mylib"})
    assert preload_setting(check_preload(["off", "peft"]), {}).add == ("peft",)
    assert preload_setting(check_preload(True), {}).mirrors() is True
    assert preload_setting(check_preload(False), {}).mirrors() is False


def test_bad_preload_values_name_the_accepted_forms():
    with pytest.raises(ValueError, match="not a module name"):
        LaunchRequest(preload="trans formers")
    with pytest.raises(ValueError, match="preload must be True, False"):
        LaunchRequest(preload=3)
    assert LaunchRequest(preload="off").preload == ("off",)
    assert "preload" in LaunchRequest.options(Front.CLI)  # --preload, derived


def _module(name, origin="/somewhere/x.py", spec_name=None, package=False):
    module = types.ModuleType(name)
    search = ["/somewhere"] if package else None
    module.__spec__ = types.SimpleNamespace(
        name=spec_name or name, origin=origin, submodule_search_locations=search
    )
    return module


def test_only_libraries_imported_by_their_own_name_are_mirrored():
    modules = {
        "json": _module("json"),  # the standard library
        "IPython": _module("IPython"),  # the kernel's machinery
        "nbaccel.launch": _module("nbaccel.launch"),
        "six.moves": _module("six.moves", spec_name="six"),  # an alias
        "built": _module("built", origin=None),  # made in memory
        "ns": _module("ns", origin=None, package=True),  # a namespace package imports
        "transformers.models": _module("transformers.models"),
        "transformers": _module("transformers"),
        "mylib": _module("mylib"),
        "mylib.sub": _module("mylib.sub"),
        "gone": None,
    }
    assert kernel_modules(modules=modules) == [
        "mylib", "ns", "transformers", "mylib.sub", "transformers.models"
    ]  # fmt: skip
    assert kernel_modules(["mylib"], modules) == ["ns", "transformers", "transformers.models"]


def test_a_user_file_is_stamped_and_its_edit_seen(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("x = 1\n")
    module = _module("mine")
    module.__file__ = str(path)
    stamps = file_stamps(["mine"], {"mine": module})
    assert changed_files(stamps) == []
    path.write_text("x = 2\n")
    stat = path.stat()
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert changed_files(stamps) == ["mine"]
