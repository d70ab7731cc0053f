"""Progress bars for long work (tqdm, on stderr), shared by every layer.

``progress=None`` (the default of every function that takes it) draws a bar
when stderr is a terminal or the code runs in a Jupyter kernel, and nothing in
logs, pipes and tests, nor when the environment sets ``TQDM_DISABLE`` (tqdm's
own switch, which transformers' and datasets' bars follow) to any non-empty value,
as tqdm reads it (``0`` too); ``True`` forces it, ``False`` switches it off.
"""
from __future__ import annotations

import os
import sys

from tqdm.std import tqdm

__all__ = ["progress_bar", "progress_enabled"]


def _in_notebook() -> bool:
    # a Jupyter kernel's stderr is no TTY, yet renders a redrawn line well
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:  # an IPython too old or half-imported: no notebook then
        return False
    return type(shell).__name__ == "ZMQInteractiveShell"


def progress_enabled(progress: bool | None, stream=None) -> bool:
    """Whether to draw: ``progress`` itself, or for ``None`` whether ``stream``
    (default stderr) is a terminal or this runs in a notebook, unless ``TQDM_DISABLE`` is set."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None (auto), got {progress!r}")
    if progress is not None:
        return progress
    # tqdm reads TQDM_DISABLE only as the default of disable=, which we always pass: honoured here
    if os.environ.get("TQDM_DISABLE"):   # (tqdm: any non-empty value, "0" included, switches its bars off)
        return False
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)()) or _in_notebook()


def progress_bar(iterable=None, *, total: int | None = None, desc: str = "", progress: bool | None = None,
                 unit: str = "it", file=None) -> tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand when it is None) on ``file``
    (default stderr); a disabled bar (see :func:`progress_enabled`) prints nothing
    and costs nothing.

    Example:
        >>> for step in progress_bar(range(3), desc="train", progress=False):
        ...     pass
    """
    enabled = progress_enabled(progress, file)
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, disable=not enabled, dynamic_ncols=True,
                leave=True)
