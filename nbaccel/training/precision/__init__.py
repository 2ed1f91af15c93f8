"""Mixed precision: the autocast/loss-scaling policy, its free-function contexts, and FP8
(``fp8/``)."""
