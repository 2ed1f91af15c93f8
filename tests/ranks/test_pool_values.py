"""Values out of a pool (``%dist_pull``): a value that cannot come back to the notebook is named
by its name and path on the rank, with what to do; the pool goes on. Real ranks (an in-process
pool driven by this test)."""

from __future__ import annotations

import re

import pytest

from nbaccel.launch.wire.unpicklable import ResultNotSendable


def test_pulling_a_value_that_cannot_travel_names_it_and_says_what_to_do(pool):
    pool.run_cell(
        "import threading\n"
        "gen = (i for i in range(3))\n"
        "box = {'steps': 3, 'lock': threading.Lock()}\n"
    )
    with pytest.raises(ResultNotSendable) as generator:
        pool.pull("gen", ranks=[1])
    with pytest.raises(ResultNotSendable) as nested:
        pool.pull("box")
    after = pool.run_cell("box['steps'] + 1")
    text = str(generator.value)
    assert text.startswith("gen (generator) on rank 1 cannot be brought into the notebook")
    assert "cannot pickle 'generator' object" in text and "list(gen) of a generator" in text
    assert "pull that instead" in text
    assert re.match(r"box\['lock'\] \(lock\) on rank [01] cannot be brought", str(nested.value))
    for shown in (text, str(nested.value)):  # worded for a pull, not for a launched function
        assert "function succeeded" not in shown and "return value" not in shown.lower()
    assert after[0]["data"]["text/plain"] == "4"  # the pool and its names are kept
