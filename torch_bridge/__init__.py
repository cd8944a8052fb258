"""The PyTorch side of spyre-jax (the ``torch.compile`` backend and the ``spyre`` device).

Not built yet: this package holds its place in the layering (it will use ``lowering`` and the
same launch path as ``spyre_jax``). See the project's issues for the plan.
"""

__all__: list[str] = []
