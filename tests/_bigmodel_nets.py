"""Small models shared by the big-model inference tests (tied weights, buffers, blocks)."""

from __future__ import annotations

import json
import os
import random

import torch
from safetensors.torch import save_file
from torch import nn

from nbaccel.bigmodel import compute_module_sizes, init_empty_weights


class Block(nn.Module):
    """A residual block with a persistent and a non-persistent buffer."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("gate", torch.arange(d, dtype=torch.float32) / d, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x)))) * self.scale + self.gate


class TiedNet(nn.Module):
    """Embedding -> blocks -> norm -> head, the head tied to the embedding."""

    def __init__(self, d: int = 16, vocab: int = 32, n: int = 4, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def reference(seed: int = 0, **kwargs) -> tuple[TiedNet, torch.Tensor, torch.Tensor]:
    """A randomly initialised model, an input and its output."""
    torch.manual_seed(seed)
    model = TiedNet(**kwargs)
    with torch.no_grad():
        for block in model.blocks:
            block.scale.uniform_(0.5, 1.5)
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        out = model(ids)
    return model, ids, out


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with each tied tensor once (what safetensors' save_model writes)."""
    seen, out = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.contiguous()
    return out


def save_sharded(model: nn.Module, folder, fmt: str = "safetensors", shards: int = 3) -> str:
    """Write a sharded checkpoint with an HF-style index; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    state = unique_state(model)
    names = list(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = {n: state[n] for n in names[i * per : (i + 1) * per]}
        if not part:
            continue
        fname = f"model-{i:05d}.{'safetensors' if fmt == 'safetensors' else 'bin'}"
        if fmt == "safetensors":
            save_file(part, os.path.join(folder, fname))
        else:
            torch.save(part, os.path.join(folder, fname))
        weight_map.update(dict.fromkeys(part, fname))
    index = (
        "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    )
    with open(os.path.join(folder, index), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(folder)


class RandomBlock(nn.Module):
    """Random leaves, lists and nested blocks (2 levels), sometimes own tensors."""

    def __init__(self, rng: random.Random, depth: int):
        super().__init__()
        for i in range(rng.randint(1, 4)):
            kind = rng.random()
            if depth > 0 and kind < 0.35:
                child = RandomBlock(rng, depth - 1)
            elif kind < 0.55:
                child = nn.ModuleList(
                    nn.Linear(rng.randint(1, 9), rng.randint(1, 9))
                    for _ in range(rng.randint(1, 3))
                )
            elif kind < 0.7:
                child = nn.BatchNorm1d(rng.randint(1, 6))
            elif kind < 0.8:
                child = nn.Embedding(rng.randint(2, 12), rng.randint(1, 5))
            else:
                child = nn.Linear(rng.randint(1, 12), rng.randint(1, 12), bias=rng.random() < 0.5)
            self.add_module(f"m{i}", child)
        if rng.random() < 0.2:
            self.scale = nn.Parameter(torch.ones(rng.randint(1, 6)))
        if rng.random() < 0.2:
            self.register_buffer("mask", torch.ones(rng.randint(1, 40), dtype=torch.bool))


def random_case(seed: int) -> tuple[nn.Module, dict]:
    """A random meta model (half of them with a weight tied across the tree) and random
    ``infer_auto_device_map`` arguments for it."""
    rng = random.Random(seed)
    with init_empty_weights(include_buffers=False):
        model = nn.Sequential(*(RandomBlock(rng, 2) for _ in range(rng.randint(1, 5))))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears and rng.random() < 0.5:  # a weight tied between two places in the tree
        source = rng.choice(linears)
        with init_empty_weights():
            tied = nn.Linear(source.in_features, source.out_features, bias=False)
        tied.weight = source.weight
        holder = rng.choice(
            [m for m in model.modules() if isinstance(m, RandomBlock | nn.Sequential)]
        )
        holder.add_module("tied", tied)
    total = compute_module_sizes(model)[""]
    gpus = rng.randint(0, 3)
    memory = {i: int(total * rng.uniform(0.05, 0.6)) for i in range(gpus)}
    if rng.random() < 0.8:
        memory["cpu"] = int(total * rng.uniform(0.1, 1.2))
    if not memory:
        memory["cpu"] = int(total * 0.5)
    kwargs = {
        "max_memory": memory,
        "no_split_module_classes": ["RandomBlock"] if rng.random() < 0.3 else None,
        "offload_buffers": rng.random() < 0.3,
        "fallback_allocation": rng.random() < 0.4,
        "clean_result": rng.random() < 0.7,
    }
    return model, kwargs


class Expert(nn.Module):
    """Two equal-size projections (layers of equal size: their count matters)."""

    def __init__(self, d: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, d: int, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))


class MoeModel(nn.Module):
    """Embedding, MoE decoder layers, a head tied to the embedding unless ``tie=False``."""

    def __init__(self, layers: int, experts: int, d: int = 16, vocab: int = 64, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d, experts) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
