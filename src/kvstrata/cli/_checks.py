"""Loading a config from the command line and the checks every command makes before any work."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvstrata.cli._app import (
    EXIT_INVALID,
    _fail,
)
from kvstrata.core.config import (
    ENV_NESTING,
    ENV_PREFIX,
    KvstrataConfig,
    load_config,
)
from kvstrata.plugins.errors import ConfigError, KvstrataError, PluginError
from kvstrata.plugins.host import PluginHost


def _override_culprits(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(dotted path, what the user wrote) of every ``--set`` and ``KVSTRATA_A__B`` override."""
    culprits = []  # in precedence order: environment first, then --set, later ones win
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIX) and ENV_NESTING in name:
            path = ".".join(part.lower() for part in name[len(ENV_PREFIX) :].split(ENV_NESTING))
            culprits.append((path, f"environment {name}={os.environ[name]}"))
    culprits += [(text.partition("=")[0].strip(), f"--set {text}") for text in overrides]
    return culprits


def blame_overrides(exc: ConfigError, overrides: Sequence[str]) -> ConfigError:
    """The same errors, each blamed on the ``--set`` (or environment override) that set the bad
    field instead of on the config files, which never contained that value."""
    culprits = _override_culprits(overrides)
    found = [
        next(
            (text for where, text in reversed(culprits) if path == where or path.startswith(where + ".")),
            None,
        )
        for path, _ in exc.errors
    ]
    if found and all(found):  # every error comes from overrides: name them, not the files
        return ConfigError(exc.errors, ", ".join(dict.fromkeys(c for c in found if c)))
    errors = [
        (path, f"{reason} (from {culprit})" if culprit else reason)
        for (path, reason), culprit in zip(exc.errors, found, strict=True)
    ]
    return ConfigError(errors, exc.source)


def load_cli_config(
    files: Sequence[Path], overrides: Sequence[str], host: PluginHost, *, user_overrides: Sequence[str] = ()
) -> KvstrataConfig:
    """``load_config`` with errors of ``user_overrides`` blamed on them (exit 2 on any error)."""
    try:
        return load_config(files, overrides, host=host)
    except ConfigError as exc:
        raise _fail(blame_overrides(exc, user_overrides), EXIT_INVALID) from None
    except PluginError as exc:
        raise _fail(exc, EXIT_INVALID) from None


def check_stack(config: KvstrataConfig, host: PluginHost, *, machine: bool) -> None:
    """Refuse (exit 2) a config that start-up would refuse, with start-up's own message, before
    anything is opened or allocated (``machine``: also check this machine has the device)."""
    from kvstrata.core.builder import check_startup

    try:
        check_startup(config, host, machine=machine)
    except (ValueError, KvstrataError) as exc:
        raise _fail(exc, EXIT_INVALID) from None


def check_output_path(option: str, path: Path | None) -> None:
    """Refuse an output file that cannot be written before a run, not after it (exit 2)."""
    if path is None:
        return
    parent = path.parent
    if path.is_dir():
        problem = "is a directory; give a file name"
    elif not parent.is_dir():
        problem = f"its directory {parent} does not exist"
    elif not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem = "is not writable (permission denied)"
    else:
        problem = _open_problem(path)
        if problem is None:
            return
    raise _fail(f"{option} {path}: {problem}", EXIT_INVALID)


def _open_problem(path: Path) -> str | None:
    """Open ``path`` for appending as the run will write it (root passes every permission test,
    a read-only file system does not); a file this test created is removed again."""
    existed = path.exists()
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    except OSError as exc:
        return f"cannot be written: {exc.strerror or exc}"
    if not existed:
        path.unlink(missing_ok=True)
    return None


def check_plot_format(path: Path | None) -> None:
    """The plot's format comes from its suffix: refuse one matplotlib cannot write (exit 2)."""
    if path is None or not path.suffix:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise _fail(
            f"--plot {path}: matplotlib cannot write {path.suffix!r} files; use one of "
            f"{', '.join('.' + f for f in sorted(formats))}",
            EXIT_INVALID,
        )


def describe_os_error(exc: OSError, config: KvstrataConfig | None = None) -> str:
    """An OSError in words, with the config field it comes from when a storage path is involved."""
    what = exc.strerror or str(exc)
    filename = f" {exc.filename}" if exc.filename else ""
    if config is not None and exc.filename:
        for instance, backend in config.tiers.storage.items():
            for field, value in backend.model_dump().items():
                if isinstance(value, Path) and str(exc.filename).startswith(str(value)):
                    return (
                        f"cannot use tiers.storage.{instance}.{field} ({value}): {what}:{filename}; "
                        f"point it at a directory you can write (--set tiers.storage.{instance}.{field}=DIR)"
                    )
    return f"{what}:{filename}"
