#!/usr/bin/env python3
"""The documentation's benchmark tables, generated from ``benchmarks/results/*.json``.

    python scripts/bench_tables.py            # print the Markdown page
    python scripts/bench_tables.py -o x.md    # write it

The docs build calls :func:`render` (``scripts/docs_hooks.py``), so the page is never written by
hand and never committed. Each file's section starts with where its figures come from: the date,
commit and machine its benchmark stored under ``"provenance"`` (``benchmarks/provenance.py``).
A file without that stamp is shown with the date and commit of the git commit that last changed
it, and the machine its JSON names, said as such. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# file -> (title, the command that writes it, what it measures). Files not listed here are
# rendered too, after these, under their file name.
KNOWN: dict[str, tuple[str, str, str]] = {
    "gate.json": (
        "The gate: every headline figure beside its peer",
        "OMP_NUM_THREADS=1 benchmarks/gate",
        "Each figure measured side by side with its peer in one run and judged against the "
        "bounds in `benchmarks/gate.toml`: inside the bound *pass*, inside the noise margin "
        "*pass (noise)*, beyond it *FAIL*.",
    ),
    "gate_quick.json": (
        "The gate, smoke run",
        "benchmarks/gate --quick",
        "Fewer repeats and the small offload model: a check that every section runs, not "
        "figures to quote.",
    ),
    "gate_launch_magics_repeat3.json": (
        "The gate's launch and magic rows, median of 3 runs",
        "benchmarks/gate --repeat 3 --only launch,magics",
        "The rows nearest their bounds, judged by the median of three whole runs.",
    ),
    "first_step.json": (
        "Time to the first optimizer step of real work",
        "python benchmarks/bench_first_step.py",
        "Real work on 2 CPU ranks in fresh kernels that imported its libraries: the time from "
        "the launch call to the last rank's first step, on a kernel's first launch and on later "
        "ones, medians over kernels. (a) a small Llama (transformers) prepared with the "
        "library's own `Accelerator` and stepped with AdamW, (b) a DeepSpeed ZeRO-3 engine "
        "built and stepped, (c) a 4-bit (nf4) model loaded and run forward, each beside "
        "Accelerate's `notebook_launcher`; (d) a new `%%distributed` pool and its first cell, "
        "beside nbdistributed.",
    ),
    "first_step_trainer.json": (
        "transformers' Trainer: first optimizer step and time per step",
        "python benchmarks/bench_first_step.py --workload trainer",
        "`Trainer` on a small Llama (built from its config), 2 CPU ranks, 200 steps a run: the "
        "time from the launch call to the last rank's first optimizer step, and "
        "`train_runtime` per step, under nbaccel's `notebook_launcher` (a fresh kernel) and "
        "`nbaccel launch --cpu`, beside Accelerate's `notebook_launcher` and `accelerate launch "
        "--multi_gpu` (its `--cpu` starts one process); medians of alternating rounds.",
    ),
    "launcher.json": (
        "Launch cost against Accelerate's notebook_launcher",
        "python benchmarks/bench_launcher.py",
        "No-op launches on 2 CPU ranks in a real kernel, alternating with accelerate's "
        "`notebook_launcher`; RAM added when 2 ranks read a 1 GiB tensor passed in `args`.",
    ),
    "magics.json": (
        "Warm %%distributed cells",
        "python benchmarks/bench_magics.py",
        "A warm empty `%%distributed` cell as the client sees it, and the magic's own time, "
        "against a plain cell and against nbdistributed.",
    ),
    "magics_detached.json": (
        "Warm cells on a detached pool after %dist_attach",
        "python benchmarks/bench_magics.py --detached",
        "A warm empty `%%distributed` cell on a detached pool, in a fresh kernel after "
        "`%dist_attach`, against a kernel's own pool; kernels alternate, medians of each "
        "kernel's median over the repeats.",
    ),
    "call_path.json": (
        "A warm pool call after idle gaps",
        "python benchmarks/bench_call_path.py",
        "One pool call on 8 ranks after idle gaps of 0-50 ms, against the smallest call protocol "
        "on the same processes and a bare echo.",
    ),
    "training.json": (
        "Training steps per second",
        "python benchmarks/bench_training.py",
        "Accelerator-prepared training against hand-written DDP and accelerate, 2 gloo ranks, "
        "rounds alternating.",
    ),
    "nlp_example.json": (
        "An nlp_example-style loop",
        "python benchmarks/bench_nlp_example.py",
        "The same script under nbaccel and accelerate (torchrun, 2 CPU ranks): loop wall time "
        "and accuracy.",
    ),
    "device_map.json": (
        "infer_auto_device_map",
        "OMP_NUM_THREADS=1 python benchmarks/bench_device_map.py",
        "Planning MoE-shaped meta models over 3 fake GPUs and the CPU, against accelerate; the "
        "maps are checked equal (`same_map`).",
    ),
    "offload.json": (
        "Disk-offloaded forward of a 0.6B model",
        "python benchmarks/bench_offload.py",
        "Preparation and forward with blocks on disk, against the in-memory model and "
        "accelerate's disk offload; outputs checked identical.",
    ),
    "load.json": (
        "Loading a 1B checkpoint onto the CPU",
        "python benchmarks/bench_load.py",
        "A 1B Llama (fp32, 4 safetensors shards, in the page cache) loaded in fresh processes, "
        "medians of 3: the load call, load + one forward (which touches every weight) and peak "
        "RSS, fp32 / bf16 / nf4 / int8 and half the layers on disk, beside transformers' "
        "`from_pretrained` (`BitsAndBytesConfig` for nf4 and int8) and Accelerate's "
        "`init_empty_weights` + `load_checkpoint_and_dispatch`; logits and quantized weights "
        "checked equal to transformers'.",
    ),
    "load_fp32_bf16.json": (
        "Loading a 1B checkpoint onto the CPU: fp32 and bf16 again",
        "python benchmarks/bench_load.py --modes fp32,bf16",
        "The fp32 and bf16 rows of the run above, measured again once nbaccel's casts onto the "
        "CPU ran on one thread per core.",
    ),
    "load_quantized_threads.json": (
        "Quantized loading on threads: torchao int8 and bitsandbytes int8, 0.25B",
        "python benchmarks/bench_load.py --size 0.25b --modes int8-torchao,int8",
        "A 0.25B Llama quantized while loading onto the CPU, fresh processes, medians of 3, "
        "beside transformers' `TorchAoConfig` / `BitsAndBytesConfig` path in the same run; "
        "every weight quantized on one thread per core. `before_threading` is the torchao row "
        "measured in a separate run while nbaccel quantized torchao weights one at a time.",
    ),
    "load_gpu.json": (
        "Loading a checkpoint onto a GPU",
        "python benchmarks/bench_load.py --gpu --size 0.5b --modes fp32,bf16",
        "The same comparison onto cuda:0: nbaccel streams the mapped shards through pinned "
        "staging buffers.",
    ),
    "widgets.json": (
        "Progress bars and memory monitor",
        "python benchmarks/bench_widgets.py",
        "Event rates of the tqdm bridge, widget traffic, and the cost of the instrumentation.",
    ),
    "reliability.json": (
        "Injected faults",
        "python benchmarks/reliability_report.py",
        "Each fault of `tests/faults.py` on 2 CPU ranks: what the notebook shows, how fast, "
        "whether the next launch works, and what leaked.",
    ),
    "stress_launch.json": (
        "Many launches in one kernel",
        "python benchmarks/stress_launch.py --runs 1000 --failing 100 --killed 100 "
        "(and --day 1000)",
        "Launches and pool cells in a row in one real kernel, counting wrong outcomes and leaks.",
    ),
    "lifecycle.json": (
        "Stop button and shutdown",
        "python benchmarks/bench_lifecycle.py --repeat 3",
        "Seconds from the stop button to the cell's reply, kernel shutdown with a live pool, "
        "and a killed rank whose child keeps writing.",
    ),
    "kernel_limits.json": (
        "Kernel restart and output floods",
        "python benchmarks/bench_kernel_limits.py",
        "Restart of a kernel with a live pool; a cell printing 200,000 lines per rank.",
    ),
    "bench_large_results.json": (
        "Large return values",
        "python benchmarks/bench_large_results.py --gib 1 --ranks 1",
        "The notebook's peak memory when ranks return 1 GiB tensors.",
    ),
    "parallelism.json": (
        "Model-parallel layouts on 4 CPU ranks",
        "python benchmarks/bench_parallelism.py",
        "The same Llama under DDP, FSDP2, HSDP, TP, TP + FSDP2, pipeline and Megatron tp x pp, "
        "with Accelerate's DDP as the peer: per-rank model state, peak RSS growth, step time.",
    ),
    "lowbit.json": (
        "Low-bit inference on the CPU: fp32, bf16, int8, nf4",
        "python benchmarks/bench_lowbit.py",
        "Weights, peak RSS (load and one forward), load time and greedy decode tokens/s of a "
        "Llama-shaped model, loaded by nbaccel (bitsandbytes, torchao) and by transformers' "
        "BitsAndBytesConfig path and torchao used directly, in one run; nbaccel's decode time "
        "over the same backend's used directly (median and best round).",
    ),
    "lowbit_1b.json": (
        "Quantized loading of a 1B-parameter Llama on the CPU",
        "scripts/test-lowbit",
        "load_and_quantize_model in 8-bit and nf4: weight bytes against fp32, bitwise equality "
        "with transformers' BitsAndBytesConfig path, agreement with fp32 (logit cosine, top-1), "
        "8-bit over cpu + disk against in memory.",
    ),
    "hosts.json": (
        "Many hosts",
        "sudo bash scripts/hosts/up 2 && python benchmarks/bench_hosts.py",
        "Launches on 2 hosts x 2 ranks over ssh against the same 4 ranks on one host.",
    ),
    "hosts_first_step.json": (
        "Many hosts: time to the first optimizer step",
        "sudo bash scripts/hosts/up 2 && python benchmarks/bench_hosts.py --first-step",
        "The workload of `bench_first_step.py` (a small Llama, nbaccel's `Accelerator`, AdamW) "
        "on 2 hosts x 1 rank and 2 hosts x 2 ranks over ssh, warm agents, against the same ranks "
        "on one host: the time from the call to the last rank's first optimizer step, medians.",
    ),
    "ray_first_step.json": (
        "Ray: time to the first optimizer step",
        "python benchmarks/bench_ray.py --first-step",
        "The workload of `bench_first_step.py` on a 2-node Ray cluster on this machine, warm "
        "launches against the same ranks on one host, and 4 ranks against Ray Train's "
        "`TorchTrainer.fit()` of the same function.",
    ),
}

_SIGNIFICANT = 4


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{_SIGNIFICANT}g}"
    if _numbers(value):
        low, high = min(value), max(value)
        middle = sorted(value)[len(value) // 2]
        return f"{len(value)} values, {_cell(low)} to {_cell(high)}, median {_cell(middle)}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_cell(v)}" for k, v in value.items()) if value else "none"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) < 160 else text[:157] + "..."


def _numbers(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )


def _flat(value: Any) -> bool:
    """A value shown in one table cell: a scalar, a list of numbers or a small flat mapping."""
    if isinstance(value, dict):
        return len(value) <= 6 and all(not isinstance(v, (dict, list)) for v in value.values())
    if isinstance(value, list):
        return _numbers(value) or all(not isinstance(v, (dict, list)) for v in value)
    return True


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _provenance_line(stamp: dict[str, Any]) -> str:
    line = (
        f"Measured {stamp.get('date', 'on an unrecorded date')} at commit "
        f"`{stamp.get('commit', 'unrecorded')}` on: {stamp.get('machine', 'unrecorded')}."
    )
    note = stamp.get("note")
    return f"{line} ({str(note).rstrip('.')}.)" if note else line


def _fallback_provenance(path: Path, data: Any) -> str:
    machine = data.get("machine") if isinstance(data, dict) else None
    if isinstance(machine, dict):
        machine = _cell(machine)
    inside = path.resolve().is_relative_to(ROOT)
    last = _git("log", "-1", "--format=%h %cs", "--", str(path.resolve())) if inside else ""
    where = (
        f"the commit that last changed this file is `{last.split()[0]}` ({last.split()[1]})"
        if last
        else "the file is not in git history"
    )
    return (
        f"This file carries no provenance stamp: {where}; machine: "
        f"{machine or 'not recorded in the file'}."
    )


def _section(value: dict[str, Any], depth: int, label: str) -> list[str]:
    """A mapping as tables: its flat values as one key/value table, each mapping of uniform
    flat mappings as one table (a row per key), lists of mappings as tables, the rest nested."""
    lines: list[str] = []
    if label:
        lines += [f"{'#' * min(depth, 6)} {label}", ""]
    stamp = value.get("provenance")
    if isinstance(stamp, dict):
        lines += [_provenance_line(stamp), ""]
    flat = [(k, v) for k, v in value.items() if k != "provenance" and _flat(v)]
    if flat:
        lines += _table(["figure", "value"], [[k, v] for k, v in flat])
    for key, child in value.items():
        if key == "provenance" or _flat(child):
            continue
        if isinstance(child, list) and all(isinstance(r, dict) for r in child):
            columns = list(dict.fromkeys(c for r in child for c in r if c != "provenance"))
            lines += [f"{'#' * min(depth + 1, 6)} {key}", ""]
            lines += _table(columns, [[r.get(c, "") for c in columns] for r in child])
        elif isinstance(child, dict) and _uniform(child):
            columns = list(dict.fromkeys(c for r in child.values() for c in r))
            lines += [f"{'#' * min(depth + 1, 6)} {key}", ""]
            lines += _table(
                ["", *columns], [[k, *(r.get(c, "") for c in columns)] for k, r in child.items()]
            )
        elif isinstance(child, dict):
            lines += _section(child, depth + 1, str(key))
        else:
            lines += [f"**{key}**: {_cell(child)}", ""]
    return lines


def _uniform(value: dict[str, Any]) -> bool:
    rows = list(value.values())
    return (
        len(rows) >= 2
        and all(isinstance(r, dict) and r for r in rows)
        and all(all(_flat(v) and not isinstance(v, dict) for v in r.values()) for r in rows)
    )


def _gate(data: dict[str, Any]) -> list[str]:
    rows = [
        [r["figure"], r["peer"], r["value"], r["threshold"], r["verdict"], r["detail"]]
        for r in data.get("rows", [])
    ]
    lines = _table(
        ["figure", "peer", "ratio", "threshold", "verdict", "measured (ours vs peer)"], rows
    )
    start, end = data.get("load_average_start"), data.get("load_average_end")
    if start and end:
        lines += [f"Load average at the start {_cell(start[0])}, at the end {_cell(end[0])}.", ""]
    return lines


def render_file(path: Path) -> list[str]:
    """One results file as a section of the page."""
    data = json.loads(path.read_text())
    title, command, about = KNOWN.get(path.name, (path.stem.replace("_", " "), "", ""))
    lines = [
        f"## {title}",
        "",
        f"Source: `benchmarks/results/{path.name}`"
        + (f", written by `{command}`." if command else "."),
        "",
    ]
    if about:
        lines += [about, ""]
    stamped = isinstance(data, dict) and (
        isinstance(data.get("provenance"), dict)
        or any(isinstance(v, dict) and "provenance" in v for v in data.values())
    )
    if not stamped:
        lines += [_fallback_provenance(path, data), ""]
    if path.name.startswith("gate") and isinstance(data, dict) and "rows" in data:
        if isinstance(data.get("provenance"), dict):
            lines += [_provenance_line(data["provenance"]), ""]
        return lines + _gate(data)
    if isinstance(data, dict):
        return lines + _section(data, 2, "")
    return lines + [f"`{_cell(data)}`", ""]


def render(results: Path = RESULTS) -> str:
    """The whole page: the known files in a reading order, then any other results file."""
    files = sorted(results.glob("*.json"))
    order = {name: i for i, name in enumerate(KNOWN)}
    files.sort(key=lambda p: (order.get(p.name, len(order)), p.name))
    lines = [
        "# Benchmark results",
        "",
        "Every table on this page is generated at build time from the JSON files in "
        "`benchmarks/results/` by `scripts/bench_tables.py`; none is written by hand. Each "
        "section says where its figures come from (date, commit, machine). How to run the "
        "benchmarks and what each compares: [Benchmarks](benchmarks.md).",
        "",
    ]
    for path in files:
        lines += render_file(path)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", help="write the page here (default: print it)")
    parser.add_argument("--results", default=str(RESULTS), help="the results folder")
    args = parser.parse_args(argv)
    page = render(Path(args.results))
    if args.output:
        Path(args.output).write_text(page)
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
