"""Values read from or written for people, one module per concept: sizes (``"10GiB"`` -> bytes),
byte_text (bytes -> ``"1.5 KiB"``), booleans (``"yes"``/``"0"``, environment flags).

The bottom of the tree: nothing here imports the rest of nbaccel, so every layer may use it.
"""
