"""Hooks around ``module.forward``: the protocol and how hooks are added and removed
(``model_hook``), running a module on its execution device with offloaded weights brought in
(``align_devices``, put on a tree by ``attachment``), whole-model CPU offload (``cpu_offload``)
and layerwise casting (``layerwise_casting``)."""
