"""The recipe: what one launch of a compiled function submits to the card, as typed steps.

A :class:`Recipe` is frozen and printable. It is the template of a launch; each launch
is executed by ``device_model.launching.launch`` on the current stream:

* ``copy_in``: host to device over PCIe, one per argument that is a host array (arguments
  already in device memory skip it);
* ``run_kernel``: the one device-compute step, reading the argument and constant buffers and
  writing the output buffers;
* ``copy_out``: device to host, taken when the host reads a result (``np.asarray``);
* ``record_event`` / ``wait_event``: joins between streams, submitted by the user.
"""

from __future__ import annotations

from dataclasses import dataclass

from .card import CardSpec
from .layout import TensorLayout
from .memory import format_bytes

__all__ = ["RecipeStep", "Recipe", "copy_seconds"]


def copy_seconds(nbytes: int, card: CardSpec) -> float:
    """Simulated time of a host<->device copy of ``nbytes`` over PCIe (``card.pcie_bw``)."""
    return nbytes / card.pcie_bw


@dataclass(frozen=True, slots=True)
class RecipeStep:
    """One typed step of a recipe: kind, what it names, the bytes it moves, its simulated time,
    and ``index``: the argument (``copy_in``) or result (``copy_out``) it moves."""

    kind: str
    name: str
    nbytes: int = 0
    seconds: float = 0.0
    note: str = ""
    index: int = -1

    def __str__(self) -> str:
        size = f" {format_bytes(self.nbytes)}" if self.nbytes else ""
        t = f" {self.seconds * 1e6:.2f} us" if self.seconds else ""
        note = f"  ({self.note})" if self.note else ""
        return f"{self.kind:<12} {self.name}{size}{t}{note}"


@dataclass(frozen=True, slots=True)
class Recipe:
    """The steps of one launch, in order."""

    name: str
    steps: tuple[RecipeStep, ...]

    def __str__(self) -> str:
        lines = [f"recipe {self.name}:"]
        lines += [f"  {i}: {s}" for i, s in enumerate(self.steps)]
        return "\n".join(lines)

    @staticmethod
    def for_kernel(
        name: str,
        in_layouts: list[TensorLayout],
        out_layouts: list[TensorLayout],
        kernel_seconds: float,
        num_consts: int,
        card: CardSpec,
    ) -> Recipe:
        def copies(kind: str, prefix: str, lays: list[TensorLayout], when: str) -> list:
            return [
                RecipeStep(
                    kind, f"{prefix}{i} {lay}", lay.nbytes, copy_seconds(lay.nbytes, card), when, i
                )
                for i, lay in enumerate(lays)
            ]

        run = f"{name} ({len(in_layouts)} args, {num_consts} constants)"
        steps = [
            *copies("copy_in", "arg", in_layouts, "only for a host array"),
            RecipeStep("run_kernel", run, 0, kernel_seconds),
            *copies("copy_out", "out", out_layouts, "when the host reads it"),
        ]
        return Recipe(name, tuple(steps))
