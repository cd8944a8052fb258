"""The PyTorch side of spyre-jax: the ``spyre`` device and the ``torch.compile`` backend.

Stacked one way over ``lowering`` and ``device_model`` (never over ``spyre_jax``):

* :mod:`torch_bridge.storage`: spyre tensors' storage in the card's device memory, copies;
* :mod:`torch_bridge.kernels`: graph IR -> a kernel loaded on the card, launched with tensors;
* :mod:`torch_bridge.eager`: compute ops on spyre tensors as cached one-op kernels;
* :mod:`torch_bridge.device`: the PrivateUse1 registration (``torch.spyre``), loaded by
  ``import torch`` through the ``torch.backends`` entry point;
* :mod:`torch_bridge.backend`: ``torch.compile(..., backend="spyre")``.
"""

# torch first, whole: ``import torch`` loads the device (the ``torch.backends`` entry point),
# which stands on this package's modules; a submodule imported before torch would otherwise
# start that load half-way through its own import
import torch  # noqa: F401

__all__: list[str] = []
