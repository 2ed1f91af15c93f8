"""Device-map planning: sizes of modules and tensors (``module_sizes``, the identity walk
``size_walk`` with ``size_ties``), memory budgets per device (``memory_budgets``,
``absent_devices``), the plans (``device_map`` with Accelerate's ``greedy_fill`` and nbaccel's
``offload_planner``) and the small pieces Accelerate exposes on their own
(``building_blocks``)."""
