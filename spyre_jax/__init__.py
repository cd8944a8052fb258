"""spyre-jax: compile JAX functions for IBM's Spyre card and run them on a simulated card.

>>> import spyre_jax, jax.numpy as jnp, numpy as np
>>> f = spyre_jax.jit(lambda x: jnp.tanh(x) * 2)
>>> y = f(np.ones((4, 100), np.float16))
>>> y.shape
(4, 100)
"""

from device_model.card import CardSpec
from device_model.memory import DeviceOOMError
from lowering.errors import TilingError, UnsupportedPrimitiveError

from . import errors
from .api import Compiled, Jitted, Lowered, jit
from .profile import profile
from .runtime import Array, Device, device_put, devices, memory_stats, set_card
from .streams import (
    Event,
    Stream,
    current_stream,
    default_stream,
    set_race_mode,
    stream,
    synchronize,
)

__all__ = [
    "Array",
    "CardSpec",
    "Compiled",
    "Device",
    "Event",
    "Stream",
    "current_stream",
    "default_stream",
    "set_race_mode",
    "stream",
    "synchronize",
    "DeviceOOMError",
    "Jitted",
    "Lowered",
    "TilingError",
    "UnsupportedPrimitiveError",
    "device_put",
    "devices",
    "errors",
    "jit",
    "memory_stats",
    "profile",
    "set_card",
]
