"""Errors raised while finding, loading and validating plugins.

Every message names what the user can act on: the distribution that shipped a broken plugin,
the exact ``pip install`` command for a missing extra, the installed names for an unknown type.
"""

from __future__ import annotations

import re


class KvstrataError(Exception):
    """Base of every error kvstrata raises on purpose."""


class PluginError(KvstrataError):
    """A plugin could not be found, loaded or validated."""


#: What a plugin name may be (the registries refuse any other; the error below names no package then).
NAME_PATTERN = re.compile(r"^[a-z0-9_]+$")


class UnknownPluginError(PluginError):
    """A config names a ``type`` that no installed plugin provides."""

    def __init__(self, kind: str, name: str, installed: list[str]) -> None:
        self.kind, self.name, self.installed = kind, name, installed
        listing = ", ".join(sorted(installed)) or "none"
        if NAME_PATTERN.fullmatch(name):
            fix = (
                f"Install the package that provides it (e.g. `pip install kvstrata-{name}`) or run "
                "`kvstrata plugins` to see what is loaded."
            )
        else:  # no package is named after '' or '[1,2': a pip command would mislead
            fix = "A plugin name is lower-case letters, digits and '_'."
        super().__init__(f"unknown {kind} {name!r}; installed: {listing}. {fix}")


class PluginLoadError(PluginError):
    """The plugin's module failed to import or its class breaks the plugin contract."""

    def __init__(
        self, kind: str, name: str, distribution: str | None, version: str | None, reason: str
    ) -> None:
        self.kind, self.name, self.distribution, self.version, self.reason = (
            kind,
            name,
            distribution,
            version,
            reason,
        )
        origin = " ".join(filter(None, (distribution, version))) or "an unknown distribution"
        #: the module whose absence made the import fail, when that was the cause
        self.missing_module: str | None = None
        #: whether importing it failed (a reinstall may mend that; a broken contract it cannot)
        self.import_failed = False
        super().__init__(f"{kind} {name!r} from {origin} failed to load: {reason}")


class PluginCollisionError(PluginError):
    """Two plugins claim the same name: refuse rather than let install order decide."""

    def __init__(
        self,
        kind: str,
        name: str,
        first: str,
        second: str,
        distributions: tuple[str, str] | None = None,
        *,
        installed: str | None = None,
    ) -> None:
        self.kind, self.name, self.first, self.second = kind, name, first, second
        if distributions is None and installed is not None:
            # one registered in-process (a hook): only the installed entry point can be blocked,
            # by its distribution (a bare name blocks the in-process registration too)
            fix = (
                f"uninstall one, or block the installed one's entry with "
                f"KVSTRATA_DISABLED_PLUGINS={installed}:{name} (a bare {name!r} blocks both)"
            )
        elif distributions is None:  # both registered in-process: nothing installed to block
            fix = "register only one of them"
        else:  # block one distribution's entry only (``name`` alone would block both)
            one, other = distributions
            fix = (
                f"uninstall one, or keep one by blocking the other's entry: "
                f"KVSTRATA_DISABLED_PLUGINS={other}:{name} (keeps {one}'s) or "
                f"KVSTRATA_DISABLED_PLUGINS={one}:{name} (keeps {other}'s)"
            )
        super().__init__(f"{kind} name {name!r} is provided by both {first} and {second}; {fix}")


class PluginDisabledError(PluginError):
    """A config names a plugin that is installed but blocked by ``KVSTRATA_DISABLED_PLUGINS``."""

    def __init__(self, kind: str, name: str, origins: list[str], items: list[str]) -> None:
        self.kind, self.name = kind, name
        where = f" (installed from {', '.join(origins)})" if origins else ""
        listed = " and ".join(repr(item) for item in items)
        super().__init__(
            f"{kind} {name!r}{where} is disabled by KVSTRATA_DISABLED_PLUGINS; remove {listed} "
            "from that variable to use it"
        )


class MissingDependencyError(PluginError):
    """A selected plugin needs a module that is not installed; says which extra brings it."""

    def __init__(self, kind: str, name: str, module: str, install: str) -> None:
        self.kind, self.name, self.module, self.install = kind, name, module, install
        super().__init__(f"{kind} {name!r} needs module {module!r}: run `{install}`")


class ConfigError(KvstrataError):
    """A configuration value is invalid; ``errors`` holds (dotted path, reason) pairs."""

    def __init__(self, errors: list[tuple[str, str]], source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        lines = [f"{path or '<root>'}: {reason}" for path, reason in errors]
        where = f" in {source}" if source else ""
        # one error on one line (an engine's log shows it whole); several as an indented list
        sep = " " if len(lines) == 1 else "\n  "
        super().__init__(f"invalid configuration{where}:{sep}" + "\n  ".join(lines))


class PluginUnavailableError(PluginError):
    """A plugin loaded but reports it cannot work here (e.g. 3FS not mounted)."""


class StorageError(KvstrataError):
    """A storage operation failed; the caller turns this into a per-operation failure."""
