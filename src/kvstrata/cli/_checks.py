"""Loading a config from the command line and the checks every command makes before any work."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvstrata.cli._app import (
    EXIT_INVALID,
    _fail,
    err,
)
from kvstrata.core.config import KvstrataConfig, compose, load
from kvstrata.core.config_text import ENV_NESTING, ENV_PREFIX, env_path
from kvstrata.plugins.errors import ConfigError, KvstrataError, PluginError
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.storage_backend import BackendConfig


def _override_culprits(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(dotted path, what the user wrote) of every ``--set`` and ``KVSTRATA_A__B`` override."""
    culprits = []  # in precedence order: environment first, then --set, later ones win
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIX) and ENV_NESTING in name:
            culprits.append((".".join(env_path(name)), f"environment {name}={os.environ[name]}"))
    culprits += [(text.partition("=")[0].strip(), f"--set {text}") for text in overrides]
    return culprits


def _holds(data: Mapping[str, Any], path: str) -> bool:
    """Whether the composed files' mapping ``data`` has the dotted ``path``."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def blame_overrides(
    exc: ConfigError, overrides: Sequence[str], files_data: Mapping[str, Any] | None = None
) -> ConfigError:
    """The same errors, each blamed on the ``--set`` (or environment override) that set the bad
    field instead of on the config files, which never contained that value. An error at or below
    an override's path is that override's, and so is one at the node whose ``type`` it set (an
    unknown type is reported at the node); so is one at a section above it that the files
    (``files_data``, their composed mapping) do not have: the override created it (a typo such as
    ``tiers.hostt.capacity_tokens``, or an L3 instance without a ``type``)."""
    culprits = _override_culprits(overrides)

    def blamed(path: str) -> str | None:
        low = path.lower()  # a variable's path is lower-cased; the files may spell it ``SSD``
        for where, text in reversed(culprits):
            where = where.lower()
            if low == where or low.startswith(where + ".") or where == low + ".type":
                return text  # at or below the override's path, or the node whose type it set
            created = files_data is not None and not _holds(files_data, path)
            if created and where.startswith(low + "."):
                return text
        return None

    found = [blamed(path) for path, _ in exc.errors]
    if found and all(found):  # every error comes from overrides: name them, not the files
        return ConfigError(exc.errors, ", ".join(dict.fromkeys(c for c in found if c)))
    errors = [
        (path, f"{reason} (from {culprit})" if culprit else reason)
        for (path, reason), culprit in zip(exc.errors, found, strict=True)
    ]
    return ConfigError(errors, exc.source)


def _files_data(files: Sequence[Path]) -> dict[str, Any] | None:
    """The files' composed mapping without any override (None when they cannot be read: the
    error is then the files' own)."""
    try:
        return compose(files, (), environ={})
    except (ConfigError, OSError):
        return None


def load_cli_config(
    files: Sequence[Path], overrides: Sequence[str], host: PluginHost, *, user_overrides: Sequence[str] = ()
) -> KvstrataConfig:
    """``kvstrata.load`` of ``files``, errors of ``user_overrides`` blamed on them (exit 2 on any error)."""
    try:
        return load(files, overrides=overrides, plugins=host)
    except ConfigError as exc:
        raise _fail(blame_overrides(exc, user_overrides, _files_data(files)), EXIT_INVALID) from None
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


def check_plot_format(path: Path | None, option: str = "--plot") -> None:
    """The plot's format comes from its suffix: refuse one matplotlib cannot write (exit 2)."""
    if path is None or not path.suffix:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise _fail(
            f"{option} {path}: matplotlib cannot write {path.suffix!r} files; use one of "
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


def backend_problem(instance: str, backend_config: BackendConfig, host: PluginHost) -> str | None:
    """What ``doctor`` checks per storage instance, also run by ``replay`` before its first
    request: the backend can work on this machine, and its probe (a directory written to, free
    space, a server answering) passes. ``None`` when it can be used."""
    try:
        cls = host.storage_backends.require(backend_config.type)
    except PluginError as exc:
        return str(exc)
    try:  # a plugin's check or probe must not crash the command
        reason = cls.unavailable_reason(backend_config)
    except Exception as exc:
        return f"unavailable_reason() raised {type(exc).__name__}: {exc}"
    if reason is None:
        try:
            reason = cls(instance, backend_config).probe()
        except Exception as exc:
            reason = f"probe failed: {exc!r}"
    return reason


def check_backends(config: KvstrataConfig, host: PluginHost) -> None:
    """Refuse (exit 2) a run whose storage backend cannot be used, with the cause and the
    setting to change, before anything is written: otherwise every L3 write fails, one by one."""
    for instance, backend_config in config.tiers.storage.items():
        reason = backend_problem(instance, backend_config, host)
        if reason is None:
            continue
        fields = backend_config.model_dump()
        named = [f for f, v in fields.items() if isinstance(v, Path) and str(v) in reason]
        hint = (
            f"; point tiers.storage.{instance}.{named[0]} at a directory you can write "
            f"(--set tiers.storage.{instance}.{named[0]}=DIR)"
            if named
            else "; `kvstrata doctor` checks it, `--set 'tiers.storage={}'` runs without an L3"
        )
        raise _fail(
            f"tiers.storage.{instance} ({backend_config.type}) cannot be used: {reason}{hint}", EXIT_INVALID
        )


#: Stack the no-argument ``replay`` runs: a copy of examples/configs/hybrid-mamba.yaml shipped
#: inside the package (so a non-editable install has it); its L3 moves to a temporary directory.
DEFAULT_CONFIG = "hybrid-mamba.yaml"


def default_config_path() -> Path:
    """The packaged default stack (``kvstrata/replay/data/hybrid-mamba.yaml``)."""
    from importlib import resources

    return Path(str(resources.files("kvstrata.replay") / "data" / DEFAULT_CONFIG))


def config_paths(files: Sequence[Path] | None, option: Sequence[Path] | None) -> list[Path]:
    """The config files of a command: positional ones (where the command takes them) then
    ``-c/--config`` ones; none given: the packaged default stack, said on stderr."""
    paths = [*(files or []), *(option or [])]
    if paths:
        return paths
    err.print(
        "no config given (-c FILE): using the packaged default stack, a copy of "
        "examples/configs/hybrid-mamba.yaml",
        highlight=False,
        markup=False,
    )
    return [default_config_path()]


def without_password(value: str) -> str:
    """``value`` as printed: a URL's password (``redis://user:secret@host``) replaced by ``***``,
    since what the CLI prints lands in terminals and CI logs."""
    try:
        parts = urlsplit(value)
        password = parts.password
    except ValueError:  # not a URL (a bracket in a path, a port that is no number)
        return value
    if password is None:
        return value
    userinfo, host = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def without_passwords(data: Any) -> tuple[Any, int]:
    """``data`` (a config dump) with every URL's password masked, and how many were."""
    if isinstance(data, dict):
        masked = [(key, without_passwords(value)) for key, value in data.items()]
        return {key: value for key, (value, _) in masked}, sum(n for _, (_, n) in masked)
    if isinstance(data, list):
        items = [without_passwords(value) for value in data]
        return [value for value, _ in items], sum(n for _, n in items)
    if isinstance(data, str) and "://" in data:
        shown = without_password(data)
        return shown, int(shown != data)
    return data, 0
