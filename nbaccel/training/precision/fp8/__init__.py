"""FP8 training: recipes (``AORecipeKwargs``, ``TERecipeKwargs``, ``FP8RecipeKwargs``), the
hardware check, torchao's ``Float8Linear`` conversion, Transformer Engine's, and the precision
policy the Accelerator uses for ``mixed_precision="fp8"``. Neither torchao nor Transformer Engine
is imported until a model is converted."""
