"""``nbaccel launch``: real scripts in a temporary directory, run on 2 CPU ranks in a subprocess,
including one written for ``accelerate launch`` with the import swapped literally."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ACCELERATE_SCRIPT = """
    import argparse

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--epochs", type=int, default=1)
        parser.add_argument("--lr", type=float, default=0.1)
        args = parser.parse_args()
        accelerator = Accelerator()
        set_seed(0)
        x = torch.randn(64, 3)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for _ in range(args.epochs):
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
        seen = accelerator.gather_for_metrics(torch.ones(1)).sum().item()
        accelerator.print(f"world={accelerator.num_processes} loss={loss.item():.4f} seen={seen}")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            print("main process done")


    if __name__ == "__main__":
        main()
"""


def _launch(tmp_path: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "nbaccel", "launch", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _write(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_accelerate_script_with_the_import_swapped(tmp_path):
    _write(tmp_path, "train.py", ACCELERATE_SCRIPT.replace("accelerate", "nbaccel"))
    done = _launch(tmp_path, "--num_processes", "2", "--cpu", "train.py", "--epochs", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    result = [line for line in lines if "world=2" in line]
    assert len(result) == 1 and result[0].startswith("[rank 0]"), done.stdout
    assert "seen=2.0" in result[0]
    assert "[rank 0] main process done" in lines


def test_argv_name_main_and_module_mode(tmp_path):
    _write(
        tmp_path,
        "pkg/tool.py",
        """
        import os, sys
        print(f"{__name__} argv={sys.argv[1:]} rank={os.environ['RANK']}")
        """,
    )
    (tmp_path / "pkg" / "__init__.py").write_text("")
    done = _launch(tmp_path, "--num_processes", "2", "--cpu", "-m", "pkg.tool", "--x", "1")
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] __main__ argv=['--x', '1'] rank={rank}" in done.stdout


def test_failing_rank_is_named_and_exit_code_kept(tmp_path):
    _write(
        tmp_path,
        "fail.py",
        """
        import os, sys
        if os.environ["RANK"] == "1":
            raise ValueError("bad shard")
        """,
    )
    _write(
        tmp_path,
        "code.py",
        """
        import os, sys
        sys.exit(7 if os.environ["RANK"] == "1" else 0)
        """,
    )
    failed = _launch(tmp_path, "--num_processes", "2", "--cpu", "fail.py")
    assert failed.returncode == 1
    assert "rank 1 failed: ValueError" in failed.stderr and "bad shard" in failed.stderr
    assert 'fail.py", line 4' in failed.stderr  # the rank's own traceback
    coded = _launch(tmp_path, "--num_processes", "2", "--cpu", "code.py")
    assert coded.returncode == 7
    assert "rank 1 exited with code 7" in coded.stderr


def test_bad_arguments_fail_before_launching(tmp_path):
    missing = _launch(tmp_path, "--cpu", "nope.py", timeout=60)
    assert missing.returncode != 0 and "no such script: 'nope.py'" in missing.stderr
    _write(tmp_path, "x.py", "print('never runs')\n")
    uneven = _launch(
        tmp_path, "--num_processes", "3", "--num_machines", "2", "--cpu", "x.py", timeout=60
    )
    assert uneven.returncode != 0 and "must divide" in uneven.stderr
    assert "never runs" not in uneven.stdout


def test_use_fsdp_on_the_command_line_shards_a_plain_accelerator(tmp_path):
    """``accelerate launch --use_fsdp ...`` configures the script's plain ``Accelerator()``."""
    _write(
        tmp_path,
        "fsdp.py",
        """
        import torch
        from torch.distributed.tensor import DTensor
        from nbaccel import Accelerator

        accelerator = Accelerator()
        plugin = accelerator.state.fsdp_plugin
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        model = accelerator.prepare(model)
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        print(
            f"type={accelerator.distributed_type.value} sharded={sharded} "
            f"reshard={plugin.reshard_after_forward} dict={plugin.state_dict_type}"
        )
        """,
    )
    done = _launch(
        tmp_path,
        "--num_processes", "2", "--use_fsdp",  # no GPU here: CPU ranks (gloo)
        "--fsdp_reshard_after_forward", "false",
        "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
        "fsdp.py",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert (
            f"[rank {rank}] type=FSDP sharded=True reshard=False dict=SHARDED_STATE_DICT"
            in done.stdout
        ), done.stdout
