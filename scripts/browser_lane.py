"""Drive JupyterLab with headless Chromium: run the widgets notebook, check the DOM, screenshot.

Run through ``scripts/test-browser`` (which installs what is missing). Exit code 0 when every
check passed. Screenshots go to docs/images/ (``--images`` to change).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "widgets.ipynb"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(root: Path, port: int, token: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    if os.geteuid() == 0:  # containers and CI run as root
        cmd.append("--allow-root")
    log = open(root / "lab.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    proc.terminate()
    tail = (root / "lab.log").read_text()[-3000:]
    raise RuntimeError(f"JupyterLab did not start:\n{tail}")


def check(condition: bool, what: str, failures: list[str]) -> None:
    print(("ok   " if condition else "FAIL ") + what, flush=True)
    if not condition:
        failures.append(what)


def drive(url: str, chromium: str, images: Path, failures: list[str]) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.url_to_open = url
        try:
            _run_and_check(page, images, failures)
        except Exception:
            shot = Path(tempfile.gettempdir()) / "nbaccel-browser-lane-failure.png"
            page.screenshot(path=str(shot))
            print(f"page at the failure: {shot}", flush=True)
            raise
        finally:
            browser.close()


def _run_all(page) -> None:
    """Run > Run All Cells, answering the kernel dialog; retried while nothing has started."""
    select = page.get_by_role("button", name="Select", exact=True)
    no_news = page.get_by_role("button", name="No", exact=True)
    for attempt in range(4):
        try:  # "Select Kernel" for a notebook without a session (it may come late)
            select.first.wait_for(timeout=10_000 if attempt == 0 else 2_000)
            select.first.click()
        except Exception:
            pass
        if no_news.count():  # the "notified about Jupyter news?" toast covers the outputs
            no_news.first.click()
        try:
            page.get_by_role("menuitem", name="Run", exact=True).click(timeout=5_000)
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click(timeout=5_000)
        except Exception:  # a dialog got in the way: close menus and try again
            page.keyboard.press("Escape")
            continue
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if page.locator(".nbaccel-bar").count():
                return
            started = page.locator(".jp-InputPrompt", has_text="[*]").count()
            done = page.locator(".jp-InputPrompt", has_text=re.compile(r"\[\d+\]")).count()
            if started or done:
                deadline = max(deadline, time.monotonic() + 5)  # running: keep waiting
            if select.count():
                break  # the dialog came late: answer it and run again
            time.sleep(0.5)
    page.wait_for_selector(".nbaccel-bar", timeout=120_000)


def _run_and_check(page, images: Path, failures: list[str]) -> None:
    page.goto(page.url_to_open)
    page.wait_for_selector(".jp-Notebook", timeout=120_000)
    _run_all(page)
    time.sleep(1.5)
    launch = page.locator(".nbaccel-launch").first
    launch.screenshot(path=str(images / "widgets-live.png"))
    page.wait_for_function(
        "document.querySelectorAll('.nbaccel-status').length >= 2 && "
        "[...document.querySelectorAll('.nbaccel-status')].every("
        "e => /finished|failed/.test(e.textContent))",
        timeout=240_000,
    )
    page.wait_for_selector(".nbaccel-device-map", timeout=60_000)
    time.sleep(1.0)
    bars = page.locator(".nbaccel-launch").first.locator(".nbaccel-bar")
    labels = [bars.nth(i).inner_text() for i in range(bars.count())]
    check(bars.count() == 3, f"3 progress bars in the first launch (got {bars.count()})", failures)
    check(any("rank 0" in t and "train" in t for t in labels), "rank 0's train bar", failures)
    check(any("rank 1" in t and "train" in t for t in labels), "rank 1's train bar", failures)
    check(
        not any("rank 1" in t and "eval" in t for t in labels),
        "rank 1's eval bar hidden",
        failures,
    )
    check(all("100%" in t for t in labels), "every bar at 100%", failures)
    rows = page.locator(".nbaccel-launch").first.locator(".nbaccel-memory-row")
    check(rows.count() == 2, "memory monitor: a row per rank", failures)
    check(page.locator(".nbaccel-sparkline").count() >= 2, "memory timelines drawn", failures)
    check(page.locator(".nbaccel-summary").count() >= 1, "static summary shown", failures)
    _check_device_map(page, failures)
    check(page.locator(".nbaccel-module-tree details").count() > 0, "module tree", failures)
    check(page.locator(".nbaccel-memory-estimate table").count() == 1, "memory estimate", failures)
    tracker = page.locator(".jp-Cell").last.locator(".jp-OutputArea-output img")
    check(tracker.count() == 1, "tracker plot (static image at the end)", failures)
    check(page.locator("text=Error displaying widget").count() == 0, "no widget errors", failures)
    errors = page.locator(".jp-OutputArea-output[data-mime-type*='error']")
    texts = [errors.nth(i).inner_text()[-1500:] for i in range(errors.count())]
    check(not texts, "no cell raised" + "".join(f"\n{t}" for t in texts), failures)
    launch.screenshot(path=str(images / "widgets-launch.png"))
    page.locator(".nbaccel-summary").first.screenshot(path=str(images / "widgets-summary.png"))
    page.locator(".nbaccel-device-map").first.screenshot(path=str(images / "device-map.png"))
    if tracker.count():
        tracker.first.screenshot(path=str(images / "tracker.png"))
    page.screenshot(path=str(images / "widgets-notebook.png"), full_page=False)


#: the device map the notebook plans (two 40 MiB GPUs, 30 MiB of CPU), in bar order
PLANNED = ["cuda:0", "cuda:1", "cpu", "disk"]
#: the bar colours of those devices (nbaccel/notebook/kernel/widgets/device_map_view.py)
BAR_COLOURS = {"cuda:0": "#2e86c1", "cuda:1": "#28b463", "cpu": "#e67e22", "disk": "#c0392b"}


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count()


def _check_device_map(page, failures: list[str]) -> None:
    """The planned map's bars, and what the notebook says of GPUs this machine does not have."""
    devices = page.locator(".nbaccel-device-map").first.locator(".nbaccel-device")
    got = [devices.nth(i).get_attribute("data-device") for i in range(devices.count())]
    check(got == PLANNED, f"device map bars {PLANNED} (got {got})", failures)
    absent = [d for d in ("cuda:0", "cuda:1") if int(d[-1]) >= _gpus_here()]
    note = page.locator(".nbaccel-device-map").first.locator(".nbaccel-device-planned")
    lines = page.locator(".jp-OutputArea-output", has_text="max_memory names")
    if absent:
        names = ", ".join(absent)
        check(
            note.count() == 1 and note.first.inner_text().startswith(f"{names}: not on"),
            f"the map marks {names} as not on this machine",
            failures,
        )
        said = lines.first.inner_text().strip() if lines.count() else ""
        check(
            lines.count() == 1 and said.count("\n") == 0 and f"names {names}, which" in said,
            f"one line under the cell names {names} (got {lines.count()}: {said!r})",
            failures,
        )
    else:
        quiet = note.count() == 0 and lines.count() == 0
        check(quiet, "every planned GPU is here: no note", failures)


def _hex(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def check_pictures(images: Path, since: float, failures: list[str]) -> None:
    """Each screenshot was written by this run, is a real picture (not blank, sensible size),
    and the device map's shows a bar of each planned device's colour."""
    from PIL import Image

    for name in PICTURES:
        path = images / name
        fresh = path.exists() and path.stat().st_mtime >= since
        check(fresh, f"{name} written by this run", failures)
        if not fresh:
            continue
        with Image.open(path) as img:
            rgb = img.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 16) or []
        check(
            rgb.width >= 200 and rgb.height >= 40 and len(colours) >= 8,
            f"{name}: a picture ({rgb.width}x{rgb.height}, {len(colours)} colours)",
            failures,
        )
        if name == "device-map.png":
            seen = {c for _, c in colours}
            for device, colour in BAR_COLOURS.items():
                solid = _hex(colour)  # a bar segment is drawn at opacity 1 or 0.65 on white
                light = tuple(round(0.65 * v + 0.35 * 255) for v in solid)
                near = any(
                    max(abs(a - b) for a, b in zip(c, want, strict=True)) <= 3
                    for c in seen
                    for want in (solid, light)
                )
                check(near, f"device-map.png shows a {device} bar ({colour})", failures)


PICTURES = [
    "widgets-live.png",
    "widgets-launch.png",
    "widgets-summary.png",
    "device-map.png",
    "tracker.png",
    "widgets-notebook.png",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--images", default=str(ROOT / "docs" / "images"))
    args = parser.parse_args()
    images = Path(args.images)
    images.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    started = time.time() - 1
    with tempfile.TemporaryDirectory(prefix="nbaccel-lab-") as tmp:
        root = Path(tmp)
        shutil.copy(ROOT / "notebooks" / NOTEBOOK, root / NOTEBOOK)  # the repo's copy stays clean
        token, port = secrets.token_hex(16), free_port()
        lab = start_lab(root, port, token)
        try:
            drive(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}?token={token}", args.chromium,
                  images, failures)  # fmt: skip
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            print(f"FAIL {type(exc).__name__}: {exc}", flush=True)
        finally:
            lab.terminate()
            try:
                lab.wait(15)
            except subprocess.TimeoutExpired:
                lab.kill()
    if not failures:
        check_pictures(images, started, failures)
    print(f"screenshots in {images}")
    print(f"browser lane: {'FAILED: ' + '; '.join(failures) if failures else 'passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
