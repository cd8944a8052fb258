"""How the simulation's programs run on the host: XLA's CPU client, synchronous dispatch.

The card model runs each kernel as a JAX program on the host's CPU. JAX's CPU client
dispatches a program asynchronously by default: the call returns at once and a worker
thread runs it. For the card model's programs, mostly small and each one read by the next,
that hand-off costs more than it saves: an eager ``a + b`` of two 64x64 spyre tensors spent
about 27 us in it (the same program 6 us when the worker was already awake), against 12 us
run where it is called. So the first import of the card model turns asynchronous dispatch
off (``jax_cpu_enable_async_dispatch``), before the CPU client exists; results are the same
either way, only the host's wall time changes (the card's simulated timeline is the
streams' business, :mod:`device_model.streams`).

It is JAX's own flag, so it holds for every CPU computation of the process (a program
runs where it is called, as with ``block_until_ready`` after each). To keep asynchronous
dispatch, set it in the environment (``JAX_CPU_ENABLE_ASYNC_DISPATCH=1``): an explicit
choice is never overridden. The flag is read when JAX makes its CPU client, so it has no
effect once JAX has run anything on the CPU before the card model is imported (results are
unchanged then too).
"""

from __future__ import annotations

import os

import jax

__all__ = ["ENV"]

#: JAX's environment variable for the flag: when set, the user's choice stands
ENV = "JAX_CPU_ENABLE_ASYNC_DISPATCH"

if ENV not in os.environ:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
