"""Low-bit from a real notebook kernel: a 4-bit model loaded in the kernel with
``load_and_quantize_model`` and pushed to ``%%distributed`` ranks (``--push``) arrives as
bitsandbytes' ``Params4bit`` whose bytes sit in nbaccel's shared-memory file (mapped, not
re-quantized) and gives the kernel's logits on every rank;
``notebook_launcher(..., mixed_precision="fp8")`` trains with torchao on 2 ranks within 5% of
the bf16 loss at every step."""

from __future__ import annotations

import pytest
from kernel import cell_errors, cell_text, run_notebook

pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")
pytest.importorskip("transformers")

LOAD = """
import logging, tempfile, torch, transformers
logging.disable(logging.WARNING)
from nbaccel import init_empty_weights
from nbaccel.utils import BnbQuantizationConfig, load_and_quantize_model
folder = tempfile.mkdtemp()
config = transformers.LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(folder)
with init_empty_weights():
    empty = transformers.LlamaForCausalLM(config)
model = load_and_quantize_model(empty, BnbQuantizationConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32), folder, device_map="cpu")
model.eval()
x = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    want = model(x).logits
print("kernel", type(model.model.layers[0].mlp.up_proj.weight).__name__)
"""

ON_RANKS = """%%distributed -n 2 --push model,x,want
import torch
maps = [line.split()[0] for line in open("/proc/self/maps") if "nbaccel-" in line]
spans = [tuple(int(v, 16) for v in span.split("-")) for span in maps]
weight = model.model.layers[0].mlp.up_proj.weight
mapped = any(a <= weight.data.data_ptr() < b for a, b in spans)
with torch.no_grad():
    same = torch.equal(model(x).logits, want)
print("rank", type(weight).__name__, weight.quant_type, "mapped" if mapped else "copied", same)
"""

FP8 = """
from nbaccel import notebook_launcher

def train(emulate):
    import torch
    from torch import nn
    from nbaccel import Accelerator
    from nbaccel.utils import AORecipeKwargs
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                        nn.Linear(128, 16))
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(256, 64, generator=g)
    ys = torch.tanh(xs @ torch.randn(64, 16, generator=g) / 8)
    handlers = [AORecipeKwargs(emulate=emulate)] if emulate is not None else []
    accelerator = Accelerator(kwargs_handlers=handlers)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=32)
    net, opt, loader = accelerator.prepare(net, opt, loader)
    losses = []
    for bx, by in loader:
        loss = nn.functional.mse_loss(net(bx), by)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    kinds = [type(m).__name__ for m in accelerator.unwrap_model(net).modules()][1:]
    return accelerator.mixed_precision, losses, kinds

bf16 = notebook_launcher(train, (None,), num_processes=2, mixed_precision="bf16")
fp8 = notebook_launcher(train, (False,), num_processes=2, mixed_precision="fp8")
print("precision", fp8[0][0], bf16[0][0], "kinds", fp8[0][2])
close = all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(fp8[0][1], bf16[0][1]))
print("steps", len(fp8[0][1]), "within 5% of bf16:", close, fp8[0][1] != bf16[0][1])
"""


def test_quantized_model_served_to_ranks_and_fp8_from_notebook_launcher() -> None:
    nb = run_notebook(["%load_ext nbaccel", LOAD, ON_RANKS, "%dist_shutdown", FP8], timeout=240)
    for cell in nb.cells:
        assert not cell_errors(cell), cell_text(cell)
    assert "kernel Params4bit" in cell_text(nb.cells[1])
    ranks = cell_text(nb.cells[2])
    for rank in (0, 1):
        assert f"[rank {rank}] rank Params4bit nf4 mapped True" in ranks, ranks
    out = cell_text(nb.cells[4])
    assert "precision fp8 bf16" in out
    assert "'Linear', 'GELU', 'Float8Linear', 'GELU', 'Linear'" in out
    assert "steps 4 within 5% of bf16: True True" in out, out
