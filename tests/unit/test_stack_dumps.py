"""A rank's stack dumps without nbaccel's frames (launch/driver/stack_dumps.py), on dumps as
faulthandler writes them (the same shapes the launch tests produce for real: a timeout, a
crash), with a rank's paths on another host."""

from __future__ import annotations

from nbaccel.launch.driver.stack_dumps import StackDumpFilter

_SITE = "/home/ann/venv/lib/python3.11/site-packages"
_DUMP = f"""\
loss 0.25
Fatal Python error: Segmentation fault

Thread 0x00007f01405ff6c0 (most recent call first):
  File "{_SITE}/nbaccel/launch/rank/watch.py", line 99 in _run
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

Thread 0x00007f0140000000 (most recent call first):
  File "/home/ann/train.py", line 12 in load_shard
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f0130000000 (most recent call first):
  <no Python frame>

Current thread 0x00007f015f3cbb80 (most recent call first):
  File "{_SITE}/torch/distributed/distributed_c10d.py", line 4159 in barrier
  File "/home/ann/train.py", line 30 in step
  File "<rank-cell-3>", line 2 in <module>
  File "{_SITE}/nbaccel/notebook/rank/pool_worker.py", line 186 in _run_source
  File "{_SITE}/nbaccel/launch/rank/worker.py", line 217 in _run_call
  File "{_SITE}/nbaccel/launch/launchers/forkserver/loop.py", line 235 in serve
  File "<string>", line 1 in <module>

Extension modules: torch._C (total: 1)
after the dump"""

#: exactly the lines left out: the watcher thread's block (with its blank line), the engine's
#: frames under the user's, and the fork server's bootstrap under them
_HIDDEN = f"""\
Thread 0x00007f01405ff6c0 (most recent call first):
  File "{_SITE}/nbaccel/launch/rank/watch.py", line 99 in _run
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

  File "{_SITE}/nbaccel/notebook/rank/pool_worker.py", line 186 in _run_source
  File "{_SITE}/nbaccel/launch/rank/worker.py", line 217 in _run_call
  File "{_SITE}/nbaccel/launch/launchers/forkserver/loop.py", line 235 in serve
  File "<string>", line 1 in <module>""".split("\n")


def _through(text: str) -> list[str]:
    dumps = StackDumpFilter()
    shown = [out for line in text.split("\n") for out in dumps.feed(line)]
    return shown + dumps.flush()


def test_the_watcher_thread_and_the_engines_frames_are_left_out():
    lines = _DUMP.split("\n")
    watcher = lines.index(_HIDDEN[0])
    kept = lines[:watcher] + [line for line in lines[watcher + 5 :] if line not in _HIDDEN[5:]]
    assert _through(_DUMP) == kept
    assert '  File "/home/ann/train.py", line 30 in step' in kept  # the user's frames stay


def test_a_user_string_frame_above_the_engine_is_kept_and_output_outside_dumps_is_untouched():
    text = 'Current thread 0x1 (most recent call first):\n  File "<string>", line 1 in <module>'
    assert _through(text) == text.split("\n")  # exec'd by the user: not under the engine
    plain = ['  File "x.py", line 1 in f', "Thread 0xzz is not a header", ""]
    assert _through("\n".join(plain)) == plain  # frame-like lines outside a dump stay


def test_a_header_whose_frames_never_came_is_passed_on_at_the_end():
    dumps = StackDumpFilter()
    assert dumps.feed("Thread 0x00007f0140000000 (most recent call first):") == []
    assert dumps.flush() == ["Thread 0x00007f0140000000 (most recent call first):"]
