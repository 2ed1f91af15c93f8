"""MegatronLMPlugin's options, one process: every field of Accelerate's plugin is accepted and
classified; Megatron-LM-only fields and unknown ``other_megatron_args`` are refused by name;
Megatron-LM's schedule (warm-up, constant/linear/cosine/inverse-square-root decay, min_lr,
samples, weight-decay increments) on a torch optimizer; the model families the guide lists
(GPT-2, BERT, T5) and tied embeddings over stages refused with the reason; the launch options
(``--use_megatron_lm``, ``--megatron_lm_*``) checked before any rank starts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nbaccel.training.strategies.megatron.plugin import (
    FIELD_KINDS,
    MegatronLMPlugin,
)
from nbaccel.training.strategies.megatron.scheduler import MegatronLRScheduler


def test_every_field_of_accelerates_plugin_is_accepted_and_classified():
    accelerate = pytest.importorskip("accelerate.utils")
    theirs = {f.name for f in dataclasses.fields(accelerate.MegatronLMPlugin)}
    ours = {f.name for f in dataclasses.fields(MegatronLMPlugin)}
    assert theirs <= ours, sorted(theirs - ours)
    assert set(FIELD_KINDS) == ours


#: a value that asks for each refused field
REFUSED = {
    "use_custom_fsdp": True, "overlap_cpu_optimizer_d2h_h2d": True, "optimizer_cpu_offload": True,
    "use_precision_aware_optimizer": True, "no_load_optim": True, "no_save_optim": True,
    "eod_mask_loss": True, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2,
    "context_parallel_size": 2, "attention_softmax_in_fp32": True,
    "calculate_per_token_loss": True, "attention_backend": False,
    "pipeline_model_parallel_split_rank": 1, "num_layers_per_virtual_pipeline_stage": 1,
    "consumed_samples": [0], "no_wd_decay_cond": len, "scale_lr_cond": len, "lr_mult": 2.0,
    "megatron_dataset_flag": True, "encoder_seq_length": 128, "tensorboard_dir": "tb",
    "set_all_logging_options": True, "use_rotary_position_embeddings": True,
    "custom_train_step_class": object, "custom_train_step_kwargs": {"a": 1},
    "custom_model_provider_function": len, "custom_prepare_model_function": len,
    "custom_megatron_datasets_provider_function": len, "custom_get_batch_function": len,
}  # fmt: skip


def test_refused_fields_are_named_with_the_torch_way():
    assert set(REFUSED) == {n for n, k in FIELD_KINDS.items() if k == "refused"}
    for name, value in REFUSED.items():
        with pytest.raises(NotImplementedError, match=rf"{name}=.*: ") as caught:
            MegatronLMPlugin(**{name: value})
        assert "Megatron-LM" in str(caught.value)
    MegatronLMPlugin(use_custom_fsdp=False, attention_backend=True, context_parallel_size=1)


def test_other_megatron_args_are_read_by_name_or_refused():
    other = {"clip_grad": 0.5, "tensor_model_parallel_size": 2, "min_lr": 1e-5}
    plugin = MegatronLMPlugin(other_megatron_args=other)
    assert (plugin.gradient_clipping, plugin.tp_degree, plugin.min_lr) == (0.5, 2, 1e-5)
    with pytest.raises(NotImplementedError, match=r"\['attention_head_type', 'vocab_file'\]"):
        MegatronLMPlugin(other_megatron_args={"vocab_file": "v.json", "attention_head_type": "x"})
    with pytest.raises(ValueError, match="contradicts tp_degree=4"):
        MegatronLMPlugin(tp_degree=4, other_megatron_args={"tensor_model_parallel_size": 2})


def test_defaults_checks_and_the_launch_environment(monkeypatch):
    plugin = MegatronLMPlugin()
    assert (plugin.tp_degree, plugin.pp_degree, plugin.num_micro_batches) == (1, 1, 1)
    assert plugin.gradient_clipping == 1.0 and plugin.recompute is None  # Accelerate's defaults
    assert MegatronLMPlugin(recompute_activations=True).recompute == "full"
    assert MegatronLMPlugin(recompute_granularity="selective").recompute == "selective"
    assert MegatronLMPlugin(decoder_seq_length=64).seq_length == 64
    for bad, match in (
        ({"lr_decay_style": "WSD"}, "lr_decay_style='WSD': choose one of constant"),
        ({"start_weight_decay": 0.0, "end_weight_decay": 0.1}, "'constant' keeps one"),
        ({"eval_iters": 0}, "eval_iters must be a positive integer"),
        ({"recompute_num_layers": 2}, "recompute_method='block'"),
        ({"seq_length": 32, "decoder_seq_length": 64}, "a decoder model has one sequence"),
    ):
        with pytest.raises((ValueError, NotImplementedError), match=match):
            MegatronLMPlugin(**bad)
    monkeypatch.setenv("MEGATRON_LM_TP_DEGREE", "2")
    monkeypatch.setenv("MEGATRON_LM_SEQUENCE_PARALLELISM", "true")
    monkeypatch.setenv("MEGATRON_LM_GRADIENT_CLIPPING", "0.0")
    plugin = MegatronLMPlugin()
    assert (plugin.tp_degree, plugin.sequence_parallelism, plugin.gradient_clipping) == (2, True, 0)
    assert MegatronLMPlugin(tp_degree=4).tp_degree == 4  # the code's value wins
    with pytest.raises(ValueError, match="= 4 does not divide the 6 ranks"):
        MegatronLMPlugin(tp_degree=2, pp_degree=2).check_world(6)


def _scheduler(dp=1, micro=2, nmb=2, total=10, warmup=2, wd=0.1, **options):
    model = torch.nn.Linear(2, 2)
    groups = [{"params": [model.weight], "weight_decay": wd},
              {"params": [model.bias], "weight_decay": 0.0}]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=1.0, weight_decay=wd)
    plugin = MegatronLMPlugin(num_micro_batches=nmb, **options)
    plugin.set_training_args(micro, dp)
    return MegatronLRScheduler(optimizer, plugin, total, warmup), optimizer


def _lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.step()
    return out


def test_megatron_schedules_on_a_torch_optimizer():
    # warm-up 2 iterations (8 samples) then linear decay to 0 over 10 iterations (40 samples)
    sched, _ = _scheduler()
    assert sched.increment == 4 and sched.lr_warmup_steps == 8 and sched.lr_decay_steps == 40
    expected = [k * 4 / 8 if k <= 2 else 1 - (k * 4 - 8) / 32 for k in range(12)]
    assert _lrs(sched, 12) == pytest.approx([max(e, 0.0) for e in expected])
    cosine, _ = _scheduler(lr_decay_style="cosine", min_lr=0.1)
    got = _lrs(cosine, 11)
    assert got[5] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 12 / 32) + 1))
    assert got[10] == pytest.approx(0.1)
    constant, _ = _scheduler(lr_decay_style="constant")
    assert _lrs(constant, 5) == pytest.approx([0, 0.5, 1, 1, 1])
    isr, _ = _scheduler(lr_decay_style="inverse-square-root")
    assert _lrs(isr, 5)[4] == pytest.approx((8 / 16) ** 0.5)
    fraction, _ = _scheduler(lr_warmup_fraction=0.5)  # half of the 40-sample decay
    assert fraction.lr_warmup_steps == 20
    dp2, _ = _scheduler(dp=2)  # Accelerate: train_iters = total_num_steps // dp
    assert dp2.lr_decay_steps == 5 * 8 and dp2.lr_warmup_steps == 1 * 8
    samples, _ = _scheduler(total=None, train_samples=100, lr_warmup_samples=10)
    assert (samples.lr_decay_steps, samples.lr_warmup_steps) == (100, 10)
    with pytest.raises(ValueError, match="needs the run's length"):
        _scheduler(total=None)


def test_weight_decay_increments_and_resume():
    sched, optimizer = _scheduler(weight_decay_incr_style="linear", start_weight_decay=0.0,
                                  end_weight_decay=0.2)  # fmt: skip
    decays = []
    for _ in range(6):
        decays.append(optimizer.param_groups[0]["weight_decay"])
        assert optimizer.param_groups[1]["weight_decay"] == 0.0  # a no-decay group stays so
        sched.step()
    assert decays == pytest.approx([0.2 * k * 4 / 40 for k in range(6)])
    state = sched.state_dict()
    again, optimizer2 = _scheduler(weight_decay_incr_style="linear", start_weight_decay=0.0,
                                   end_weight_decay=0.2)  # fmt: skip
    again.load_state_dict(state)
    assert again.get_last_lr() == sched.get_last_lr()
    assert optimizer2.param_groups[0]["weight_decay"] == pytest.approx(0.2 * 24 / 40)


def test_gpt2_stage_splits_conv1d_and_gives_the_models_own_state_back():
    transformers = pytest.importorskip("transformers")
    from nbaccel.training.strategies.megatron.gpt2_stages import GPT2Stage, gpt2_tp_plan

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 64, (2, 8))
    logits = model(ids).logits
    stage = GPT2Stage(model, 0, 1)
    assert stage.tied
    stage.to_linears()  # what the tensor-parallel plan starts with
    assert isinstance(stage.transformer.h["0"].mlp.c_fc, torch.nn.Linear)
    assert torch.allclose(stage(ids), logits, atol=1e-5)  # the same model
    back = stage.export_state(stage.state_dict())
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match="tp_degree=3 does not divide GPT-2's n_head=4"):
        gpt2_tp_plan(GPT2Stage(transformers.GPT2LMHeadModel(config), 0, 1), 3)
    from nbaccel.training.strategies.megatron.stages import build_stage

    plugin = MegatronLMPlugin(tp_degree=2, sequence_parallelism=True)
    fresh = transformers.GPT2LMHeadModel(config)
    with pytest.raises(NotImplementedError, match="sequence_parallelism=True is not offered"):
        build_stage(fresh, plugin, 0, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="built with resid_pdrop=0.0"):
        build_stage(fresh, MegatronLMPlugin(hidden_dropout=0.1), 0, None, torch.device("cpu"))


def test_model_families_the_guide_lists_are_refused_with_the_reason():
    transformers = pytest.importorskip("transformers")
    from nbaccel.training.strategies.megatron.decoder_stages import check_decoder_model

    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    with pytest.raises(NotImplementedError, match="BERT is an encoder"):
        check_decoder_model(bert)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=32, d_ff=32, num_layers=1, num_heads=2, d_kv=16)
    )
    with pytest.raises(NotImplementedError, match="T5 is an encoder-decoder"):
        check_decoder_model(t5)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, vocab_size=64,
                                      tie_word_embeddings=True)  # fmt: skip
    tied = transformers.LlamaForCausalLM(config)
    check_decoder_model(tied, stages=1)
    with pytest.raises(NotImplementedError, match="ties lm_head to embed_tokens"):
        check_decoder_model(tied, stages=2)


def test_launch_options_need_use_megatron_lm_and_become_the_ranks_environment():
    from nbaccel.launch.request import Front, LaunchRequest
    from nbaccel.training.strategies.megatron.launch import megatron_check

    with pytest.raises(ValueError, match="megatron_lm_tp_degree configure a Megatron-LM run"):
        LaunchRequest.create(Front.CLI, megatron_lm_tp_degree=2)
    request = LaunchRequest.create(Front.CLI, use_megatron_lm=True, megatron_lm_tp_degree=2,
                                   megatron_lm_sequence_parallelism="true")  # fmt: skip
    env = request.megatron_environment()
    assert env == {"ACCELERATE_USE_MEGATRON_LM": "true", "MEGATRON_LM_TP_DEGREE": "2",
                   "MEGATRON_LM_SEQUENCE_PARALLELISM": "True", "MEGATRON_LM_PP_DEGREE": "1",
                   "MEGATRON_LM_USE_CUSTOM_FSDP": "False",
                   "MEGATRON_LM_GRADIENT_CLIPPING": "1.0",
                   **{f"MEGATRON_LM_{name}": "False" for name in (
                       "NO_LOAD_OPTIM", "EOD_MASK_LOSS", "NO_SAVE_OPTIM", "OPTIMIZER_CPU_OFFLOAD",
                       "USE_PRECISION_AWARE_OPTIMIZER", "OVERLAP_CPU_OPTIMIZER_D2H_H2D",
                   )}}  # fmt: skip
    assert megatron_check(env, 4) == env
    with pytest.raises(ValueError, match="does not divide --num_processes 3"):
        megatron_check(env, 3)
    with pytest.raises(NotImplementedError, match="eod_mask_loss=True"):
        megatron_check({**env, "MEGATRON_LM_EOD_MASK_LOSS": "true"}, 4)


def test_cli_refuses_before_any_rank_starts(tmp_path, capsys):
    from nbaccel.cli import main

    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a rank started')\n")
    base = ["launch", "--cpu", "--num_processes", "4"]
    assert main([*base, "--use_megatron_lm", "--megatron_lm_tp_degree", "3", str(script)]) == 2
    assert "= 3 does not divide --num_processes 4" in capsys.readouterr().err
    assert main([*base, "--megatron_lm_pp_degree", "2", str(script)]) == 2
    assert "add --use_megatron_lm" in capsys.readouterr().err
    flags = ["--use_megatron_lm", "--megatron_lm_use_custom_fsdp", "true"]
    assert main([*base, *flags, str(script)]) == 2
    assert "use_custom_fsdp=True: Megatron-LM's own FSDP" in capsys.readouterr().err
