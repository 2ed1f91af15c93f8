"""The smallest launch check: say which devices this rank sees (``nbaccel launch`` runs it)."""

from __future__ import annotations

import torch

__all__ = ["main"]


def main() -> None:
    """Print the number and kind of accelerators visible to this process."""
    if torch.cuda.is_available():
        count, kind = torch.cuda.device_count(), "GPU"
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        count, kind = torch.xpu.device_count(), "XPU"
    else:
        count, kind = 0, "GPU"
    print(f"Successfully ran on {count} {kind}s")


if __name__ == "__main__":
    main()
