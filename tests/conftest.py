"""What the tests share: fixtures and input makers.

Fixtures (found by pytest): ``small_card`` (simulate a card with some fields changed, the
default card again afterwards) and ``fresh_card`` (a new default card: empty device memory,
fresh streams, race mode "raise" afterwards). Helpers (``from conftest import ...``): ``rng``,
``torch_rand``. Every test starts with no eager size seen to vary (``torch_bridge.buckets``).
Results are compared with the test oracle of ``spyre_jax.tools.testing`` (``assert_close``,
``assert_tree_close``, ``tolerance``: one tolerance table by dtype, scaled by ``sqrt(k) * chain``);
no test file keeps a tolerance table of its own.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import spyre_jax
from spyre_jax import CardSpec


def rng(seed: int = 0) -> np.random.Generator:
    """NumPy's generator, seeded (every test draws its inputs from a fixed seed)."""
    return np.random.default_rng(seed)


def torch_rand(
    shape: Any, dtype: torch.dtype = torch.float32, seed: int = 0, lo: float = -2.0, hi: float = 2.0
) -> torch.Tensor:
    """A CPU tensor uniform in ``[lo, hi)`` from a seeded torch generator, cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * (hi - lo) + lo).to(dtype)


@pytest.fixture
def small_card() -> Iterator[Callable[..., CardSpec]]:
    """``small_card(scratchpad_bytes=...)`` simulates ``CardSpec().replace(...)`` from then on;
    the default card comes back after the test."""

    def use(**kw: Any) -> CardSpec:
        card = CardSpec().replace(**kw)
        spyre_jax.set_card(card)
        return card

    yield use
    spyre_jax.set_card(CardSpec())


@pytest.fixture
def fresh_card() -> Iterator[None]:
    """A new default card for the test (empty memory, fresh streams); race mode "raise" after."""
    spyre_jax.set_card(CardSpec())
    yield
    spyre_jax.set_race_mode("raise")


@pytest.fixture(autouse=True)
def _eager_sizes_forgotten() -> Iterator[None]:
    """Each test starts with no eager dimension seen to vary (``torch_bridge.buckets``): the
    compile counts a test asserts do not depend on the tests before it."""
    from torch_bridge import buckets

    buckets.reset()
    yield


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test module's last test: every object alive then (the libraries, the caches of
    compiled programs and traced jaxprs, which only grow) stays out of Python's full collections
    from then on (``gc.freeze``). Each full collection walked them all, millions of objects,
    tens of times a session (about 5% of the suite's time). The cost: a reference cycle among
    frozen objects that a later test drops stays in memory (reference counting still frees the
    rest; the workers' peak RSS did not grow), and a test's own ``gc.collect()`` (the memory
    tests) still finds the cycles among the objects made since."""
    if nextitem is None or nextitem.module is not item.module:
        gc.freeze()
