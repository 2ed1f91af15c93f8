"""Device-map viewer: where each module of a model lives, how much it weighs, what is left.

``show_device_map(model)`` shows, per device, a stacked bar of the module sizes placed there
against the device's capacity, and a module tree coloured by device with sizes; CPU and disk
offload stand out by colour. It works on ``meta`` (empty) models. The returned
:class:`DeviceMapView` has HTML and text reprs (static: readable in saved notebooks) and
``.figure()`` for a matplotlib figure.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from torch import nn

from nbaccel.values.byte_text import byte_unit, human_bytes

__all__ = ["DeviceMapView", "show_device_map"]

_GPU_COLOURS = ("#2e86c1", "#28b463", "#8e44ad", "#16a085", "#2874a6", "#1d8348", "#6c3483")
_COLOURS = {"cpu": "#e67e22", "disk": "#c0392b", "mps": "#17a589", "meta": "#95a5a6"}
_MAX_TREE_NODES = 1500


def _colour(device: Any) -> str:
    if isinstance(device, int):
        return _GPU_COLOURS[device % len(_GPU_COLOURS)]
    return _COLOURS.get(str(device), "#7f8c8d")


def _label(device: Any) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def _device_order(device: Any) -> tuple[int, Any]:
    order = {"mps": 1, "cpu": 2, "disk": 3, "meta": 4}
    return (0, device) if isinstance(device, int) else (order.get(str(device), 5), str(device))


def _observed_map(model: nn.Module) -> dict[str, Any]:
    """Where the tensors are now, collapsed to the largest modules on one device."""
    from nbaccel.bigmodel.planning.device_map import clean_device_map

    placed: dict[str, Any] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        dev = tensor.device
        placed[name] = dev.index or 0 if dev.type == "cuda" else dev.type
    return clean_device_map(placed) if placed else {"": "cpu"}


def _resolve_map(
    model: nn.Module, device_map: Any, budgets: Mapping | None, dtype: Any
) -> dict[str, Any]:
    """The map to show: given, the model's own, where its tensors are, or planned on ``budgets``
    (``max_memory`` checked already, or None for this machine's free memory)."""
    from nbaccel.bigmodel.planning.device_map import get_device_map

    if device_map is None:
        device_map = getattr(model, "hf_device_map", None)
    if device_map is None:
        on_meta = all(p.device.type == "meta" for p in model.parameters())
        if budgets is None and not on_meta:
            return _observed_map(model)
        device_map = "auto"
    no_split = getattr(model, "_no_split_modules", None)
    return dict(get_device_map(model, device_map, budgets, no_split, dtype=dtype))


_QUANTIZED_LABELS = {"Int8Params": "int8", "Int8Tensor": "int8 (torchao)"}


def _dtype_label(tensor: Any) -> str:
    """What a tensor holds: ``nf4``/``fp4`` (bitsandbytes 4-bit), ``int8``, or its dtype."""
    kind = type(tensor).__name__
    if kind == "Params4bit":
        return f"4-bit {getattr(tensor, 'quant_type', '')}".strip()
    if kind in _QUANTIZED_LABELS:
        return _QUANTIZED_LABELS[kind]
    if "Int4" in kind:
        return "int4 (torchao)"
    return str(tensor.dtype).replace("torch.", "")


def _stored_bytes(tensor: Any) -> int:
    parts = getattr(tensor, "__tensor_flatten__", None)
    if parts is not None and type(tensor).__module__.startswith("torchao"):
        names = parts()[0]
        return sum(getattr(tensor, n).numel() * getattr(tensor, n).element_size() for n in names)
    return tensor.numel() * tensor.element_size()


def _dtype_bytes(model: nn.Module, device_map: Mapping[str, Any]) -> dict[Any, dict[str, int]]:
    """device -> {what its tensors hold: bytes}, quantized formats named (nf4, int8, ...)."""
    from nbaccel.bigmodel.planning.device_map import _lookup

    out: dict[Any, dict[str, int]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        try:
            device = _lookup(name, device_map)
        except KeyError:
            continue
        per = out.setdefault(device, {})
        label = _dtype_label(tensor)
        per[label] = per.get(label, 0) + _stored_bytes(tensor)
    return out


def _capacities(devices: list[Any], budgets: Mapping[Any, int]) -> dict[Any, int | None]:
    return {d: budgets.get(d) if d != "disk" or "disk" in budgets else None for d in devices}


class DeviceMapView:
    """A model's device map with sizes; displays itself as HTML, prints as text."""

    def __init__(
        self,
        model: nn.Module,
        device_map: Mapping[str, Any] | str | None = None,
        max_memory: Mapping[int | str, int | str] | None = None,
        dtype: Any = None,
        *,
        absent_gpus: str = "plan",
    ) -> None:
        from nbaccel.bigmodel.planning.absent_devices import absent_devices
        from nbaccel.bigmodel.planning.memory_budgets import get_max_memory
        from nbaccel.bigmodel.planning.module_sizes import compute_module_sizes

        # A bad max_memory is an error before any work; absent GPUs are said here, once.
        budgets = get_max_memory(max_memory, absent_gpus=absent_gpus)
        self.model = model
        given = budgets if max_memory is not None else None
        self.device_map = _resolve_map(model, device_map, given, dtype)
        #: devices in the plan that this machine does not have (absent_gpus="plan")
        self.planned_absent = [d for d in absent_devices(budgets) if d in self.device_map.values()]
        self.sizes = compute_module_sizes(model, dtype=dtype)
        self.entries: dict[Any, list[tuple[str, int]]] = {}
        for name, device in self.device_map.items():
            self.entries.setdefault(device, []).append((name, self.sizes.get(name, 0)))
        self.devices = sorted(self.entries, key=_device_order)
        self.capacity = _capacities(self.devices, budgets)
        self.quantized = bool(getattr(model, "is_quantized", False))
        self.dtypes = _dtype_bytes(model, self.device_map) if self.quantized else {}
        self._skip_display = False

    def dtype_text(self, device: Any) -> str:
        """``int8 12.0 MB, float32 3.2 MB``: what a quantized model keeps on ``device``."""
        per = sorted(self.dtypes.get(device, {}).items(), key=lambda kv: -kv[1])
        return ", ".join(f"{label} {human_bytes(size)}" for label, size in per)

    # ------------------------------------------------------------------ numbers
    def used(self, device: Any) -> int:
        return sum(size for _, size in self.entries[device])

    def device_of(self, name: str) -> Any:
        """The device of module ``name``: its entry, an ancestor's, or "mixed"."""
        probe = name
        while True:
            if probe in self.device_map:
                return self.device_map[probe]
            if not probe:
                break
            probe = probe.rpartition(".")[0]
        prefix = name + "." if name else ""
        below = {d for n, d in self.device_map.items() if n.startswith(prefix)}
        return below.pop() if len(below) == 1 else "mixed"

    # ------------------------------------------------------------------ text
    def text(self, width: int = 30) -> str:
        total = self.sizes.get("", 0)
        lines = [f"Device map of {type(self.model).__name__} ({human_bytes(total)})"]
        if self.planned_absent:
            lines.append(f"  {self._planned_text()}")
        for device in self.devices:
            used, cap = self.used(device), self.capacity.get(device)
            filled = int(round(width * used / cap)) if cap else width
            bar = "#" * min(width, filled) + "." * max(0, width - filled)
            of = f" / {human_bytes(cap)}" if cap else ""
            lines.append(f"  {_label(device):>7} [{bar}] {human_bytes(used)}{of}")
            if self.dtypes.get(device):
                lines.append(f"{'':12}holds: {self.dtype_text(device)}")
            for name, size in self.entries[device]:
                if size or len(self.entries[device]) == 1:
                    lines.append(f"{'':12}{name or '(whole model)'}: {human_bytes(size)}")
        return "\n".join(lines)

    def _planned_text(self) -> str:
        names = ", ".join(_label(d) for d in self.planned_absent)
        them = "them" if len(self.planned_absent) > 1 else "it"
        return f"{names}: not on this machine; the map is for a machine that has {them}"

    def __repr__(self) -> str:
        return self.text()

    # ------------------------------------------------------------------ html
    def _bar_html(self, device: Any) -> str:
        used, cap = self.used(device), self.capacity.get(device)
        scale = cap if cap and cap >= used else max(used, 1)
        segments = "".join(
            f'<div title="{html.escape(name or "(whole model)")}: {human_bytes(size)}" '
            f'style="width:{100 * size / scale:.3f}%;background:{_colour(device)};'
            f'opacity:{0.65 + 0.35 * (i % 2)};border-right:1px solid #fff"></div>'
            for i, (name, size) in enumerate(self.entries[device])
        )
        of = f" of {human_bytes(cap)} ({100 * used / cap:.0f}%)" if cap else ""
        return (
            f'<div class="nbaccel-device" data-device="{html.escape(_label(device))}" '
            'style="display:flex;align-items:center;margin:2px 0">'
            f'<div style="width:5.5em;font-family:monospace">{html.escape(_label(device))}</div>'
            '<div class="nbaccel-device-bar" style="flex:1;display:flex;height:16px;'
            f'background:#eee;border-radius:3px;overflow:hidden">{segments}</div>'
            f'<div style="width:16em;padding-left:8px">{human_bytes(used)}{of}</div></div>'
            + (
                f'<div class="nbaccel-device-dtypes" style="margin-left:5.5em;color:#555">'
                f"holds: {html.escape(self.dtype_text(device))}</div>"
                if self.dtypes.get(device)
                else ""
            )
        )

    def _tree_html(self) -> str:
        count = 0

        def node(name: str, module: nn.Module, depth: int) -> str:
            nonlocal count
            count += 1
            if count > _MAX_TREE_NODES:
                return ""
            device = self.device_of(name)
            chip = (
                f'<span style="background:{_colour(device)};color:#fff;border-radius:3px;'
                f'padding:0 4px;font-size:11px">{html.escape(_label(device))}</span>'
            )
            leaf = name.rpartition(".")[2] or "(model)"
            head = (
                f"<code>{html.escape(leaf)}</code> <small>{type(module).__name__}</small> "
                f"{human_bytes(self.sizes.get(name, 0))} {chip}"
            )
            children = list(module.named_children())
            if not children:
                return f'<div style="margin-left:1.2em">{head}</div>'
            prefix = name + "." if name else ""
            inner = "".join(node(prefix + n, m, depth + 1) for n, m in children)
            opened = " open" if depth == 0 or device == "mixed" else ""
            return (
                f'<details style="margin-left:{0 if depth == 0 else 1.2}em"{opened}>'
                f"<summary>{head}</summary>{inner}</details>"
            )

        tree = node("", self.model, 0)
        more = (
            f"<i>... {count - _MAX_TREE_NODES} more modules</i>" if count > _MAX_TREE_NODES else ""
        )
        return f'<div class="nbaccel-module-tree">{tree}{more}</div>'

    def _repr_html_(self) -> str:
        total = human_bytes(self.sizes.get("", 0))
        bars = "".join(self._bar_html(d) for d in self.devices)
        offload = [d for d in self.devices if d in ("cpu", "disk")]
        note = ""
        if offload and len(self.devices) > 1:
            what = " and ".join(_label(d) for d in offload)
            note = f'<div style="color:#c0392b">offloaded to {what}</div>'
        if self.planned_absent:
            note += (
                '<div class="nbaccel-device-planned" style="color:#555">'
                f"{html.escape(self._planned_text())}</div>"
            )
        return (
            '<div class="nbaccel-device-map" style="font-size:13px">'
            f"<b>Device map</b> of <code>{type(self.model).__name__}</code> ({total})"
            f"{bars}{note}{self._tree_html()}</div>"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self._repr_html_()}

    def _ipython_display_(self) -> None:
        if self._skip_display:  # show_device_map() already displayed it in this cell
            self._skip_display = False
            return
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)

    # ------------------------------------------------------------------ figure
    def figure(self) -> Any:
        """A matplotlib figure: one stacked horizontal bar per device against its capacity."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 0.6 + 0.5 * len(self.devices)))
        ax = fig.add_subplot()
        caps = {d: c for d, c in self.capacity.items() if c and d != "disk"}
        top = max([self.used(d) for d in self.devices] + list(caps.values()) + [1])
        unit, scale = byte_unit(top)
        for row, device in enumerate(self.devices):
            left = 0.0
            for i, (_name, size) in enumerate(self.entries[device]):
                alpha = 0.65 + 0.35 * (i % 2)
                ax.barh(row, size / scale, left=left, color=_colour(device), alpha=alpha)
                left += size / scale
            if device in caps:
                ax.plot([caps[device] / scale] * 2, [row - 0.4, row + 0.4], color="black", lw=1.5)
        ax.set_yticks(range(len(self.devices)), [_label(d) for d in self.devices])
        ax.invert_yaxis()
        ax.set_xlabel(f"{unit} (black line: capacity)")
        ax.set_title(f"Device map of {type(self.model).__name__}")
        fig.tight_layout()
        return fig


def _skip_once_in_this_cell(view: DeviceMapView) -> None:
    """``show_device_map(m)`` as a cell's last line must not display twice."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    view._skip_display = True

    def clear(*_: Any) -> None:
        view._skip_display = False
        shell.events.unregister("post_run_cell", clear)

    shell.events.register("post_run_cell", clear)


def show_device_map(
    model: nn.Module,
    device_map: Mapping[str, Any] | str | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    dtype: Any = None,
    *,
    absent_gpus: str = "plan",
) -> DeviceMapView:
    """Show where ``model``'s modules are (or would be) placed, and return the view.

    ``device_map``: a dict, ``"auto"``/``"balanced"``/``"sequential"``, or None for the model's
    own ``hf_device_map``, else where its tensors are now (a ``meta`` model is planned with
    ``"auto"``). ``max_memory`` sets the capacities (default: this machine's free memory). Its
    GPUs that this machine does not have are planned for (plan on a laptop, run on the cluster)
    or, with ``absent_gpus="drop"``, left out as loading here would; said in one line.
    """
    view = DeviceMapView(model, device_map, max_memory, dtype, absent_gpus=absent_gpus)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(view.text())
        return view
    if get_ipython() is None:
        print(view.text())
        return view
    display(view)
    _skip_once_in_this_cell(view)
    return view
