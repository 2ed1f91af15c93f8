"""Time to the first step of real work, in real kernels: nbaccel vs its peers.

Run: PYTHONPATH=. .venv/bin/python benchmarks/bench_first_step.py [--kernels 3] [--later 2]
     [--workload a,b,c,d,trainer] [--order first|after] [--steps N] [--quick]

Each library runs in its own fresh Jupyter kernel (``tests/kernel.py``), ``--kernels`` kernels
per library, alternating; in each kernel the work is launched once and then ``--later`` more
times. The figure is the time from the launch call to the last rank's first step (wall clock,
shared by the processes), on the kernel's first launch and on its later launches, medians over
kernels. Every workload checks that both libraries did the same work (the same losses or
outputs on every rank) and stops on any error of either library.

Workload (a): the notebook imports torch and transformers (``LlamaForCausalLM``) and the
launcher at its top, as notebooks do; the launched function imports transformers, builds a
small Llama from its config (hidden 256, 2 layers, vocabulary 32000), prepares it with the
library's own ``Accelerator`` (CPU ranks, gloo) and takes 3 AdamW steps. Measured: the time from
the ``notebook_launcher`` call to the last rank's first ``optimizer.step()``; the seconds each
rank spent importing; each rank's unique memory (USS) after its first step; the fork server's
resident memory (nbaccel). Peer: Accelerate's ``notebook_launcher`` and ``Accelerator``.

Workload (b): a DeepSpeed ZeRO-3 engine. The notebook sets ``DS_ACCELERATOR=cpu`` and imports
torch, transformers and deepspeed at its top; the launched function builds the same Llama,
creates the library's ``Accelerator`` with a ``DeepSpeedPlugin`` holding one DeepSpeed config
(ZeRO stage 3, micro batch 2 per rank, no gradient clipping, the same dict for both), prepares
the model and AdamW (the DeepSpeed engine is built there) and takes 3 steps; the figure stops at
the last rank's first ``optimizer.step()`` (the engine's step). Accelerate runs DeepSpeed on CPU
ranks only with ``InitProcessGroupKwargs(backend="gloo")``, which it is given; both leave out
DeepSpeed's shared-memory all-reduce op (a JIT build of minutes that serves inference only): the
function marks it unavailable in DeepSpeed's op table before the ``Accelerator`` starts, with the
same lines for both libraries.

Workload (c): a 4-bit model. A small random Llama (hidden 256, 2 layers, vocabulary 32000) is
saved to a temporary folder once, outside the timing; the notebook imports torch and
transformers (``BitsAndBytesConfig``) at its top; the launched function creates the library's
``Accelerator`` (its rank), loads the saved model with transformers' ``from_pretrained`` and
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` (bitsandbytes' CPU
backend, float32 compute, ``device_map="cpu"``) and runs one forward of 2 x 64 tokens; the
figure stops at the last rank's first forward done. The outputs (logits summaries) must match.

Workload (d): a new ``%%distributed`` pool and its first cell, which imports transformers,
builds the same Llama, prepares it with an ``Accelerator`` and takes a step, in a kernel that
imported torch and transformers; the figure runs from the cell that starts the pool to the last
rank's first step. nbaccel: ``%%distributed -n 2 --cpu`` starts the pool and runs the cell (its
``Accelerator``). Peer: nbdistributed (0.1.0), whose ``%dist_init -n 2`` starts 2 worker
processes (gloo when CUDA is absent) and whose ``%%distributed`` runs the same cell on them, with
Accelerate's ``Accelerator`` (the cell is otherwise the same). nbdistributed starts its workers
with ``python`` from PATH, so the venv's ``bin`` comes first on the kernel's PATH (for both
libraries). Its ``%dist_init`` returns after a fixed 2 s wait, and a cell sent before the
workers have connected is lost (its ZMQ ROUTER socket drops messages to peers not yet
connected) and fails after its 30 s timeout; so the start cell waits until both workers answer
a status request (tried every 0.1 s), as a person waits before running the next cell: that wait
is part of the figure. nbaccel's ranks are forked from its fork server, which has imported the
kernel's libraries; nbdistributed's workers are new interpreters that import them in the cell.
Later launches: the pool is shut down and a new one started in the same kernel (nbaccel:
``%dist_shutdown``; nbdistributed: its process manager ends its own workers, by their process
handles: its ``%dist_shutdown`` leaves them running in 0.1.0, and its ``%dist_reset`` ends
processes by name pattern, ``pkill -f worker.py``, across the machine).

``--order after``: the launcher is imported after the notebook's libraries (nbaccel's fork
server then starts only when nbaccel is imported, and imports them from there); workloads
(a)-(c), written to ``first_step_after.json``.

Workload (trainer): transformers' ``Trainer`` on the tiny Llama of ``tests/_llama.py``
(``benchmarks/trainer_steps.py``: 200 optimizer steps, ``--quick`` 40, 4 sequences per rank and
step) on 2 CPU ranks under four fronts, one launch each per round, the order reversed every other
round: nbaccel's ``notebook_launcher(train, num_processes=2, cpu=True)`` and Accelerate's
``notebook_launcher`` (each in a fresh kernel that imported torch and transformers; ``Trainer`` is
imported inside the function, since Accelerate's launcher refuses to start once bitsandbytes,
which importing ``Trainer`` loads, is imported), ``nbaccel launch --cpu --num_processes 2
trainer_steps.py`` and ``accelerate launch --multi_gpu --num_processes 2 trainer_steps.py`` (its
``--cpu`` starts one process, several only under ``mpirun``; with ``--multi_gpu`` torchrun starts
2, which train on the CPU as ``use_cpu=True`` asks). Figures: the time from the launch call (the
parent's ``time.time()``) to the last rank's first ``on_step_end`` (a ``TrainerCallback``, same
clock), and ``train_runtime`` per step of the slower rank; medians over ``--kernels`` rounds,
ratios nbaccel / Accelerate for the notebook pair and the script pair; every front's losses must
agree within 1e-4. Written to ``first_step_trainer.json``.

Workload (e), ranks on 2 Ray nodes against Ray Train's ``TorchTrainer.fit``, is
``bench_ray.py --first-step``; the same ranks on ssh hosts, ``bench_hosts.py --first-step`` (both
reuse this workload's function).

Results: benchmarks/results/first_step.json (with provenance and the machine's load average).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

LIBRARIES = ("nbaccel", "accelerate")

IMPORTS = """
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
"""

LLAMA = """LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=32000)"""

#: the training of workloads (a) and (b): build the Llama, prepare it, take 3 AdamW steps, note
#: the time of the first and the rank's unique memory then (no braces: it goes into templates)
STEPS = """    torch.manual_seed(0)
    config = LLAMA
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1 + accelerator.process_index)
    first, losses, uss = None, [], None
    for _ in range(3):
        ids = torch.randint(0, 32000, (2, 64), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if first is None:
            first = time.time()
            import psutil
            uss = psutil.Process().memory_full_info().uss
        losses.append(round(float(loss), 5))
""".replace("LLAMA", LLAMA)

FUNCTION = """
def train(folder):
    import json, os, time
    started = time.time()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from {lib} import Accelerator
    imported = time.time() - started
    accelerator = Accelerator(cpu=True)
STEPS
    result = {{"first_step": first, "losses": losses, "imports_s": imported, "uss": uss,
              "pid": os.getpid()}}
    # Accelerate's launcher returns nothing: both libraries' ranks leave their figures in files
    with open(os.path.join(folder, f"rank{{accelerator.process_index}}.json"), "w") as handle:
        json.dump(result, handle)
""".replace("STEPS\n", STEPS)

DEEPSPEED_IMPORTS = """
import os
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # CPU ranks: DeepSpeed's CPU accelerator
import torch, transformers, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
"""

# the same DeepSpeed set-up for both libraries, before either Accelerator starts
WITHOUT_SHM_OP = """
    import deepspeed.ops

    class OnDemand(dict):  # DeepSpeed's op table, each op probed only when asked about
        def __missing__(self, name):
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from deepspeed.ops.op_builder.builder import probe_is_compatible
            builder = ALL_OPS.get(name)
            self[name] = builder is not None and bool(probe_is_compatible(builder))
            return self[name]

        def get(self, name, default=None):
            return self[name]

    if "__compatible_ops__" not in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__ = OnDemand()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
"""

DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 4,
    "gradient_clipping": 0.0,
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
    "zero_optimization": {"stage": 3},
}

DEEPSPEED_LIBRARY = {
    "nbaccel": (
        "from nbaccel import Accelerator, DeepSpeedPlugin",
        "",
    ),
    "accelerate": (
        "from accelerate import Accelerator\n"
        "    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs",
        ', kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]',
    ),
}

DEEPSPEED_FUNCTION = (
    """
def train(folder):
    import json, os, time
    started = time.time()
    import torch, deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    {library_imports}
    imported = time.time() - started
"""
    + WITHOUT_SHM_OP
    + """
    plugin = DeepSpeedPlugin(hf_ds_config=CONFIG)
    accelerator = Accelerator(deepspeed_plugin=plugin{accelerator_kwargs})
STEPS
    engine = type(model).__module__ + "." + type(model).__name__
    result = {{"first_step": first, "losses": losses, "imports_s": imported, "uss": uss,
              "pid": os.getpid(), "engine": engine}}
    with open(os.path.join(folder, f"rank{{accelerator.process_index}}.json"), "w") as handle:
        json.dump(result, handle)
"""
).replace("STEPS\n", STEPS)

LOWBIT_IMPORTS = """
import torch, transformers
from transformers import BitsAndBytesConfig, LlamaForCausalLM
"""

LOWBIT_FUNCTION = """
def infer(folder, saved):
    import json, os, time
    started = time.time()
    import torch
    from transformers import BitsAndBytesConfig, LlamaForCausalLM
    from {lib} import Accelerator
    imported = time.time() - started
    accelerator = Accelerator(cpu=True)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(saved, quantization_config=quantization,
                                             device_map="cpu", dtype=torch.float32).eval()
    ids = torch.randint(0, 32000, (2, 64),
                        generator=torch.Generator().manual_seed(1 + accelerator.process_index))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    first = time.time()
    import psutil
    uss = psutil.Process().memory_full_info().uss
    four_bit = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    outputs = [round(float(logits.mean()), 5), round(float(logits[:, -1].abs().sum()), 2),
               int(logits[0, -1].argmax()), four_bit]
    result = {{"first_step": first, "losses": outputs, "imports_s": imported, "uss": uss,
              "pid": os.getpid()}}
    with open(os.path.join(folder, f"rank{{accelerator.process_index}}.json"), "w") as handle:
        json.dump(result, handle)
"""

#: workload -> (the notebook's imports, the function's source, its name, its arguments after
#: the results folder); {lib}, {library_imports} and {accelerator_kwargs} are filled per library
WORKLOADS = {
    "a": (IMPORTS, FUNCTION, "train", ""),
    "b": (DEEPSPEED_IMPORTS, DEEPSPEED_FUNCTION, "train", ""),
    "c": (LOWBIT_IMPORTS, LOWBIT_FUNCTION, "infer", " SAVED"),
}

SHORT = {"a": "Llama, Accelerator", "b": "DeepSpeed ZeRO-3", "c": "4-bit model", "d": "new pool"}
SHORT["trainer"] = "Trainer"

TITLES = {
    "a": "small Llama, Accelerator, first AdamW step",
    "b": "DeepSpeed ZeRO-3 engine, first step",
    "c": "4-bit (nf4) Llama loaded, first forward",
    "d": "new %%distributed pool + first cell (imports, builds, steps)",
    "trainer": "transformers Trainer: first optimizer step, then steps/s",
}

LAUNCH = """
import contextlib, io, time, json, os, tempfile
calls = []
for launch in range({launches}):
    folder = tempfile.mkdtemp(prefix="first-step-")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        called = time.time()
        notebook_launcher({name}, args=(folder,{args}), num_processes=2{extra})
    out = [json.load(open(os.path.join(folder, f"rank{{i}}.json"))) for i in range(2)]
    calls.append({{"first_step_s": max(r["first_step"] for r in out) - called,
                  "imports_s": max(r["imports_s"] for r in out),
                  "uss_mib": max(r["uss"] for r in out) / 2**20,
                  "losses": [r["losses"] for r in out],
                  "engine": out[0].get("engine")}})
"""

REPORT = """
report = {"calls": calls}
try:
    from nbaccel.launch.launchers.forkserver.launcher import preload_report
    if "{lib}" == "nbaccel":
        report["preload"] = preload_report()
except Exception as exc:
    report["preload_error"] = repr(exc)
print("RESULT " + json.dumps(report, default=str))
"""


def function_source(lib: str, workload: str) -> str:
    """The launched function of ``workload`` for ``lib``, as the notebook's cell holds it."""
    source = WORKLOADS[workload][1]
    if workload == "b":
        library_imports, accelerator_kwargs = DEEPSPEED_LIBRARY[lib]
        source = source.format(
            library_imports=library_imports, accelerator_kwargs=accelerator_kwargs
        )
        return source.replace("CONFIG", repr(DEEPSPEED_CONFIG))
    return source.format(lib=lib)


def cells(
    lib: str, launches: int, order: str, workload: str = "a", saved: str | None = None
) -> list[str]:
    """The notebook of one kernel: imports at the top, the function, the launches, the report."""
    imports, _, name, args = WORKLOADS[workload]
    launcher = f"from {lib} import notebook_launcher\n"
    top = launcher + imports if order == "first" else imports + launcher
    extra = (
        ", renderer=__import__('nbaccel.launch.driver.renderer').launch.driver.renderer.Renderer()"
    )
    if saved is not None:
        top += f"SAVED = {saved!r}\n"
    return [
        "import time, json\n" + top,
        function_source(lib, workload),
        LAUNCH.format(
            launches=launches, name=name, args=args, extra=extra if lib == "nbaccel" else ""
        ),
        REPORT.replace("{lib}", lib),
    ]


def one_kernel(
    lib: str, launches: int, order: str, workload: str = "a", saved: str | None = None
) -> dict:
    """Run the notebook for ``lib`` in a fresh kernel; its report."""
    from kernel import cell_errors, cell_text, run_notebook

    nb = run_notebook(cells(lib, launches, order, workload, saved), timeout=600, shutdown=True)
    for cell in nb.cells:
        if cell_errors(cell):
            raise RuntimeError(f"({workload}) {lib}: {cell_text(cell)[-3000:]}")
    text = cell_text(nb.cells[-1])
    line = next(x for x in text.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def save_lowbit_model(folder: Path) -> None:
    """The small random Llama of workload (c), saved once (outside the timing)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def measure(kernels: int = 3, later: int = 2, order: str = "first", workload: str = "a") -> dict:
    """Workload (a), (b) or (c): ``kernels`` fresh kernels per library, alternating; medians
    and ratios."""
    saved = None
    if workload == "c":
        saved = tempfile.mkdtemp(prefix="first-step-4bit-")
        save_lowbit_model(Path(saved))
    try:
        return _measure(kernels, later, order, workload, saved)
    finally:
        if saved is not None:
            shutil.rmtree(saved, ignore_errors=True)


def _measure(kernels: int, later: int, order: str, workload: str, saved: str | None) -> dict:
    runs: dict[str, list[dict]] = {lib: [] for lib in LIBRARIES}
    loads = [os.getloadavg()[0]]
    for round_ in range(kernels):
        libs = LIBRARIES if round_ % 2 == 0 else LIBRARIES[::-1]
        for lib in libs:
            report = one_kernel(lib, 1 + later, order, workload, saved)
            runs[lib].append(report)
            loads.append(os.getloadavg()[0])
            first = report["calls"][0]
            print(
                f"[first_step] ({workload}) {lib:10s} kernel {round_ + 1}: first launch "
                f"{first['first_step_s']:.2f} s, later "
                f"{[round(c['first_step_s'], 2) for c in report['calls'][1:]]}, "
                f"load {loads[-1]:.1f}",
                flush=True,
            )
    result: dict = {
        "workload": workload,
        "figure": TITLES[workload],
        "peer": "accelerate",
        "kernels": kernels,
        "later_launches": later,
        "order": order,
        "runs": runs,
    }
    for lib, reports in runs.items():
        firsts = [r["calls"][0]["first_step_s"] for r in reports]
        laters = [
            statistics.median(c["first_step_s"] for c in r["calls"][1:]) for r in reports if later
        ]
        result[lib] = {
            "first_launch_s": statistics.median(firsts),
            "later_launch_s": statistics.median(laters) if later else None,
            "rank_imports_first_s": statistics.median(r["calls"][0]["imports_s"] for r in reports),
            "rank_imports_later_s": statistics.median(
                statistics.median(c["imports_s"] for c in r["calls"][1:]) for r in reports
            )
            if later
            else None,
            "rank_uss_mib": statistics.median(
                statistics.median(c["uss_mib"] for c in r["calls"]) for r in reports
            ),
        }
        if workload == "b":
            result[lib]["engine"] = reports[-1]["calls"][0]["engine"]
    nb_runs = runs["nbaccel"]
    rss = [r.get("preload", {}).get("server_rss") for r in nb_runs]
    result["nbaccel"]["server_rss_mib"] = (
        statistics.median(x for x in rss if x) / 2**20 if any(rss) else None
    )
    result["nbaccel"]["preloaded"] = nb_runs[-1].get("preload", {}).get("preloaded")
    result["nbaccel"]["refused"] = nb_runs[-1].get("preload", {}).get("refused")
    for key in ("first_launch_s", "later_launch_s", "rank_uss_mib"):
        ours, peer = result["nbaccel"][key], result["accelerate"][key]
        result[f"ratio_{key}"] = ours / peer if ours is not None and peer else None
    losses = {
        lib: [c["losses"] for r in reports for c in r["calls"]] for lib, reports in runs.items()
    }
    result["same_losses"] = losses["nbaccel"] == losses["accelerate"]
    result["load_average"] = {"start": loads[0], "max": max(loads), "end": loads[-1]}
    if not result["same_losses"]:
        raise RuntimeError(
            f"({workload}) the libraries' losses or outputs differ: nbaccel "
            f"{losses['nbaccel'][:2]}, Accelerate {losses['accelerate'][:2]}"
        )
    return result


POOL_CELL = """%%distributed -n 2 --cpu
import json, os, time
began = time.time()
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from ACCELERATOR import Accelerator
imported = time.time() - began
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
config = LLAMA
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1))
loss = model(input_ids=ids, labels=ids).loss
accelerator.backward(loss)
optimizer.step()
print("STEP", json.dumps({"at": time.time(), "loss": round(float(loss), 5), "began": began,
                          "imports_s": imported, "rank": accelerator.process_index,
                          "ranks": accelerator.num_processes}))
""".replace("LLAMA", LLAMA)

# nbdistributed: the cell that starts the pool (and the time origin), waiting until both
# workers answer (a cell sent before they connect is lost); the pids of its workers
PEER_START = """called = time.time()
%dist_init -n 2
_magic = get_ipython().magics_manager.registry["DistributedMagic"]
if _magic._comm_manager is None:
    raise RuntimeError("nbdistributed did not start its workers (see the output above)")
_deadline = time.time() + 120
while True:
    try:
        _magic._comm_manager.send_to_all("get_status", {}, timeout=0.1)
        break
    except TimeoutError:
        if time.time() > _deadline:
            raise
print("CALLED", called, "READY", time.time() - called, "PIDS",
      json.dumps([p.pid for p in _magic._process_manager.processes]))
"""

# a leading magic keeps the cell in the kernel (nbdistributed sends every other cell to its
# workers); its process manager ends its own workers (terminate, then kill, by their handles)
PEER_STOP = """%dist_mode --disable
_magic._process_manager.shutdown()
_magic._comm_manager.shutdown()
_magic._comm_manager = None
"""

POOLS = {
    "nbaccel": {
        "load": "%load_ext nbaccel",
        "top": "import time, json\nfrom nbaccel import notebook_launcher\n" + IMPORTS,
        "start": ["called = time.time()\nprint('CALLED', called)"],
        "cell": POOL_CELL.replace("ACCELERATOR", "nbaccel"),
        "stop": "%dist_shutdown",
    },
    "nbdistributed": {
        "load": "%load_ext nbdistributed",
        "top": "import time, json\n" + IMPORTS,
        "start": [PEER_START],
        "cell": POOL_CELL.replace("ACCELERATOR", "accelerate").replace(
            "%%distributed -n 2 --cpu", "%%distributed"
        ),
        "stop": PEER_STOP,
    },
}

_STEP = re.compile(r"STEP\s+(\{[^\n]*\})")
_PEER_ERRORS = ("Error on Rank", "Error executing distributed code", "Failed to start")


def _peer_workers() -> set[int]:
    """The pids of nbdistributed's worker processes on this machine."""
    import psutil

    found = set()
    for process in psutil.process_iter(["cmdline"]):
        if any("nbdistributed/worker.py" in part for part in process.info["cmdline"] or ()):
            found.add(process.pid)
    return found


def _end_workers(pids: set[int]) -> None:
    """End the peer's worker processes that outlived their kernel, by their ids."""
    import psutil

    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if any("nbdistributed/worker.py" in part for part in process.cmdline()):
                process.kill()
                alive.append(process)
    psutil.wait_procs(alive, timeout=5)


def pool_kernel(tool: str = "nbaccel", later: int = 0) -> dict:
    """Workload (d) in a fresh kernel that imported torch and transformers: a new pool and its
    first cell, then ``later`` times: the pool shut down, a new one and the same cell."""
    from kernel import cell_errors, cell_text, run_notebook

    spec = POOLS[tool]
    pool = [*spec["start"], spec["cell"]]
    notebook = [spec["top"], spec["load"], *pool]
    for _ in range(later):
        notebook += [spec["stop"], *pool]
    notebook.append(spec["stop"])
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    nb = None
    before = _peer_workers() if tool == "nbdistributed" else set()
    try:
        nb = run_notebook(notebook, timeout=600, env={"PATH": path}, shutdown=True)
    finally:
        if tool == "nbdistributed" and nb is not None:  # the workers its kernel started
            _end_workers({
                pid
                for cell in nb.cells
                for line in cell_text(cell).splitlines()
                if "PIDS " in line
                for pid in json.loads(line.split("PIDS ", 1)[1])
            })  # fmt: skip
        elif tool == "nbdistributed":  # the kernel failed: the workers that appeared meanwhile
            _end_workers(_peer_workers() - before)
    for cell in nb.cells:
        text = cell_text(cell)
        if cell_errors(cell) or any(e in text for e in _PEER_ERRORS):
            raise RuntimeError(f"(d) {tool}: {cell.source[:60]!r}: {text[-3000:]}")
    launches = []
    first = 2
    for index in range(1 + later):
        start = nb.cells[first + index * (len(pool) + 1)]
        work = nb.cells[first + index * (len(pool) + 1) + len(pool) - 1]
        called = float(re.search(r"CALLED (\S+)", cell_text(start)).group(1))
        ready = re.search(r"READY (\S+)", cell_text(start))  # nbdistributed: workers answer
        steps = [json.loads(m) for m in _STEP.findall(cell_text(work))]
        if sorted(s["rank"] for s in steps) != [0, 1]:
            raise RuntimeError(f"(d) {tool}: not every rank stepped: {cell_text(work)[-3000:]}")
        launches.append(
            {
                "first_step_s": max(s["at"] for s in steps) - called,
                "losses": [s["loss"] for s in sorted(steps, key=lambda s: s["rank"])],
                "ranks": [s["ranks"] for s in steps],
                "ready_s": float(ready.group(1)) if ready else None,
                "cell_began_s": max(s["began"] for s in steps) - called,
                "imports_s": max(s["imports_s"] for s in steps),
            }
        )
    return {"calls": launches}


def measure_pool(kernels: int = 3, later: int = 2) -> dict:
    """Workload (d): ``kernels`` fresh kernels per pool, alternating (nbdistributed where
    installed; otherwise the reason stands in for its figures)."""
    tools = ["nbaccel"]
    peer_reason = None
    if importlib.util.find_spec("nbdistributed") is None:
        peer_reason = "nbdistributed is not installed"
    else:
        tools.append("nbdistributed")
    runs: dict[str, list[dict]] = {tool: [] for tool in tools}
    loads = [os.getloadavg()[0]]
    for round_ in range(kernels):
        for tool in tools if round_ % 2 == 0 else tools[::-1]:
            runs[tool].append(pool_kernel(tool, later))
            loads.append(os.getloadavg()[0])
            calls = runs[tool][-1]["calls"]
            print(
                f"[first_step] (d) {tool:13s} kernel {round_ + 1}: first pool "
                f"{calls[0]['first_step_s']:.2f} s, later "
                f"{[round(c['first_step_s'], 2) for c in calls[1:]]}, load {loads[-1]:.1f}",
                flush=True,
            )
    result: dict = {
        "workload": "d",
        "figure": TITLES["d"],
        "peer": "nbdistributed",
        "kernels": kernels,
        "later_launches": later,
        "runs": runs,
    }
    for tool, reports in runs.items():
        result[tool] = {
            "first_launch_s": statistics.median(r["calls"][0]["first_step_s"] for r in reports),
            "later_launch_s": statistics.median(
                statistics.median(c["first_step_s"] for c in r["calls"][1:]) for r in reports
            )
            if later
            else None,
        }
    if peer_reason is not None:
        result["nbdistributed"] = {"not_measured": peer_reason}
        result["same_losses"] = None
    else:
        for key in ("first_launch_s", "later_launch_s"):
            ours, peer = result["nbaccel"][key], result["nbdistributed"][key]
            result[f"ratio_{key}"] = ours / peer if ours is not None and peer else None
        losses = {
            tool: [c["losses"] for r in reports for c in r["calls"]]
            for tool, reports in runs.items()
        }
        result["same_losses"] = losses["nbaccel"] == losses["nbdistributed"]
        if not result["same_losses"]:
            raise RuntimeError(
                f"(d) the pools' losses differ: nbaccel {losses['nbaccel'][:2]}, "
                f"nbdistributed {losses['nbdistributed'][:2]}"
            )
    result["load_average"] = {"start": loads[0], "max": max(loads), "end": loads[-1]}
    return result


#: the Trainer workload's four fronts, in the order of a round (every other round reversed)
TRAINER_FRONTS = ("nbaccel_notebook", "nbaccel_launch", "accelerate_launch", "accelerate_notebook")
#: gate pairs: (nbaccel's front, Accelerate's front of the same kind)
TRAINER_PAIRS = {
    "notebook": ("nbaccel_notebook", "accelerate_notebook"),
    "script": ("nbaccel_launch", "accelerate_launch"),
}
#: the gate's figures: key -> (pair, figure); each is nbaccel's median over the peer's
TRAINER_GATE = {
    "trainer_first_step_notebook": ("notebook", "first_step_s"),
    "trainer_first_step_script": ("script", "first_step_s"),
    "trainer_step_notebook": ("notebook", "step_s"),
    "trainer_step_script": ("script", "step_s"),
}
#: flags both command lines give, so that no default config file changes the run
_SCRIPT_FLAGS = ("--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                 "--dynamo_backend", "no")  # fmt: skip

TRAINER_CELLS = (
    """
import contextlib, io, json, sys, tempfile, time
sys.path[:0] = [BENCHMARKS, TESTS]
from {lib} import notebook_launcher
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
from trainer_steps import train  # Trainer is imported inside: it imports bitsandbytes, after
# which Accelerate's notebook_launcher refuses to start
""",
    """
folder = tempfile.mkdtemp(prefix="first-step-trainer-")
buffer = io.StringIO()
with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
    called = time.time()
    notebook_launcher(train, args=(folder, {steps}), num_processes=2{extra})
print("RESULT " + json.dumps({{"called": called, "folder": folder}}))
""",
)


def _trainer_command(front: str, folder: str, steps: int) -> list[str]:
    """The command line of a script front: Accelerate's ``accelerate launch --cpu`` starts one
    process (several only under ``mpirun``), so its 2 ranks come from ``--multi_gpu`` (torchrun),
    whose ranks train on the CPU as the Trainer's ``use_cpu=True`` asks."""
    script = str(ROOT / "benchmarks" / "trainer_steps.py")
    if front == "nbaccel_launch":
        program, fallback, paradigm = "nbaccel", ["-m", "nbaccel"], "--cpu"
    else:
        program, fallback, paradigm = (
            "accelerate",
            ["-m", "accelerate.commands.accelerate_cli"],
            "--multi_gpu",
        )
    path = Path(sys.executable).with_name(program)  # the console script, as people type it
    head = [str(path)] if path.exists() else [sys.executable, *fallback]
    return [*head, "launch", paradigm, *_SCRIPT_FLAGS, script, folder, str(steps)]


def trainer_once(front: str, steps: int) -> dict:
    """One launch of the Trainer workload under ``front``: the time from the launch call to the
    last rank's first optimizer step, seconds per step (``train_runtime`` / steps, the slower
    rank), each rank's loss and what it ran with."""
    from kernel import cell_errors, cell_text, run_notebook

    if front.endswith("_notebook"):
        lib = front.split("_")[0]
        extra = (
            ", cpu=True"
            + (
                ", renderer=__import__('nbaccel.launch.driver.renderer').launch.driver.renderer"
                ".Renderer()"
            )
            if lib == "nbaccel"
            else ""
        )
        top, launch = TRAINER_CELLS
        top = top.replace("BENCHMARKS", repr(str(ROOT / "benchmarks")))
        top = top.replace("TESTS", repr(str(ROOT / "tests"))).format(lib=lib)
        nb = run_notebook([top, launch.format(steps=steps, extra=extra)], timeout=900,
                          shutdown=True)  # fmt: skip
        for cell in nb.cells:
            if cell_errors(cell):
                raise RuntimeError(f"(trainer) {front}: {cell_text(cell)[-3000:]}")
        line = next(x for x in cell_text(nb.cells[-1]).splitlines() if x.startswith("RESULT "))
        record = json.loads(line[len("RESULT ") :])
        called, folder = record["called"], record["folder"]
    else:
        folder = tempfile.mkdtemp(prefix="first-step-trainer-")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        command = _trainer_command(front, folder, steps)
        called = time.time()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"(trainer) {front}: {done.stdout[-2000:]}{done.stderr[-3000:]}")
    try:
        ranks = [json.loads((Path(folder) / f"rank{i}.json").read_text()) for i in range(2)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if any(r["world_size"] != 2 or r["steps"] != steps for r in ranks):
        raise RuntimeError(f"(trainer) {front}: not 2 ranks of {steps} steps: {ranks}")
    runtime = max(r["train_runtime"] for r in ranks)
    return {
        "first_step_s": max(r["first_step"] for r in ranks) - called,
        "step_s": runtime / steps,
        "steps_per_s": steps / runtime,
        "losses": [r["training_loss"] for r in ranks],
        "threads": [r["threads"] for r in ranks],
        "interop_threads": [r["interop_threads"] for r in ranks],
        "affinity": [r["affinity"] for r in ranks],
        "omp_num_threads": [r["omp_num_threads"] for r in ranks],
    }


def measure_trainer(repeats: int = 3, steps: int = 200) -> dict:
    """The Trainer workload: ``repeats`` rounds of one launch per front, alternating the order;
    medians per front and the ratios nbaccel / Accelerate of each pair."""
    runs: dict[str, list[dict]] = {front: [] for front in TRAINER_FRONTS}
    loads = [os.getloadavg()[0]]
    for round_ in range(repeats):
        for front in TRAINER_FRONTS if round_ % 2 == 0 else TRAINER_FRONTS[::-1]:
            runs[front].append(trainer_once(front, steps))
            loads.append(os.getloadavg()[0])
            run = runs[front][-1]
            print(f"[first_step] (trainer) {front:19s} round {round_ + 1}: first step "
                  f"{run['first_step_s']:.2f} s, {run['steps_per_s']:.1f} steps/s, "
                  f"load {loads[-1]:.1f}", flush=True)  # fmt: skip
    result: dict = {
        "workload": "trainer",
        "figure": TITLES["trainer"],
        "peer": "accelerate",
        "repeats": repeats,
        "steps": steps,
        "runs": runs,
    }
    for front, reports in runs.items():
        result[front] = {
            "first_step_s": statistics.median(r["first_step_s"] for r in reports),
            "step_s": statistics.median(r["step_s"] for r in reports),
            "steps_per_s": statistics.median(r["steps_per_s"] for r in reports),
        }
    for pair, (ours, peer) in TRAINER_PAIRS.items():
        for key in ("first_step_s", "step_s"):
            result[f"ratio_{pair}_{key}"] = result[ours][key] / result[peer][key]
    losses = [loss for reports in runs.values() for r in reports for loss in r["losses"]]
    reference = runs[TRAINER_FRONTS[0]][0]["losses"]
    result["same_losses"] = all(
        abs(a - b) <= 1e-4
        for reports in runs.values()
        for r in reports
        for a, b in zip(r["losses"], reference)
    )
    result["load_average"] = {"start": loads[0], "max": max(loads), "end": loads[-1]}
    if not result["same_losses"]:
        raise RuntimeError(f"(trainer) the fronts' losses differ: {losses}")
    return result


def trainer_figures(result: dict) -> dict[str, tuple[float, float]]:
    """The gate's figures of a :func:`measure_trainer` result: key -> (nbaccel's median, the
    peer's), both in seconds (lower is better)."""
    figures = {}
    for key, (pair, figure) in TRAINER_GATE.items():
        ours, peer = TRAINER_PAIRS[pair]
        figures[key] = (result[ours][figure], result[peer][figure])
    return figures


def write_trainer(result: dict, started: float) -> Path:
    """Stamp the Trainer workload's figures, write them to ``first_step_trainer.json`` and
    print its table."""
    from provenance import stamp

    result["provenance"] = stamp()
    result["seconds"] = round(time.perf_counter() - started)
    out = ROOT / "benchmarks" / "results" / "first_step_trainer.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\n(trainer) {result['steps']} steps, medians of {result['repeats']}")
    print(f"{'':22s} {'first step':>10s} {'steps/s':>8s}")
    for front in TRAINER_FRONTS:
        row = result[front]
        print(f"{front:22s} {row['first_step_s']:>8.2f} s {row['steps_per_s']:>8.1f}")
    for pair, (ours, peer) in TRAINER_PAIRS.items():
        print(f"{pair:8s} {ours} / {peer}: first step "
              f"{result[f'ratio_{pair}_first_step_s']:.2f}x, time per step "
              f"{result[f'ratio_{pair}_step_s']:.2f}x")  # fmt: skip
    print(f"same losses on every front; load {result['load_average']}; wrote {out}")
    return out


def runnable() -> dict[str, str | None]:
    """Workload -> None where it can run here, else why not."""
    missing = {
        "a": ("transformers", "accelerate"),
        "b": ("transformers", "accelerate", "deepspeed"),
        "c": ("transformers", "accelerate", "bitsandbytes"),
        "d": ("transformers", "accelerate"),
        "trainer": ("transformers", "accelerate"),
    }
    return {
        workload: next(
            (f"{m} is not installed" for m in modules if importlib.util.find_spec(m) is None), None
        )
        for workload, modules in missing.items()
    }


def _row(result: dict) -> dict:
    peer = result["peer"]
    ours, theirs = result["nbaccel"], result.get(peer, {})
    return {
        "figure": result["figure"],
        "peer": peer,
        "nbaccel_first_s": ours["first_launch_s"],
        "peer_first_s": theirs.get("first_launch_s"),
        "ratio_first": result.get("ratio_first_launch_s"),
        "nbaccel_later_s": ours["later_launch_s"],
        "peer_later_s": theirs.get("later_launch_s"),
        "ratio_later": result.get("ratio_later_launch_s"),
        "not_measured": theirs.get("not_measured"),
    }


def _chosen(
    parser: argparse.ArgumentParser, asked: str | None, order: str, reasons: dict
) -> list[str]:
    """The workloads to run: those asked for (each must be able to run here), else all that
    can; with ``--order after``, only those the import order applies to."""
    if asked:
        chosen = [w.strip() for w in asked.split(",") if w.strip()]
        unknown = [w for w in chosen if w not in reasons]
        if unknown:
            parser.error(f"unknown workloads: {unknown} (a, b, c, d or trainer)")
        for workload in chosen:
            if reasons[workload]:
                parser.error(f"workload ({workload}) cannot run here: {reasons[workload]}")
    else:
        chosen = [w for w, why in reasons.items() if why is None]
    if order == "after":
        chosen = [w for w in chosen if w not in ("d", "trainer")]
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=3, help="fresh kernels per library")
    parser.add_argument("--later", type=int, default=2, help="launches after the first, per kernel")
    parser.add_argument(
        "--order",
        choices=("first", "after"),
        default="first",
        help="the launcher imported before (first) or after the notebook's libraries",
    )
    parser.add_argument(
        "--workload",
        default=None,
        help="comma-separated workloads among a,b,c,d,trainer (default: all that can run here)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps of each Trainer run (default 200; --quick: 40)",
    )
    parser.add_argument("--quick", action="store_true", help="the Trainer: 40 steps a run")
    args = parser.parse_args()
    steps = args.steps or (40 if args.quick else 200)
    if steps < 2:
        parser.error(f"--steps {steps}: give at least 2 steps (the first is timed apart)")
    reasons = runnable()
    chosen = _chosen(parser, args.workload, args.order, reasons)
    started = time.perf_counter()
    import torch  # noqa: F401  (the stamp names torch's version)

    workloads: dict = {}
    if "trainer" in chosen:
        write_trainer(measure_trainer(args.kernels, steps), started)
        chosen.remove("trainer")
        if not chosen:
            return 0
    for workload in chosen:
        if workload == "d":
            workloads[workload] = measure_pool(args.kernels, args.later)
        else:
            workloads[workload] = measure(args.kernels, args.later, args.order, workload)
    from provenance import stamp

    result = {
        "kernels": args.kernels,
        "later_launches": args.later,
        "order": args.order,
        "table": {w: _row(r) for w, r in workloads.items()},
        "not_run": {w: why for w, why in reasons.items() if why and w not in chosen},
        "workloads": workloads,
        "load_average": {
            "start": min(r["load_average"]["start"] for r in workloads.values()),
            "max": max(r["load_average"]["max"] for r in workloads.values()),
        },
        "provenance": stamp(),
        "seconds": round(time.perf_counter() - started),
    }
    name = "first_step.json" if args.order == "first" else "first_step_after.json"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    def seconds(value: float | None) -> str:
        return f"{value:.2f} s" if value is not None else "-"

    def ratio(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    print(f"\n{'':31s} {'nbaccel':>9s} {'peer':>26s} {'ratio':>7s}")
    for workload, row in result["table"].items():
        for when in ("first", "later"):
            peer = seconds(row[f"peer_{when}_s"]) if not row["not_measured"] else "not measured"
            label = f"({workload}) {SHORT[workload]}, {when}"
            print(f"{label:31s} {seconds(row[f'nbaccel_{when}_s']):>9s} "
                  f"{row['peer'] + ' ' + peer:>26s} {ratio(row[f'ratio_{when}']):>7s}")  # fmt: skip
    for workload, r in workloads.items():
        if workload != "d":
            print(f"({workload}) rank USS {r['nbaccel']['rank_uss_mib']:.0f} MiB vs "
                  f"{r['accelerate']['rank_uss_mib']:.0f} MiB; fork server RSS "
                  f"{r['nbaccel']['server_rss_mib']} MiB")  # fmt: skip
    print(f"same losses/outputs everywhere; load {result['load_average']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
