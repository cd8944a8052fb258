"""The exception types spyre-jax raises (re-exported from the layers that raise them)."""

from device_model.kernel import ScheduleError
from device_model.memory import DeviceOOMError
from device_model.streams import RaceError, RaceWarning, StreamError
from lowering.errors import (
    LoweringError,
    LoweringRuleError,
    PRNGKeyError,
    TilingError,
    UnsupportedPrimitiveError,
)
from lowering.graph import GraphError

__all__ = [
    "DeviceOOMError",
    "GraphError",
    "LoweringError",
    "LoweringRuleError",
    "PRNGKeyError",
    "RaceError",
    "RaceWarning",
    "StreamError",
    "ScheduleError",
    "TilingError",
    "UnsupportedPrimitiveError",
]
