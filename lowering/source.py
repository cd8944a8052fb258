"""The user's source line of an op, the same way for both importers: ``file.py:12 (fn)``.

A frame is user code unless its file lies under one of :data:`NON_USER_MODULES` (the
frameworks, the libraries that wrap them, this project's own packages and the stdlib helpers
that decorators run through) or is a frozen or generated module.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable

__all__ = ["NON_USER_MODULES", "is_user_file", "frame_text", "user_line"]

#: packages and modules whose frames are never the user's line
NON_USER_MODULES = (
    "jax",
    "jaxlib",
    "equinox",
    "jaxtyping",
    "torch",
    "transformers",
    "lowering",
    "spyre_jax",
    "device_model",
    "torch_bridge",
    "contextlib",
    "functools",
)

#: one frame: (file name, line number, function name)
Frame = tuple[str, int, str]


def _norm(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


@functools.cache
def _non_user_roots() -> tuple[tuple[str, ...], frozenset[str]]:
    """(package directories, module files) of :data:`NON_USER_MODULES` that are installed.

    Found with ``importlib.util.find_spec``, which locates a top-level module without importing
    it; both the path as imported and its resolved form are kept (frames carry the former).
    """
    dirs: set[str] = set()
    files: set[str] = set()
    for name in NON_USER_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # pragma: no cover - broken installs
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:
            for d in spec.submodule_search_locations:
                dirs.update({_norm(d), _norm(os.path.realpath(d))})
        elif spec.origin and os.path.isabs(spec.origin):
            files.update({_norm(spec.origin), _norm(os.path.realpath(spec.origin))})
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs)), frozenset(files)


@functools.lru_cache(maxsize=4096)
def is_user_file(file_name: str) -> bool:
    """Whether a frame's file is user code (see the module docstring)."""
    if not file_name or file_name.startswith("<frozen"):
        return False
    dirs, files = _non_user_roots()
    for p in {_norm(file_name), _norm(os.path.realpath(file_name))}:
        if p in files or p.startswith(dirs):
            return False
    return True


def frame_text(frame: Frame) -> str:
    """``file:line (function)``."""
    file_name, line, function = frame
    return f"{file_name}:{line} ({function})"


def user_line(frames: Iterable[Frame], fallback: bool = True) -> str:
    """The innermost user frame of ``frames`` (innermost first) as :func:`frame_text`.

    Without a user frame: the innermost frame when ``fallback``, else ``""`` (also without
    frames).
    """
    frames = list(frames)
    for f in frames:
        if is_user_file(f[0]):
            return frame_text(f)
    return frame_text(frames[0]) if frames and fallback else ""
