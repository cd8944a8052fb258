"""The exception types spyre-jax raises (re-exported from the layers that raise them)."""

from device_model.kernel import ScheduleError
from device_model.memory import DeviceOOMError
from lowering.errors import LoweringError, TilingError, UnsupportedPrimitiveError
from lowering.graph import GraphError

__all__ = [
    "DeviceOOMError",
    "GraphError",
    "LoweringError",
    "ScheduleError",
    "TilingError",
    "UnsupportedPrimitiveError",
]
