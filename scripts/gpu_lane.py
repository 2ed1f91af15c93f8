"""The GPU lane (run through ``scripts/test-gpu``): dependencies from carried wheels, the tests
marked ``gpu``, the offload benchmark, one summary.

Nothing is fetched from the network: packages this Python lacks are installed from the wheel
folder (``.whl/`` or ``$NBACCEL_WHEELS``) into ``.gpu-site/``, which goes first on the path of
the tests, their kernels and their ranks. Without CUDA the lane still runs to the end: every test
skips with its reason and the benchmark runs its ``--dry-run``. Writes
``benchmarks/results/gpu-lane-<device>-<date>.json`` (and the benchmark its own file).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".gpu-site"
#: module -> the pip package that provides it
REQUIRED = {
    "torch": "torch", "IPython": "ipython", "ipykernel": "ipykernel", "ipywidgets": "ipywidgets",
    "jupyter_client": "jupyter-client", "nbclient": "nbclient", "nbformat": "nbformat",
    "zmq": "pyzmq", "cloudpickle": "cloudpickle", "tqdm": "tqdm", "matplotlib": "matplotlib",
    "safetensors": "safetensors", "psutil": "psutil", "yaml": "pyyaml", "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
}  # fmt: skip
OPTIONAL = {"transformers": "the Llama dispatch tests", "accelerate": "the benchmark's peer"}


def _missing(names) -> list[str]:
    return [m for m in names if importlib.util.find_spec(m) is None]


def _use_site() -> None:
    """Put .gpu-site first, here and for every process the lane starts."""
    path = str(SITE)
    if path not in sys.path:
        sys.path.insert(0, path)
    importlib.invalidate_caches()
    parts = [path, str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))


def ensure_dependencies() -> None:
    """Install what is missing from the carried wheels; exit 2 naming what cannot be found."""
    if SITE.is_dir():
        _use_site()
    missing = _missing(REQUIRED)
    wheels = Path(os.environ.get("NBACCEL_WHEELS", ROOT / ".whl"))
    if missing and wheels.is_dir() and any(wheels.glob("*.whl")):
        print(f"installing from {wheels} into {SITE}: {', '.join(REQUIRED[m] for m in missing)}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-index", "--find-links", str(wheels), "--target", str(SITE), "--no-compile",
             *sorted({REQUIRED[m] for m in missing})],
            check=False,
        )  # fmt: skip
        _use_site()
        missing = _missing(REQUIRED)
    if missing:
        packages = " ".join(sorted({REQUIRED[m] for m in missing}))
        sys.exit(
            f"scripts/test-gpu: {sys.executable} lacks {packages}, and {wheels} does not provide "
            f"them. On a machine with network: `scripts/gpu-wheels {packages}` (wheels for "
            "this machine's Python), then carry .whl/ beside the checkout and run again."
        )
    _use_site()


def describe_machine() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "date": datetime.date.today().isoformat(),
        "optional_missing": {m: why for m, why in OPTIONAL.items() if _missing([m])},
    }


def run_tests(extra: list[str], report: Path) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rfEs", "-p", "no:cacheprovider",
               "--continue-on-collection-errors",
               f"--junitxml={report}", *extra]  # fmt: skip
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, check=False)
    counts: dict = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skip_reasons": []}
    if report.exists():
        reasons = set()
        for case in ElementTree.parse(report).iter("testcase"):
            outcome = next(iter(case), None)
            if outcome is None or outcome.tag in ("system-out", "system-err"):
                counts["passed"] += 1
            elif outcome.tag == "failure":
                counts["failed"] += 1
            elif outcome.tag == "error":
                counts["errors"] += 1
            elif outcome.tag == "skipped" and outcome.get("message") != "collection skipped":
                counts["skipped"] += 1  # (a module without gpu tests that cannot import: not one)
                reasons.add(outcome.get("message", ""))
        counts["skip_reasons"] = sorted(reasons)
    counts["exit_code"] = done.returncode
    return counts


def run_benchmark(cuda: bool) -> dict:
    if os.environ.get("NBACCEL_GPU_BENCH") == "0":
        return {"skipped": "NBACCEL_GPU_BENCH=0"}
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu_offload.py")]
    command += os.environ.get("NBACCEL_GPU_BENCH_ARGS", "").split()
    if not cuda:
        command.append("--dry-run")
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode != 0:
        return {"failed": f"exit code {done.returncode}", "stderr": done.stderr[-2000:]}
    return json.loads(done.stdout)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> int:
    ensure_dependencies()
    machine = describe_machine()
    cuda = bool(machine["gpus"])
    slug = re.sub(r"[^A-Za-z0-9]+", "-", machine["gpus"][0] if cuda else "no-gpu").strip("-")
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-lane-{slug}-{machine['date']}"
    tests = run_tests(sys.argv[1:], results / f"{stem}.xml")
    bench = run_benchmark(cuda)
    summary = {"machine": machine, "tests": tests, "benchmark": bench}
    (results / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    gpus = ", ".join(machine["gpus"]) or "none (torch.cuda.is_available() is False)"
    lines = [
        "",
        "== nbaccel GPU lane ==",
        f"GPUs: {gpus}; torch {machine['torch']}, CUDA {machine['cuda']}; {machine['date']}",
        f"tests marked gpu: {tests['passed']} passed, {tests['failed']} failed, "
        f"{tests['errors']} errors, {tests['skipped']} skipped",
    ]
    lines += [f"  skipped: {reason}" for reason in tests.get("skip_reasons", [])]
    lines += [f"  optional, missing: {m} ({why})" for m, why in machine["optional_missing"].items()]
    if "tokens_per_s" in bench:
        bandwidth = bench["pinned_h2d_bytes_per_s"]
        kind = "dry run on CPU, timings not meaningful" if bench.get("dry_run") else bench["device"]
        lines.append(
            f"offload benchmark ({kind}): nbaccel {_fmt(bench['tokens_per_s'], '.3g')} tokens/s, "
            f"accelerate {_fmt(bench['accelerate'].get('tokens_per_s'), '.3g')} tokens/s, ratio "
            f"{_fmt(bench['ratio_vs_accelerate'], '.2f')} (goal >= 3); streaming at "
            f"{_fmt(bench['fraction_of_pinned_bandwidth'], '.0%')} of the pinned H2D bandwidth "
            f"{_fmt(bandwidth and bandwidth / 1e9, '.1f')} GB/s (goal >= 70%)"
        )
    else:
        lines.append(f"offload benchmark: {bench}")
    lines.append(f"written: benchmarks/results/{stem}.json, .xml")
    print("\n".join(lines))
    return 0 if tests["exit_code"] in (0, 5) and "failed" not in bench else 1


if __name__ == "__main__":
    sys.exit(main())
