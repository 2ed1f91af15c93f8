"""How a launch option is defined (``spec``: :func:`option`, :class:`Front`), and the launch-time
option tables of the engines and launcher variants that the request is built from: ``megatron``
(``--megatron_lm_*``), ``deepspeed`` (the ZeRO flags' values), ``ray`` (``ray_*``), and
``accelerate_env``: Accelerate's launch contract, the rank variables every setting becomes. Each
table checks and parses its options without importing its engine; ``LaunchRequest`` holds the
fields.
"""
