"""The structured events that notebook instrumentation sends from ranks to the driver.

Workers build these (``progress_bridge``, ``memory_sampler``) and hand them to
:func:`nbaccel.launch.rank.worker.emit`; the driver's renderer receives them in ``Renderer.event``.
Each event has a ``render_text()`` so the plain-text renderer (terminal, CI) shows it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.wire.pickling import plain_class
from nbaccel.launch.wire.protocol import EventKind
from nbaccel.values.byte_text import human_bytes

__all__ = [
    "MEMORY",
    "METRICS",
    "PROGRESS",
    "MemorySample",
    "MetricsUpdate",
    "ProgressUpdate",
]

# The kinds these payloads travel under (members of the engine's one vocabulary).
PROGRESS = EventKind.PROGRESS
MEMORY = EventKind.MEMORY
METRICS = EventKind.METRICS


@plain_class
@dataclass
class ProgressUpdate:
    """The state of one tqdm bar on one rank.

    ``bar`` identifies the bar within its worker process; ``final`` marks the exact last state
    (sent when the bar closes); ``text`` asks text renderers to print this state.
    """

    bar: int
    desc: str
    n: float
    total: float | None
    elapsed: float
    rate: float | None
    unit: str = "it"
    unit_scale: bool | float = False
    unit_divisor: int = 1000
    postfix: str | None = None
    leave: bool = True
    final: bool = False
    text: bool = False

    def meter(self, ncols: int | None = 80) -> str:
        """tqdm's own one-line rendering of this state (no carriage returns)."""
        from tqdm.std import tqdm as std_tqdm

        return std_tqdm.format_meter(
            self.n,
            self.total,
            self.elapsed,
            ncols=ncols,
            prefix=self.desc or "",
            unit=self.unit,
            unit_scale=self.unit_scale,
            rate=self.rate,
            postfix=self.postfix,
            unit_divisor=self.unit_divisor,
            ascii=True,
        )

    def render_text(self) -> str:
        shown = self.text and (self.leave or not self.final)  # leave=False: gone at the end
        return self.meter() if shown else ""


@plain_class
@dataclass
class MemorySample:
    """One memory reading of one rank (bytes). Device fields are ``None`` when unused."""

    time: float
    rss: int
    rss_peak: int
    host_total: int
    cuda: dict[str, Any] | None = None  # device, allocated, reserved, peak, total
    xla: dict[str, Any] | None = None  # device, used, limit
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device_kind(self) -> str | None:
        return "cuda" if self.cuda else "xla" if self.xla else None

    def device_used(self) -> tuple[int, int | None, int | None] | None:
        """(in use, peak, capacity) on the accelerator, or None without one."""
        if self.cuda:
            return self.cuda["allocated"], self.cuda["peak"], self.cuda.get("total")
        if self.xla:
            return self.xla["used"], self.xla.get("peak"), self.xla.get("limit")
        return None

    def summary(self) -> str:
        parts = [f"host RSS {human_bytes(self.rss)} (peak {human_bytes(self.rss_peak)})"]
        if self.cuda:
            c = self.cuda
            parts.append(
                f"cuda:{c['device']} allocated {human_bytes(c['allocated'])} "
                f"(peak {human_bytes(c['peak'])}), reserved {human_bytes(c['reserved'])} "
                f"(peak {human_bytes(c.get('peak_reserved'))}) of {human_bytes(c.get('total'))}"
            )
        if self.xla:
            x = self.xla
            parts.append(f"xla used {human_bytes(x['used'])} of {human_bytes(x.get('limit'))}")
        return "; ".join(parts)

    def render_text(self) -> str:
        return ""


@plain_class
@dataclass
class MetricsUpdate:
    """Scalars logged by a notebook tracker on a rank: ``points`` is a list of
    ``(step, values)``; ``final`` is sent by the tracker's ``finish()``."""

    run: str
    points: list[tuple[float, dict[str, float]]]
    final: bool = False

    def render_text(self) -> str:
        if not self.final or not self.points:
            return ""
        step, values = self.points[-1]
        shown = ", ".join(f"{k}={v:.4g}" for k, v in values.items())
        return f"{self.run} step {step:g}: {shown}"
