"""The alias table: Accelerate's module paths -> the nbaccel modules that hold those names.

Data only (read by :mod:`nbaccel.compat.finder`). A source is ``"module"`` (its public names:
``__all__``) or ``"module:a,b,new=old"`` (just those names; ``new=old`` exposes ``old`` as
``new``). Later sources win on a name clash. The ``"nbaccel"`` entry lists the extra names of
the top-level package (served by its ``__getattr__``).
"""

from __future__ import annotations

_STATE = "nbaccel.distributed.state"
_OPS = (
    _STATE + ":AcceleratorState,DistributedType,PartialState",
    "nbaccel.distributed.environment:is_torch_xla_available",
    "nbaccel.distributed.probes:is_torch_version,is_torch_distributed_available",
    "nbaccel.distributed.collectives",
    "nbaccel.distributed.structures",
    "nbaccel.distributed.operation_checks",
    "nbaccel.training.precision.policy:convert_outputs_to_fp32,convert_to_fp32",
    "nbaccel.training.precision.contexts:ConvertOutputsToFp32",
    "nbaccel.bigmodel.placement:find_device",
    "nbaccel.training.strategies.deepspeed.wrappers:GatheredParameters",
)
_MODELING = (
    "nbaccel.bigmodel.hooks.align_devices:align_module_device,has_offloaded_params",
    "nbaccel.bigmodel.planning.device_map:check_device_map,clean_device_map,get_device_map,infer_auto_device_map",
    "nbaccel.bigmodel.planning.memory_budgets",
    "nbaccel.bigmodel.planning.module_sizes:calculate_maximum_sizes,compute_module_sizes,dtype_byte_size,"
    "get_max_layer_size,named_module_tensors",
    "nbaccel.bigmodel.loading.checkpoint:load_checkpoint_in_model,CheckpointMismatchError",
    "nbaccel.bigmodel.placement:set_module_tensor_to_device,find_device",
    "nbaccel.bigmodel.ties",
    "nbaccel.bigmodel.planning.building_blocks",
    "nbaccel.bigmodel.loading.weight_files:get_state_dict_from_offload,get_state_dict_offloaded_model,"
    "load_state_dict",
    "nbaccel.bigmodel.hooks.layerwise_casting:SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "nbaccel.storage.serialization:id_tensor_storage",
    "nbaccel.training.config.run_options:CustomDtype",
    "nbaccel.training.precision.contexts:get_grad_scaler,get_mixed_precision_context_manager",
    "nbaccel.training.config.unsupported_stacks:has_4bit_bnb_layers",
    "nbaccel.distributed.device_cache",
    "nbaccel.training.strategies.model_inspection:is_peft_model",
    "nbaccel.bigmodel.loading.weight_files:load_offloaded_weight,offload_weight",
    "nbaccel.bigmodel.offload:load_offloaded_weights,save_offload_index",
    "nbaccel.storage.weights:SAFE_WEIGHTS_NAME,WEIGHTS_INDEX_NAME,WEIGHTS_NAME",
)
_OFFLOAD = (
    "nbaccel.bigmodel.offload:OffloadedWeightsLoader,PrefixedDataset,load_offloaded_weights,"
    "offload_state_dict,save_offload_index",
    "nbaccel.bigmodel.loading.weight_files:extract_submodules_state_dict,load_offloaded_weight,offload_weight",
)
_DATACLASSES = (
    _STATE + ":DistributedType",
    "nbaccel.training.config.configuration",
    "nbaccel.training.config.kwargs_handlers",
    "nbaccel.training.strategies.fsdp.plugin:FullyShardedDataParallelPlugin",
    "nbaccel.training.tracking.trackers:LoggerType",
    "nbaccel.training.config.run_options",
    "nbaccel.training.strategies.deepspeed.plugin:DeepSpeedPlugin",
    "nbaccel.training.config.unsupported_stacks:DeepSpeedSequenceParallelConfig,FP8BackendType,"
    "MODEL_CONFIGS_TO_MEGATRON_PARSERS",
    "nbaccel.training.precision.fp8.recipes:FP8RecipeKwargs,TERecipeKwargs,AORecipeKwargs,MSAMPRecipeKwargs",
    "nbaccel.bigmodel.quantization.config:BnbQuantizationConfig,TorchAoConfig",
    "nbaccel.training.config.parallelism_config:TorchContextParallelConfig,TorchTensorParallelConfig",
    "nbaccel.training.strategies.model_parallel.tensor_parallel:TorchTensorParallelPlugin",
    "nbaccel.training.strategies.megatron.strategy:MegatronLMPlugin",
    "nbaccel.distributed.structures:TensorInformation",
    "nbaccel.training.strategies.model_inspection:get_module_class_from_name",
)
_ENVIRONMENT = (
    "nbaccel.distributed.environment_patch",
    "nbaccel.distributed.host_info",
    "nbaccel.distributed.probes:get_current_device_type",
)
_IMPORTS = ("nbaccel.distributed.probes", "nbaccel.distributed.environment:is_torch_xla_available")
_OTHER = (
    "nbaccel.storage.serialization",
    "nbaccel.training.step.compile_regions",
    "nbaccel.training.strategies.ddp:extract_model_from_parallel",
    "nbaccel.training.strategies.fsdp.checkpoint:merge_fsdp_weights",
    "nbaccel.distributed.operation_checks:wait_for_everyone",
    "nbaccel.distributed.host_info:check_os_kernel",
    "nbaccel.distributed.environment_patch:convert_dict_to_env_variables",
    "nbaccel.training.constants:FSDP_PYTORCH_VERSION",
    "nbaccel.training.step.compile_regions:compile_regions_deepspeed",
    "nbaccel.launch.host.ports:get_free_port=free_port,is_port_in_use",
    "nbaccel.training.strategies.model_inspection:convert_bytes,recursive_getattr",
    "nbaccel.training.config.run_options:get_pretty_name,merge_dicts",
    "nbaccel.commands.config.default:write_basic_config",
    "nbaccel.distributed.probes:is_torch_version,is_weights_only_available,is_deepspeed_available",
)
_RANDOM = (
    _STATE + ":AcceleratorState,DistributedType",
    "nbaccel.distributed.environment:is_torch_xla_available",
    "nbaccel.distributed.probes:is_xpu_available,is_npu_available,is_mlu_available,"
    "is_musa_available,is_sdaa_available,is_hpu_available,is_neuron_available",
    "nbaccel.distributed.random",
    "nbaccel.training.config.configuration:RNGType",
    "nbaccel.training.constants:CUDA_DISTRIBUTED_TYPES",
)
_MEMORY = (
    "nbaccel.distributed.probes:is_cuda_available,is_mps_available,is_xpu_available,"
    "is_npu_available,is_mlu_available,is_musa_available,is_sdaa_available,is_hpu_available,"
    "is_neuron_available",
    "nbaccel.training.step.batch_size",
    "nbaccel.distributed.device_cache",
)
_VERSIONS = ("nbaccel.distributed.probes:compare_versions,is_torch_version,STR_OPERATION_TO_FUNC",)
_CONSTANTS = (
    "nbaccel.training.constants",
    "nbaccel.distributed.operation_checks:TORCH_DISTRIBUTED_OPERATION_TYPES",
    "nbaccel.distributed.probes:STR_OPERATION_TO_FUNC",
    "nbaccel.bigmodel.hooks.layerwise_casting:SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
)
_UNSUPPORTED = "nbaccel.training.config.unsupported_stacks"
_DEEPSPEED = (
    "nbaccel.training.strategies.deepspeed.wrappers:DeepSpeedEngineWrapper,"
    "DeepSpeedOptimizerWrapper,DeepSpeedSchedulerWrapper,DummyOptim,DummyScheduler,"
    "map_pytorch_optim_to_deepspeed",
    "nbaccel.training.strategies.deepspeed.config:HfDeepSpeedConfig",
    "nbaccel.training.strategies.deepspeed.plugin:DeepSpeedPlugin,get_active_deepspeed_plugin",
)
_SCHEDULER = "nbaccel.training.strategies.megatron.scheduler:MegatronLMDummyScheduler"
_MEGATRON = (
    _UNSUPPORTED + ":MegatronEngine,MegatronLMOptimizerWrapper,MegatronLMSchedulerWrapper,"
    "MegatronLMDummyDataLoader,AbstractTrainStep,BertTrainStep,"
    "GPTTrainStep,T5TrainStep,add_model_config_to_megatron_parser,"
    "avg_losses_across_data_parallel_group,gather_across_data_parallel_groups,finish_mpu_init,"
    "initialize,model_provider_func,prepare_model_optimizer_scheduler,prepare_optimizer,"
    "prepare_scheduler,prepare_data_loader=megatron_prepare_data_loader",
    _SCHEDULER,
)
_AO = (
    "nbaccel.training.precision.fp8.ao_conversion:convert_model_to_fp8_ao,filter_linear_layers,"
    "filter_first_and_last_linear_layers,find_first_last_linear_layers,has_ao_layers",
)
_FP8 = (
    "nbaccel.training.precision.fp8.te_conversion:apply_fp8_autowrap,contextual_fp8_autocast,convert_model",
    *_AO,
    _UNSUPPORTED + ":has_transformer_engine_layers",
)
_BNB = (
    "nbaccel.bigmodel.quantization:load_and_quantize_model,replace_with_bnb_layers,"
    "quantize_and_offload_8bit,get_keys_to_not_convert,get_quantized_model_device_map,"
    "BnbQuantizationConfig,TorchAoConfig",
    _UNSUPPORTED + ":has_4bit_bnb_layers",
)
_FSDP = (
    "nbaccel.training.strategies.fsdp.checkpoint",
    "nbaccel.training.strategies.model_inspection:get_module_class_from_name,is_peft_model",
    "nbaccel.bigmodel.planning.building_blocks:get_non_persistent_buffers",
    "nbaccel.training.step.compile_regions:get_module_children_bottom_up",
    "nbaccel.training.strategies.fsdp.plugin",
    "nbaccel.training.step.compile_regions:is_compiled_module,compile_regions_fsdp2",
)

# accelerate.utils re-exports (almost) every name of its submodules.
_UTILS = (
    *_MODELING, *_OFFLOAD, *_OPS, *_DATACLASSES, *_ENVIRONMENT, *_IMPORTS, *_OTHER, *_RANDOM,
    *_MEMORY, *_VERSIONS, *_CONSTANTS, *_DEEPSPEED, *_FP8, *_BNB,
    "nbaccel.storage.weights:SAFE_WEIGHTS_INDEX_NAME,SAFE_WEIGHTS_NAME,WEIGHTS_INDEX_NAME,WEIGHTS_NAME",
    "nbaccel.training.strategies.fsdp.checkpoint:merge_fsdp_weights",
    "nbaccel.training.strategies.fsdp.plugin",
    "nbaccel.training.config.parallelism_config:ParallelismConfig",
    "nbaccel.launch.prepare_for_launch:PrepareForLaunch",
    "nbaccel.launch.command_env:prepare_multi_gpu_env,prepare_simple_launcher_cmd_env,prepare_tpu",
    "nbaccel.training.tracking.trackers:GeneralTracker,LoggerType",
    "nbaccel.distributed.progress",
    "nbaccel.training.strategies.fsdp.checkpoint:load_fsdp_model,load_fsdp_optimizer,"
    "save_fsdp_model,save_fsdp_optimizer",
    "nbaccel.training.strategies.deepspeed.launch:prepare_deepspeed_cmd_env",
    "nbaccel.training.strategies.deepspeed.config:HfDeepSpeedConfig",
    "nbaccel.training.strategies.deepspeed.plugin:DeepSpeedPlugin,get_active_deepspeed_plugin",
    "nbaccel.training.strategies.deepspeed.wrappers:DeepSpeedEngineWrapper,"
    "DeepSpeedOptimizerWrapper,DeepSpeedSchedulerWrapper,DummyOptim,DummyScheduler,"
    "map_pytorch_optim_to_deepspeed",
    "nbaccel.training.config.unsupported_stacks:install_xla,setup_fp8_env,"
    "MegatronLMDummyDataLoader,AbstractTrainStep,"
    "BertTrainStep,GPTTrainStep,T5TrainStep,add_model_config_to_megatron_parser,"
    "avg_losses_across_data_parallel_group",
    _SCHEDULER,
    "nbaccel.training.strategies.deepspeed.wrappers:GatheredParameters",
    _STATE + ":DistributedType",
)  # fmt: skip

_TRACKING = (
    _STATE + ":PartialState",
    "nbaccel.distributed.logging:get_logger",
    "nbaccel.training.tracking.registry",
    "nbaccel.training.tracking.trackers",
    "nbaccel.training.tracking.backends",
)
_TEST_UTILS_TESTING = (
    _STATE + ":AcceleratorState,GradientState",
    "nbaccel.distributed.collectives:gather",
    "nbaccel.distributed.probes",
    "nbaccel.distributed.environment:is_torch_xla_available",
    "nbaccel.distributed.environment_patch:str_to_bool",
    "nbaccel.testing.markers",
    "nbaccel.testing.cases",
    "nbaccel.testing.subprocesses",
    "nbaccel.distributed.environment_patch:parse_flag_from_env",
    "nbaccel.distributed.probes:is_hpu_available,is_xpu_available,is_cuda_available,is_mps_available",
)
_TEST_UTILS_TRAINING = ("nbaccel.testing.regression", _STATE + ":DistributedType")

ALIASES: dict[str, tuple[str, ...]] = {
    "nbaccel": (
        "nbaccel.bigmodel.pipeline:prepare_pippy",
        "nbaccel.training.config.parallelism_config:ParallelismConfig",
        "nbaccel.distributed.probes:is_rich_available",
        "nbaccel.distributed.random:synchronize_rng_states",
        "nbaccel.training.config.run_options:TorchDynamoPlugin",
    ),
    "nbaccel.state": (
        "nbaccel.distributed.probes",
        "nbaccel.distributed.host_info",
        "nbaccel.distributed.environment_patch",
        "nbaccel.distributed.environment:is_torch_xla_available",
        _STATE,
        "nbaccel.distributed.state_helpers",
        _STATE + ":DistributedType",
    ),
    "nbaccel.accelerator": (
        *_OPS,
        *_OTHER,
        _STATE,
        "nbaccel.distributed.logging:get_logger",
        "nbaccel.data:DataLoaderDispatcher,prepare_data_loader,skip_first_batches",
        "nbaccel.training.step.optimizer:AcceleratedOptimizer",
        "nbaccel.training.step.scheduler:AcceleratedScheduler",
        "nbaccel.training.tracking.trackers:GeneralTracker",
        "nbaccel.training.tracking.registry:filter_trackers",
        "nbaccel.training.step.batch_size:release_memory",
        "nbaccel.bigmodel.hooks.align_devices:has_offloaded_params",
        "nbaccel.bigmodel.loading.weight_files:get_state_dict_offloaded_model",
        "nbaccel.training.precision.contexts:get_grad_scaler,get_mixed_precision_context_manager",
        "nbaccel.training.strategies.fsdp.checkpoint:load_fsdp_model,load_fsdp_optimizer,"
        "save_fsdp_model,save_fsdp_optimizer",
        "nbaccel.training.precision.fp8.te_conversion:apply_fp8_autowrap,convert_model",
        "nbaccel.training.precision.fp8.ao_conversion:convert_model_to_fp8_ao",
        "nbaccel.training.step.compile_regions:compile_regions_deepspeed",
        "nbaccel.training.strategies.deepspeed.wrappers:DeepSpeedEngineWrapper,"
        "DeepSpeedOptimizerWrapper,DeepSpeedSchedulerWrapper,DummyOptim,DummyScheduler,"
        "map_pytorch_optim_to_deepspeed",
        "nbaccel.training.accelerator.core:Accelerator",
        "nbaccel.training.config.parallelism_config:ParallelismConfig",
        "nbaccel.training.tracking.registry:LOGGER_TYPE_TO_CLASS",
        "nbaccel.training.constants",
        "nbaccel.distributed.probes",
        *_DATACLASSES,
    ),
    "nbaccel.logging": ("nbaccel.distributed.logging", _STATE + ":PartialState"),
    "nbaccel.big_modeling": (
        "nbaccel.bigmodel.loading.weight_files:extract_submodules_state_dict",
        _UNSUPPORTED + ":_refuse_recurrent_layers_under_sequence_parallelism",
        "nbaccel.bigmodel",
        "nbaccel.bigmodel.hooks.layerwise_casting",
    ),
    "nbaccel.hooks": (
        "nbaccel.bigmodel.offload:PrefixedDataset",
        "nbaccel.bigmodel.placement:find_device,set_module_tensor_to_device",
        "nbaccel.bigmodel.planning.module_sizes:named_module_tensors",
        "nbaccel.distributed.collectives:send_to_device",
        "nbaccel.distributed.device_cache",
        "nbaccel.bigmodel.planning.building_blocks:get_non_persistent_buffers",
        "nbaccel.bigmodel.hooks.model_hook",
        "nbaccel.bigmodel.hooks.align_devices:AlignDevicesHook",
        "nbaccel.bigmodel.hooks.cpu_offload",
        "nbaccel.bigmodel.hooks.attachment",
        "nbaccel.bigmodel.hooks.layerwise_casting:LayerwiseCastingHook",
    ),
    "nbaccel.data_loader": (
        _STATE + ":DistributedType,GradientState,PartialState",
        "nbaccel.training.config.configuration:RNGType",
        "nbaccel.distributed.collectives",
        "nbaccel.distributed.structures:get_data_structure,initialize_tensors,slice_tensors",
        "nbaccel.distributed.random:synchronize_rng_states",
        "nbaccel.data",
        "nbaccel.data.loader_state",
    ),
    "nbaccel.tracking": _TRACKING,
    "nbaccel.optimizer": (
        _STATE + ":AcceleratorState,DistributedType,GradientState",
        "nbaccel.training.step.optimizer:AcceleratedOptimizer",
    ),
    "nbaccel.scheduler": (
        _STATE + ":AcceleratorState,GradientState",
        "nbaccel.training.step.scheduler:AcceleratedScheduler",
    ),
    "nbaccel.checkpointing": (
        "nbaccel.storage.serialization:load,save",
        "nbaccel.training.constants:MODEL_NAME,OPTIMIZER_NAME,RNG_STATE_NAME,SAFE_MODEL_NAME,"
        "SAMPLER_NAME,SCALER_NAME,SCHEDULER_NAME,SAFE_WEIGHTS_NAME,WEIGHTS_NAME",
    ),
    "nbaccel.local_sgd": ("nbaccel.training.step.local_sgd:LocalSGD",),
    "nbaccel.launchers": ("nbaccel.notebook.kernel.launcher:debug_launcher,notebook_launcher",),
    "nbaccel.inference": ("nbaccel.bigmodel.pipeline",),
    "nbaccel.memory_utils": (
        "nbaccel.training.step.batch_size:find_executable_batch_size,release_memory",
    ),
    "nbaccel.parallelism_config": ("nbaccel.training.config.parallelism_config",),
    "nbaccel.utils": _UTILS,
    "nbaccel.utils.ao": _AO,
    "nbaccel.utils.bnb": _BNB,
    "nbaccel.utils.constants": _CONSTANTS,
    "nbaccel.utils.dataclasses": _DATACLASSES,
    "nbaccel.utils.deepspeed": _DEEPSPEED,
    "nbaccel.utils.environment": _ENVIRONMENT,
    "nbaccel.utils.fsdp_utils": _FSDP,
    "nbaccel.utils.imports": _IMPORTS,
    "nbaccel.utils.megatron_lm": _MEGATRON,
    "nbaccel.utils.memory": _MEMORY,
    "nbaccel.utils.modeling": _MODELING,
    "nbaccel.utils.offload": _OFFLOAD,
    "nbaccel.utils.operations": _OPS,
    "nbaccel.utils.other": _OTHER,
    "nbaccel.utils.random": _RANDOM,
    "nbaccel.utils.tqdm": ("nbaccel.distributed.progress",),
    "nbaccel.utils.transformer_engine": _FP8,
    "nbaccel.utils.versions": _VERSIONS,
    "nbaccel.utils.torch_xla": (_UNSUPPORTED + ":install_xla",),
    "nbaccel.test_utils": (*_TEST_UTILS_TESTING, *_TEST_UTILS_TRAINING),
    "nbaccel.test_utils.testing": _TEST_UTILS_TESTING,
    "nbaccel.test_utils.training": _TEST_UTILS_TRAINING,
}

# Accelerate's launch helpers and test scripts. "=module" makes the
# façade path that very module, so mock.patch("nbaccel.utils.launch.which") reaches its code.
ALIASES["nbaccel.utils.launch"] = ("=nbaccel.launch.command_env",)
ALIASES["nbaccel.launchers"] = ALIASES.get("nbaccel.launchers", ()) + (
    "nbaccel.launch.prepare_for_launch:PrepareForLaunch",
)
ALIASES["nbaccel.test_utils"] += (
    "nbaccel.testing.scripts:test_cli,test_ops,test_script,test_sync",
)
ALIASES["nbaccel.test_utils.scripts"] = ("=nbaccel.testing.scripts",)
for _script in ("test_cli", "test_ops", "test_script", "test_sync", "test_distributed_data_loop",
                "test_ddp_comm_hook", "test_merge_weights"):  # fmt: skip
    ALIASES[f"nbaccel.test_utils.scripts.{_script}"] = (f"=nbaccel.testing.scripts.{_script}",)
