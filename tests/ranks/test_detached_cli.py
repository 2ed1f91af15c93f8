"""The command line of detached runs: ``nbaccel launch --detach`` returns at once with the
run's id; ``runs logs ID --follow`` prints its lines until it ends,
``runs result ID`` its ranks' results, ``runs rm ID`` removes its folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from detached import runs_fixture  # noqa: F401 (the fixture `runs`)

from nbaccel.launch.detached.folder import list_runs

SCRIPT = """
import os
for i in range(50):
    print(f"step {i}", flush=True)
print("rank", os.environ["RANK"], "done")
"""


def _nbaccel(*args: str, env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nbaccel", *args], capture_output=True, text=True,
        env={**os.environ, **env}, cwd=cwd, timeout=300,
    )  # fmt: skip


def test_launch_detach_then_runs_logs_result_and_rm(runs, tmp_path):
    root, _, env = runs
    (tmp_path / "steps.py").write_text(SCRIPT)
    started = _nbaccel("launch", "--detach", "--cpu", "--num_processes", "2", "steps.py",
                       env=env, cwd=tmp_path)  # fmt: skip
    assert started.returncode == 0, started.stderr
    run_id = re.search(r"detached run (\S+)", started.stdout).group(1)

    logs = _nbaccel("runs", "logs", run_id, "--follow", env=env, cwd=tmp_path)
    assert logs.returncode == 0, logs.stderr
    for rank in (0, 1):
        steps = re.findall(rf"^\[rank {rank}\] step (\d+)$", logs.stdout, re.M)
        assert steps == [str(i) for i in range(50)], logs.stdout[-500:]
        assert f"[rank {rank}] rank {rank} done" in logs.stdout

    (info,) = list_runs(root)  # what `nbaccel runs` prints (its table is RunInfo.row())
    assert info.id == run_id and info.state == "finished" and "done" in info.last_line, info
    result = _nbaccel("runs", "result", run_id[:17], env=env, cwd=tmp_path)  # a unique start
    assert result.returncode == 0 and "[rank 1] None" in result.stdout, result
    removed = _nbaccel("runs", "rm", run_id, env=env, cwd=tmp_path)
    assert removed.returncode == 0 and not (root / run_id).exists(), removed.stderr
