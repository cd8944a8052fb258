"""Ops on spyre tensors run by the CPU over the tensors' own bytes: factories with no spyre
input, ops with nothing to compute, and the CPU fallback of an op the card cannot run
(:mod:`torch_bridge.eager` warns and counts those). In-place writes land in device memory,
``out=`` tensors are resized and filled, new results are copied in; each movement of bytes is
a step on the current stream."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import storage as st
from .errors import UnsupportedLayoutError
from .host_kernels import host_kernel

__all__ = ["run_on_host"]


def run_on_host(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op(*args, **kwargs)`` on the CPU, every spyre tensor standing in as a CPU tensor over
    its bytes (the host waits for the card where it must). An op with no CPU kernel of its own
    runs as its stand-in (:func:`torch_bridge.host_kernels.host_kernel`)."""
    schema = op._schema
    stand_in: dict[int, torch.Tensor] = {}  # id(cpu tensor) -> the spyre tensor it stands for
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def to_cpu(v: Any, write: bool, is_out: bool) -> Any:
        if isinstance(v, torch.device) and v.type == st.NAME:
            return torch.device("cpu")
        if not st.is_spyre(v):
            return v
        if is_out:
            c = torch.empty(0, dtype=v.dtype)
            outs.append((v, c))
        else:
            st.host_reads(v)
            c = st.alias(v)  # zero copy; in-place writes land in device memory
        if write:
            stand_in[id(c)] = v
        return c

    def each(v: Any, write: bool, is_out: bool) -> Any:
        if isinstance(v, list | tuple | dict):
            return tree_map(lambda x: to_cpu(x, write, is_out), v)
        return to_cpu(v, write, is_out)

    cargs = list(args)
    ckwargs = dict(kwargs)
    for i, a in enumerate(schema.arguments):
        write = a.alias_info is not None and a.alias_info.is_write
        if i < len(cargs) and not a.kwarg_only:
            cargs[i] = each(cargs[i], write, a.is_out)
        elif a.name in ckwargs:
            ckwargs[a.name] = each(ckwargs[a.name], write, a.is_out)
    for k, v in list(ckwargs.items()):  # device=spyre of factories not in the schema walk
        if isinstance(v, torch.device) and v.type == st.NAME:
            ckwargs[k] = torch.device("cpu")
    res = host_kernel(op)(*cargs, **ckwargs)  # a stand-in where the CPU has no kernel
    for v, c in outs:
        write_out(v, c)
    for v in stand_in.values():
        if all(v is not o for o, _ in outs):
            st.host_writes(v)

    def back(r: Any) -> Any:
        if isinstance(r, torch.Tensor):
            s = stand_in.get(id(r))
            if s is not None:
                return s
            if r.layout != torch.strided:
                raise UnsupportedLayoutError(
                    f"spyre: {op} gives a {r.layout} tensor; the spyre device holds strided "
                    f"(dense) tensors only: call it on a CPU tensor (x.cpu())"
                )
            return st.new_from_cpu(r)
        return r

    return tree_map(back, res)


def write_out(v: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """CPU result ``c`` written into spyre ``out=`` tensor ``v`` (resized as torch resizes an
    ``out=`` tensor): a copy-in step. A ``v`` with no bytes yet (a factory's ``empty(0)``)
    takes a new storage of ``c``'s bytes as its own, with no resize."""
    if st.takes_storage(v, c.dtype):
        return st.adopt(v, st.new_from_cpu(c))
    if tuple(v.shape) != tuple(c.shape):
        v.resize_(c.shape)
    st.alias(v).copy_(c)
    st.host_writes(v)
    return v
