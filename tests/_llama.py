"""A tiny transformers Llama built from a config (no downloads), its data, and the
single-process training run the parallel layouts are compared with."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ = 128, 16


def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """A LlamaForCausalLM with hidden 64, ``layers`` decoder layers and a 128-token vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class Tokens(Dataset):
    """``n`` random sequences; each item is ``{"input_ids", "labels"}`` (labels = inputs)."""

    def __init__(self, n: int = 32, seed: int = 5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def reference_run(
    steps: int,
    global_batch: int,
    lr: float = 1e-2,
    clip: float | None = None,
    lr_factor=None,
):
    """One process, the whole global batch per step: (losses, final state dict);
    ``lr_factor(step)`` scales the learning rate of each step (a LambdaLR)."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = None
    if lr_factor is not None:
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    losses = []
    for i, batch in enumerate(DataLoader(Tokens(), batch_size=global_batch)):
        if i == steps:
            break
        loss = model(**batch).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
