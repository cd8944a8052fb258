"""``SPYRE_DUMP=1`` shows every IR a compile makes: the imported graph, the graph after each
pass, the schedule. Checked in a child process (the handler is installed once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

from device_model.card import CardSpec
from lowering.pipeline import graph_passes

_PROGRAM = """
import jax, numpy as np
import spyre_jax

@spyre_jax.jit
def f(x, w):
    return jax.nn.relu(x @ w).sum(axis=-1)

f(np.ones((32, 64), np.float32), np.ones((64, 32), np.float32))
"""


def test_spyre_dump_prints_every_ir():
    env = dict(os.environ, SPYRE_DUMP="1", SPYRE_PROGRESS="0")
    res = subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    err = res.stderr
    assert ": imported\n" in err
    for name, _ in graph_passes(CardSpec()):
        assert f": after {name}\n" in err, name
    assert ": schedule\n" in err
    # the typed parameters print as name=value: the matmul's dtype, the reduction's kind
    assert "matmul[" in err and "dtype=float32" in err
    assert "kind=sum" in err
    assert "compiled " in err


def test_no_dump_without_the_variable():
    env = {k: v for k, v in os.environ.items() if k != "SPYRE_DUMP"}
    env["SPYRE_PROGRESS"] = "0"
    res = subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert ": imported" not in res.stderr
