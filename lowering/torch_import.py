"""torch, imported for the FX importer so that torch's device plugins see the importer whole.

``import torch`` ends by loading the ``torch.backends`` entry points, ours among them: the
``spyre`` device (``torch_bridge``) stands on this importer. When the first ``import torch`` of a
process happens here, half-way through loading ``lowering.from_fx``, that plugin would find the
importer half-loaded. So torch is imported here with its autoload postponed, and
:func:`finish` (called at the end of each FX module) runs it once none of them is half-loaded.
When torch is already imported, or its autoload is switched off, nothing changes.
"""

from __future__ import annotations

import os
import sys

_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
_postponed = "torch" not in sys.modules and os.environ.get(_AUTOLOAD, "1") == "1"
if _postponed:
    os.environ[_AUTOLOAD] = "0"
    try:
        import torch
    finally:
        os.environ[_AUTOLOAD] = "1"
else:
    import torch
import torch.fx  # noqa: E402

__all__ = ["torch", "finish"]


#: the modules of the FX importer (each ends with ``finish(__name__)``)
FX_MODULES = (
    "lowering.fx_common",
    "lowering.fx_elementwise",
    "lowering.fx_tensor",
    "lowering.fx_select",
    "lowering.fx_scatter",
    "lowering.fx_conv",
    "lowering.fx_pool",
    "lowering.fx_random",
    "lowering.fx_misc",
    "lowering.from_fx",
)


def finish(loaded: str) -> None:
    """Module ``loaded`` is whole: load torch's device plugins if importing torch here postponed
    them and no other FX module is half-loaded (its own ``finish`` will then do it)."""
    global _postponed
    if not _postponed:
        return
    for name in FX_MODULES:
        mod = sys.modules.get(name)
        if name != loaded and mod is not None and getattr(mod.__spec__, "_initializing", False):
            return
    _postponed = False
    torch._import_device_backends()
