"""Writing a plot file whole or not at all (``replay --plot``, ``simulate --sweep``).

``savefig(path)`` truncates ``path`` and writes into it: a Ctrl-C, SIGTERM or a full disk
mid-write left half an image under the name the user asked for (and an earlier plot there was
lost). The figure goes to a hidden temporary name beside it, then is renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def partial_name(target: Path) -> Path:
    """The temporary name ``save_figure`` writes ``target`` under (same folder, so the rename is
    atomic): ``.NAME.PID.partial``."""
    return target.with_name(f".{target.name}.{os.getpid()}.partial")


def save_figure(fig: Any, path: Path, *, dpi: int = 120) -> None:
    """Write ``fig`` to a temporary file beside ``path``, then rename it into place: a Ctrl-C or
    a full disk mid-write leaves no half image under ``path`` (an existing one stays whole) and,
    since the temporary file is removed on every way out that runs ``finally`` (SIGTERM too, in
    the CLI, see ``cli/interrupt.py``), nothing beside it. A path that is no regular file
    (``/dev/null``, a FIFO) is written to, never replaced, and a symbolic link is written through."""
    fmt = path.suffix[1:].lower() or None  # the format from the suffix, as savefig(path) takes it
    if path.exists() and not path.is_file():
        fig.savefig(path, dpi=dpi, format=fmt)
        return
    target = path.resolve() if path.is_symlink() else path
    partial = partial_name(target)
    try:
        with open(partial, "wb") as handle:
            fig.savefig(handle, dpi=dpi, format=fmt)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
