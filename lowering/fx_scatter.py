"""torch FX rules: scatters and indexed updates (``scatter``, ``scatter_add``,
``scatter_reduce``, ``index_put``, ``index_add``, ``index_copy``).

They register into :data:`lowering.fx_common.RULES` when ``lowering.from_fx`` imports this module.
"""

from __future__ import annotations

from . import torch_import
from .torch_import import torch

aten = torch.ops.aten


torch_import.finish(__name__)  # see lowering.torch_import
