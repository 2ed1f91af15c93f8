"""Where offloaded weights live between forwards, and how they come back in time.

- :class:`~nbaccel.storage.safetensors_file.SafetensorsFile` reads a safetensors file in place
  (zero-copy views of a private memory map, or exact-size ``pread`` copies). A checkpoint in
  safetensors is therefore never rewritten to offload it; other formats are written once, as
  safetensors, into the offload folder (:func:`offload_state_dict`).
- :class:`OffloadedWeightsLoader` is the name -> tensor mapping the hooks read from: in-memory
  tensors (cpu offload) and index entries pointing into safetensors files (disk offload).
- :class:`Prefetcher` loads the weights of the next offloaded module on a background thread while
  the current one computes (page-in of the memory map on CPU; pinned copy on a side stream on
  CUDA). The order is learned from the first forward, so out-of-order modules are handled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from nbaccel.storage.safetensors_file import SafetensorsFile
from nbaccel.storage.weights import drop_tied_aliases, write_safetensors

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "Prefetcher",
    "SafetensorsFile",
    "load_offload_index",
    "load_offloaded_weights",
    "offload_state_dict",
    "save_offload_index",
]

INDEX_NAME = "index.json"


def _dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype {name!r} in an offload index.")
    return dtype


class OffloadedWeightsLoader(Mapping):
    """name -> tensor over in-memory tensors and an offload index (safetensors entries, or raw
    ``{name}.dat`` files as written by Accelerate). Disk tensors are returned as mmap views."""

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping[str, Mapping[str, Any]] | None = None,
        device: torch.device | str | None = None,
        release_after_use: bool = True,
    ):
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Give OffloadedWeightsLoader a state_dict, a save_folder or an index.")
        self.state_dict = dict(state_dict or {})
        self.save_folder = str(save_folder) if save_folder is not None else None
        if index is None and save_folder is not None:
            index = load_offload_index(save_folder)
        self.index = dict(index or {})
        self.device = device
        self.release_after_use = release_after_use
        self._files: dict[str, SafetensorsFile] = {}
        self._keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]

    def _file(self, path: str) -> SafetensorsFile:
        if not os.path.isabs(path) and self.save_folder is not None:
            path = os.path.join(self.save_folder, path)
        found = self._files.get(path)
        if found is None:
            found = self._files[path] = SafetensorsFile(path)
        return found

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            tensor = self.state_dict[key]
        else:
            info = self.index[key]
            if "safetensors_file" in info:
                tensor = self._file(info["safetensors_file"]).view(info.get("weight_name", key))
            else:
                tensor = self._load_dat(key, info)
            target = info.get("dtype")
            if target is not None and str(tensor.dtype) != _dtype_str(target):
                tensor = tensor.to(_dtype_from_str(target))
        if self.device is not None:
            tensor = tensor.to(self.device)
        return tensor

    def _load_dat(self, key: str, info: Mapping[str, Any]) -> torch.Tensor:
        if self.save_folder is None:
            raise KeyError(f"{key}: a .dat offload entry needs save_folder.")
        path = os.path.join(self.save_folder, f"{key}.dat")
        dtype_name = info["dtype"]
        stored = torch.int16 if dtype_name == "bfloat16" else _dtype_from_str(dtype_name)
        shape = tuple(info["shape"]) or (1,)
        tensor = torch.from_file(
            path, shared=False, size=int(torch.Size(shape).numel()), dtype=stored
        )
        tensor = tensor.view(shape)
        if dtype_name == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tensor.reshape(tuple(info["shape"]))

    def advise(self, key: str, populate: bool) -> None:
        """Prefetch (populate) or release the pages of a disk-backed entry; no-op otherwise."""
        if key in self.state_dict or key not in self.index:
            return
        info = self.index[key]
        if "safetensors_file" not in info:
            return
        if not populate and not self.release_after_use:
            return
        self._file(info["safetensors_file"]).advise(info.get("weight_name", key), populate)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _dtype_str(name: str) -> str:
    return name if name.startswith("torch.") else f"torch.{name}"


class PrefixedDataset(Mapping):
    """The view of a weights map seen by one submodule: ``ds[k] == dataset[prefix + k]``."""

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str):
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[self.prefix + key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self.prefix + key) in self.dataset

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return iter([k[n:] for k in self.dataset if k.startswith(self.prefix)])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def advise(self, key: str, populate: bool) -> None:
        advise = getattr(self.dataset, "advise", None)
        if advise is not None:
            advise(self.prefix + key, populate)


def load_offload_index(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The ``index.json`` of an offload folder ({} when there is none)."""
    path = Path(folder) / INDEX_NAME
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def save_offload_index(index: Mapping[str, Mapping[str, Any]], folder: str | os.PathLike) -> None:
    """Merge ``index`` into the folder's ``index.json``."""
    os.makedirs(folder, exist_ok=True)
    merged = load_offload_index(folder)
    merged.update(index)
    tmp = Path(folder) / (INDEX_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(merged, f, indent=1)
    os.replace(tmp, Path(folder) / INDEX_NAME)


def offload_state_dict(
    save_dir: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor],
    file_name: str = "offload.safetensors",
) -> dict[str, dict[str, Any]]:
    """Write ``state_dict`` once as one safetensors file in ``save_dir`` and index it.

    Tensors sharing memory (tied weights) are stored once (``storage.weights``' convention) and
    indexed under every name.
    """
    os.makedirs(save_dir, exist_ok=True)
    unique, aliases = drop_tied_aliases({k: v.detach() for k, v in state_dict.items()})
    write_safetensors(unique, os.path.join(save_dir, file_name))
    index = {}
    for name, tensor in unique.items():
        index[name] = {
            "safetensors_file": file_name,
            "weight_name": name,
            "dtype": str(tensor.dtype).replace("torch.", ""),
            "shape": list(tensor.shape),
        }
    for name, target in aliases.items():
        index[name] = dict(index[target])
    save_offload_index(index, save_dir)
    return index


def load_offloaded_weights(
    model: torch.nn.Module,
    index: Mapping[str, Mapping[str, Any]],
    offload_folder: str | os.PathLike,
) -> None:
    """Load every indexed weight back into ``model`` as a regular in-memory tensor."""
    from nbaccel.bigmodel.placement import set_module_tensor_to_device

    loader = OffloadedWeightsLoader(save_folder=offload_folder, index=index)
    for name in index:
        set_module_tensor_to_device(model, name, "cpu", value=loader[name].clone())


class Prefetcher:
    """Runs ``hook.prepare_weights(background=True)`` for the module expected next, on one worker
    thread, while the current module computes. Shared by every offloading hook of one model."""

    def __init__(self, enabled: bool = True):
        self.hooks: list[Any] = []
        self.next_of: dict[int, int] = {}
        self.pending: dict[int, Future] = {}
        self.last: int | None = None
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0

    def register(self, hook: Any) -> int:
        self.hooks.append(hook)
        return len(self.hooks) - 1

    def _submit(self, index: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="nbaccel-prefetch")
        self.pending[index] = self._pool.submit(self.hooks[index].prepare_weights, True)

    def fetch(self, index: int) -> Any:
        """Weights for hook ``index`` (prefetched when predicted), then start the next one."""
        future = self.pending.pop(index, None)
        if future is not None:
            prepared = future.result()
            self.hits += 1
        else:
            prepared = self.hooks[index].prepare_weights(False)
            self.misses += 1
        self.pending.clear()  # a mispredicted prefetch is simply dropped
        if self.last is not None:
            self.next_of[self.last] = index
        self.last = index
        if self.enabled and len(self.hooks) > 1:
            nxt = self.next_of.get(index, (index + 1) % len(self.hooks))
            if nxt != index:
                self._submit(nxt)
        return prepared

    def close(self) -> None:
        self.pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
