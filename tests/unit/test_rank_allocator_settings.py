"""What a rank sets in glibc's malloc, from the notebook's environment (no process started; the
ranks' behaviour is tests/ranks/test_rank_allocator.py)."""

from __future__ import annotations

import pytest

from nbaccel.launch.rank.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, settings

DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD}


@pytest.mark.parametrize("flag", ["", "1", "yes", "on"])
def test_ranks_keep_freed_memory_by_default(flag):
    assert settings({"NBACCEL_KEEP_FREED_MEMORY": flag}) == DEFAULTS
    assert MMAP_THRESHOLD == 8 << 20 and TRIM_THRESHOLD == 32 << 20


@pytest.mark.parametrize(
    "env",
    [
        {"NBACCEL_KEEP_FREED_MEMORY": "0"},
        {"NBACCEL_KEEP_FREED_MEMORY": "off"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
        {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
    ],
)
def test_nothing_is_set_when_turned_off_or_tuned_otherwise(env):
    assert settings(env) == {}


def test_the_notebooks_own_variables_win_and_only_they_apply():
    env = {"MALLOC_TRIM_THRESHOLD_": " 0 ", "MALLOC_MMAP_MAX_": "0", "GLIBC_TUNABLES": "x.y=1"}
    assert settings(env) == {"MALLOC_TRIM_THRESHOLD_": 0, "MALLOC_MMAP_MAX_": 0}


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"NBACCEL_KEEP_FREED_MEMORY": "maybe"}, r"NBACCEL_KEEP_FREED_MEMORY='maybe' is not a"),
        ({"MALLOC_TOP_PAD_": "1MB"}, r"MALLOC_TOP_PAD_='1MB' is not a number of bytes: set it"),
    ],
)
def test_a_value_that_cannot_be_used_is_named(env, pattern):
    with pytest.raises(ValueError, match=pattern):
        settings(env)
