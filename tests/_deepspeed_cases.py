"""Models, data and one-process references shared by the DeepSpeed tests (CPU ranks, gloo)."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: DeepSpeed 0.19 clips gradients at 1.0 unless told otherwise; the references do not clip
NO_CLIP = {"gradient_clipping": 0.0}
ENV = {"DS_ACCELERATOR": "cpu"}


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def config(stage: int, **extra) -> dict:
    """A config whose batch and accumulation values prepare fills ("auto")."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        **NO_CLIP,
        "zero_optimization": {"stage": stage},
        **extra,
    }


def reference(steps: int, accumulation: int = 1, batch: int = 16, lr: float = 1e-2):
    """One process, global batches of ``batch``: per-micro-step losses and final weights."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i, (x, y) in enumerate(DataLoader(dataset(), batch_size=batch)):
        if i == steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
