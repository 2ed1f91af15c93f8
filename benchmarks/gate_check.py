"""The benchmark gate's verdicts: measured figures against the thresholds in gate.toml.

Pure logic (no timing), so the default test suite can check it on made-up measurements. A
figure is a comparison with a peer: a ratio (ours / peer) or, for per-cell overheads, a
difference (ours - peer, in the figure's unit). Each threshold is a bound (``max`` or ``min``)
with a stated noise margin: inside the bound passes, inside the bound widened by the margin
passes as "noise", beyond it fails and the gate exits non-zero. A repeated gate (``--repeat N``)
judges each figure by its median over the runs (:func:`combine`): on a shared machine one run's
figure moves by 20-30%, the median of three far less.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

__all__ = ["Measured", "Row", "combine", "exit_code", "judge", "load_thresholds", "render"]


@dataclass
class Measured:
    """One figure as measured: our value and the peer's (same unit), or why it was skipped."""

    ours: float | None = None
    peer: float | None = None
    unit: str = "s"
    skipped: str | None = None  # the notice when the figure could not be measured here
    error: str | None = None  # our side failed: a failure of the gate
    runs: tuple[float, ...] = ()  # a repeated gate: the figure (ratio or difference) in each run


@dataclass
class Row:
    key: str
    figure: str
    peer: str
    value: float | None
    threshold: str
    verdict: str  # "pass", "pass (noise)", "FAIL", "skipped: ..." or "ERROR: ..."
    detail: str


def load_thresholds(path: Path) -> dict[str, dict]:
    """gate.toml as {figure key: settings}; ``[gate]`` gives defaults (``noise``)."""
    if tomllib is None:
        raise RuntimeError("reading gate.toml needs Python >= 3.11 (tomllib)")
    data = tomllib.loads(Path(path).read_text())
    defaults = data.pop("gate", {})
    figures = {}
    for key, spec in data.items():
        if ("max" in spec) == ("min" in spec):
            raise ValueError(f"gate.toml [{key}]: give exactly one of max or min")
        figure = {"noise": defaults.get("noise", 0.1), "kind": "ratio", **spec}
        if figure["kind"] not in ("ratio", "difference"):
            raise ValueError(
                f'gate.toml [{key}]: kind = {figure["kind"]!r}; use "ratio" (ours / peer, the '
                'default) or "difference" (ours - peer, in the figure\'s unit)'
            )
        for field in ("max", "min", "noise"):
            value = figure.get(field, 0)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(
                    f"gate.toml [{key}]: {field} = {value!r}; give a number >= 0 "
                    "(a ratio, or an amount in the figure's unit for a difference)"
                )
        figures[key] = figure
    return figures


def _value(spec: dict, m: Measured) -> float:
    if m.runs:
        return statistics.median(m.runs)
    if spec["kind"] == "difference":
        return m.ours - m.peer
    return m.ours / m.peer


def _measured(spec: dict, m: Measured) -> bool:
    return not (
        m.error is not None
        or m.skipped is not None
        or m.ours is None
        or m.peer is None
        or (spec["kind"] == "ratio" and not m.peer)
    )


def combine(runs: list[dict[str, Measured]], thresholds: dict[str, dict]) -> dict[str, Measured]:
    """One figure per key from several runs of the gate: judged by the median of its value
    (ratio or difference) over the runs that measured it, shown as the medians of ours and the
    peer's. An error in any run is the figure's error; a figure no run measured keeps the first
    run's notice."""
    combined = {}
    for key, spec in thresholds.items():
        seen = [run[key] for run in runs if key in run]
        if not seen:
            continue
        error = next((m.error for m in seen if m.error is not None), None)
        good = [m for m in seen if _measured(spec, m)]
        if error is not None or not good:
            combined[key] = Measured(error=error, skipped=None if error else seen[0].skipped)
            continue
        combined[key] = Measured(
            ours=statistics.median(m.ours for m in good),
            peer=statistics.median(m.peer for m in good),
            unit=good[0].unit,
            runs=tuple(_value(spec, m) for m in good),
        )
    return combined


def _bound(spec: dict) -> tuple[str, float, float]:
    """(sense, bound, bound widened by the noise margin)."""
    noise = spec["noise"]
    if "max" in spec:
        bound = spec["max"]
        if spec["kind"] == "difference":
            return "<=", bound, bound + noise
        return "<=", bound, bound * (1 + noise)
    bound = spec["min"]
    if spec["kind"] == "difference":
        return ">=", bound, bound - noise
    return ">=", bound, bound * (1 - noise)


def judge(measured: dict[str, Measured], thresholds: dict[str, dict]) -> list[Row]:
    """One row per figure of gate.toml, in its order; a figure not measured is skipped."""
    rows = []
    for key, spec in thresholds.items():
        m = measured.get(key, Measured(skipped="not measured in this run"))
        sense, bound, widened = _bound(spec)
        unit = "" if spec["kind"] == "ratio" else f" {spec.get('unit', m.unit)}"
        margin = (
            f"{spec['noise']:g}{unit}" if spec["kind"] == "difference" else f"{spec['noise']:.0%}"
        )
        threshold = f"{sense} {bound:g}{unit} (noise {margin})"
        base = dict(key=key, figure=spec.get("figure", key), peer=spec.get("peer", ""))
        if m.error is not None:
            rows.append(
                Row(**base, value=None, threshold=threshold, verdict=f"ERROR: {m.error}", detail="")
            )
            continue
        if not _measured(spec, m):
            why = m.skipped or "no peer figure"
            rows.append(
                Row(**base, value=None, threshold=threshold, verdict=f"skipped: {why}", detail="")
            )
            continue
        value = _value(spec, m)
        ok = value <= bound if sense == "<=" else value >= bound
        near = value <= widened if sense == "<=" else value >= widened
        verdict = "pass" if ok else "pass (noise)" if near else "FAIL"
        detail = f"{m.ours:.4g} vs {m.peer:.4g} {m.unit}"
        if len(m.runs) > 1:
            detail += f" (median of {len(m.runs)} runs: {min(m.runs):.3f} to {max(m.runs):.3f})"
        rows.append(Row(**base, value=value, threshold=threshold, verdict=verdict, detail=detail))
    return rows


def render(rows: list[Row]) -> str:
    """The gate's table (plain text, fixed columns)."""
    header = ("figure", "peer", "ratio", "threshold", "verdict", "measured (ours vs peer)")
    lines = [
        (
            r.figure,
            r.peer,
            "-" if r.value is None else f"{r.value:.3f}",
            r.threshold,
            r.verdict,
            r.detail,
        )
        for r in rows
    ]
    widths = [max(len(str(x[i])) for x in [header, *lines]) for i in range(len(header) - 1)]

    def fmt(cells) -> str:
        head = "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
        return f"{head}  {cells[-1]}".rstrip()

    rule = "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1])
    return "\n".join([fmt(header), rule, *(fmt(x) for x in lines)])


def exit_code(rows: list[Row]) -> int:
    """1 if a figure regressed (FAIL) or our side could not be measured (ERROR), else 0."""
    return 1 if any(r.verdict == "FAIL" or r.verdict.startswith("ERROR") for r in rows) else 0
