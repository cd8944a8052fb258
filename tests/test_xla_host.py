"""The card model runs its programs where they are called (XLA's CPU client synchronous,
:mod:`device_model.xla_host`), unless the user chose otherwise with JAX's own variable.

Each case runs in a fresh interpreter: the flag is read once, when JAX makes its CPU client.
Whether dispatch is asynchronous shows in a program that takes a while: called with
asynchronous dispatch it returns before its result is ready; run where it is called it
returns with the result ready."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import torch
import jax, jax.numpy as jnp
# the first thing run on the card model: an eager op on the spyre device
a = torch.ones(64, 64).to("spyre")
assert torch.equal((a + a).cpu(), torch.full((64, 64), 2.0))
# then a program that takes ~0.1 s on 2 cores: is its result ready when the call returns?
f = jax.jit(lambda x: (x @ x @ x).sum())
x = jnp.ones((1200, 1200), jnp.float32)
f(x).block_until_ready()  # compiled
print("ready" if f(x + 1).is_ready() else "pending")
"""


def _probe(env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "JAX_CPU_ENABLE_ASYNC_DISPATCH"}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, "ready"),  # the card model's default: synchronous
        ({"JAX_CPU_ENABLE_ASYNC_DISPATCH": "1"}, "pending"),  # the user's choice stands
    ],
)
def test_dispatch_mode(env: dict[str, str], want: str) -> None:
    assert _probe(env) == want


@pytest.mark.slow
def test_the_asynchronous_paths_still_hold():
    # run where they are called, the card's results are ready when a launch returns, so the
    # waits for kernels in flight (pending results, reads of host bytes) are never exercised
    # in this process: run their tests again with JAX's asynchronous dispatch
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_CPU_ENABLE_ASYNC_DISPATCH="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            os.path.join(here, "test_eager_lazy.py"),
            os.path.join(here, "test_streams.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(here),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
