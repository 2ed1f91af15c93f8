"""No rank-asymmetric collectives: every gather, save and load path of DeepSpeed ZeRO-3, FSDP2,
tensor parallelism and the pipeline, with a model whose output head is tied to its embedding and
one whose is not, on 2 real gloo ranks. After each path the ranks meet under a short timeout and
compare the collectives they made (tests/_collective_walk.py): a collective one rank skips fails
within seconds naming the path, not as a run that never ends. The first test shows that it does.
"""

from __future__ import annotations

import pytest
import torch
from _collective_walk import CollectiveWalk

from nbaccel.testing import RankFailures, run_on_ranks

pytest.importorskip("transformers")

TIMEOUT_S = 20.0


def _models() -> dict:
    """A GPT-2 whose lm_head is its wte (tied) and a Llama with its own lm_head (untied)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    )
    untied = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )  # fmt: skip
    )
    return {"tied": tied, "untied": untied}


def _tp_models() -> dict:
    """Llamas with and without tie_word_embeddings (GPT-2 has no tensor-parallel plan)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = {}
    for name, tie in (("tied", True), ("untied", False)):
        torch.manual_seed(0)
        out[name] = AutoModelForCausalLM.from_config(
            LlamaConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=16,
                tie_word_embeddings=tie,
            )  # fmt: skip
        )
    return out


def _walk_training_paths(walk, accelerator, name, model, optimizer, directory) -> None:
    """The paths every training engine offers, each ended by ``walk.end``."""
    from safetensors.torch import load_file

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    walk.end(f"{name}: a training step")
    state = accelerator.get_state_dict(model)
    walk.end(f"{name}: get_state_dict")
    accelerator.save_model(model, f"{directory}/{name}-save_model")
    walk.end(f"{name}: save_model")
    accelerator.unwrap_model(model).save_pretrained(
        f"{directory}/{name}-pretrained",
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state,
    )
    walk.end(f"{name}: unwrap_model(...).save_pretrained(state_dict=get_state_dict)")
    if hasattr(model, "save_pretrained"):  # the prepared model itself (FSDP2, TP)
        model.save_pretrained(f"{directory}/{name}-own")
        walk.end(f"{name}: model.save_pretrained")
    accelerator.wait_for_everyone()
    accelerator.save_state(f"{directory}/{name}-state")
    walk.end(f"{name}: save_state")
    accelerator.load_state(f"{directory}/{name}-state")
    walk.end(f"{name}: load_state")
    accelerator.wait_for_everyone()
    walk.end(f"{name}: wait_for_everyone")
    full = load_file(f"{directory}/{name}-save_model/model.safetensors")
    accelerator.strategy.load_model_state_dict(model, full, strict=False)
    walk.end(f"{name}: load a full state dict")


def _asymmetric(timeout_s: float) -> None:
    import torch.distributed as dist

    from nbaccel.distributed.state import PartialState

    PartialState()
    with CollectiveWalk(timeout_s) as walk:
        if dist.get_rank() == 1:  # a gather only rank 1 makes
            dist.all_reduce(torch.ones(1))
        walk.end("a path where rank 1 makes one all_reduce more")


def test_a_collective_one_rank_skips_fails_fast_naming_the_path():
    with pytest.raises(RankFailures, match="a path where rank 1 makes one all_reduce more"):
        run_on_ranks(_asymmetric, 2, args=(5.0,), timeout=120)


def _deepspeed(directory: str) -> list[str]:
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator, DeepSpeedPlugin
    from nbaccel.distributed.state import AcceleratorState, GradientState
    from nbaccel.training.strategies.deepspeed.runtime import import_deepspeed

    import_deepspeed("cpu")
    paths = []
    for name, model in _models().items():
        AcceleratorState._reset_state()
        GradientState._reset_state()
        plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=0.0)
        plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        accelerator = Accelerator(deepspeed_plugin=plugin)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with CollectiveWalk(TIMEOUT_S) as walk:
            loader = DataLoader(torch.zeros(4, 8, dtype=torch.long), batch_size=2)  # the batch
            model, optimizer, _ = accelerator.prepare(model, optimizer, loader)
            walk.end(f"deepspeed zero3 {name}: prepare")
            _walk_training_paths(walk, accelerator, f"deepspeed zero3 {name}", model, optimizer,
                                 directory)  # fmt: skip
            paths += walk.paths
    return paths


def _fsdp(directory: str) -> list[str]:
    from nbaccel import Accelerator
    from nbaccel.utils import FullyShardedDataParallelPlugin

    paths = []
    for state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        from nbaccel.distributed.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()
        GradientState._reset_state()
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
        accelerator = Accelerator(fsdp_plugin=plugin)
        for name, model in _models().items():
            with CollectiveWalk(TIMEOUT_S) as walk:
                model = accelerator.prepare(model)
                optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
                walk.end(f"fsdp2 {state_dict_type} {name}: prepare")
                label = f"fsdp2 {state_dict_type} {name}"
                _walk_training_paths(walk, accelerator, label, model, optimizer, directory)
                paths += walk.paths
    return paths


def _tensor_parallel(directory: str) -> list[str]:
    from nbaccel import Accelerator
    from nbaccel.distributed.state import AcceleratorState, GradientState
    from nbaccel.parallelism_config import ParallelismConfig

    paths = []
    for name, model in _tp_models().items():
        AcceleratorState._reset_state()
        GradientState._reset_state()
        accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
        with CollectiveWalk(TIMEOUT_S) as walk:
            model = accelerator.prepare(model)
            optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
            walk.end(f"tp2 {name}: prepare")
            _walk_training_paths(walk, accelerator, f"tp2 {name}", model, optimizer, directory)
            paths += walk.paths
    return paths


def _pipeline() -> list[str]:
    from nbaccel import prepare_pippy
    from nbaccel.distributed.state import PartialState

    PartialState()
    paths = []
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for name in ("tied", "untied"):
        for gather in (False, True):
            model = _models()[name]
            with CollectiveWalk(TIMEOUT_S) as walk:
                piped = prepare_pippy(model.eval(), example_args=(ids[:1],), gather_output=gather)
                walk.end(f"pipeline {name} gather_output={gather}: prepare_pippy")
                with torch.no_grad():
                    piped(ids)
                walk.end(f"pipeline {name} gather_output={gather}: a call")
                paths += walk.paths
    return paths


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2", "tensor_parallel", "pipeline"])
def test_every_gather_save_and_load_path_makes_the_same_collectives_on_every_rank(tmp_path, engine):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
        fn, args, env = _deepspeed, (str(tmp_path),), {"DS_ACCELERATOR": "cpu"}
    elif engine == "fsdp2":
        fn, args, env = _fsdp, (str(tmp_path),), None
    elif engine == "tensor_parallel":
        fn, args, env = _tensor_parallel, (str(tmp_path),), None
    else:
        fn, args, env = _pipeline, (), None
    paths = run_on_ranks(fn, 2, args=args, timeout=500, env=env)
    assert paths[0] == paths[1] and len(paths[0]) >= 4
    assert any("tied" in p for p in paths[0]) and any("untied" in p for p in paths[0])
