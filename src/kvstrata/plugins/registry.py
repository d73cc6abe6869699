"""One registry per plugin concept: names from entry points, classes loaded lazily by name.

``names()`` never imports a plugin. ``get(name)`` imports the entry point discovery read (one
distribution's, never another's of the same name), validates the class contract and caches it.
Entry points are read through ``importlib.metadata``, which keeps the distribution name and
version that error messages must show; stevedore's per-group cache is dropped at each discovery.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from stevedore.extension import ExtensionManager

from kvstrata.plugins.errors import (
    NAME_PATTERN,
    MissingDependencyError,
    PluginCollisionError,
    PluginDisabledError,
    PluginError,
    PluginLoadError,
    UnknownPluginError,
)

T = TypeVar("T")

#: The environment variable whose items block plugins: ``name`` (every distribution's entry of
#: that name) or ``distribution:name`` (one distribution's entry only, e.g. after a collision).
DISABLED_ENV = "KVSTRATA_DISABLED_PLUGINS"


def normalize_distribution(name: str) -> str:
    """Distribution names compare as pip compares them: case and ``-``/``_``/``.`` runs alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def disabled_item(disabled: Iterable[str], name: str, provider: str) -> str | None:
    """The item of ``KVSTRATA_DISABLED_PLUGINS`` that blocks ``name`` from ``provider``, if any."""
    dist = normalize_distribution(provider)
    for item in disabled:
        if item == name:
            return item
        owner, sep, plugin = item.rpartition(":")
        if sep and plugin == name and normalize_distribution(owner) == dist:
            return item
    return None


@dataclass(frozen=True)
class PluginEntry:
    """Where a named plugin comes from, known without importing it."""

    kind: str
    name: str
    source: Literal["entry_point", "in_process"]
    provider: str  # distribution name, or the module that registered it in-process
    version: str | None
    target: str  # "module:attribute"

    @property
    def origin(self) -> str:
        return f"{self.provider} {self.version}" if self.version else self.provider


#: the provider of an entry point whose distribution importlib.metadata does not know
UNKNOWN_DISTRIBUTION = "unknown distribution"

#: (name, version) per distribution object of one entry-point scan: reading either parses the
#: distribution's METADATA file (~1.5 ms for one that embeds a long README)
DistributionNames = dict[importlib.metadata.Distribution, tuple[str, str | None]]


def distribution_of(ep: importlib.metadata.EntryPoint, about: DistributionNames) -> tuple[str, str | None]:
    """(name, version) of the distribution declaring ``ep``, memoised in ``about``."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return UNKNOWN_DISTRIBUTION, None
    known = about.get(dist)
    if known is None:
        try:
            metadata = dist.metadata  # parsed on every read of ``dist.name`` or ``dist.version``
            name, version = metadata["Name"], metadata["Version"]
        except Exception:  # (an unreadable METADATA file: the entry still loads, its origin unknown)
            name, version = None, None
        # a half-installed package (METADATA not yet or no longer written) names no one
        known = about[dist] = (name or UNKNOWN_DISTRIBUTION, version if name else None)
    return known


def installed_entry_points() -> tuple[importlib.metadata.EntryPoints, list[str]]:
    """Every installed distribution's entry points, as ``importlib.metadata.entry_points()``
    finds them (the first distribution of a name on ``sys.path``), and one line per distribution
    whose ``entry_points.txt`` cannot be parsed: ``entry_points()`` raises for that one package
    (an interrupted install, a hand-edited line), which would stop every plugin -- and every
    command, ``kvstrata plugins`` too -- instead of that package's."""
    points: list[importlib.metadata.EntryPoint] = []
    broken: list[str] = []
    seen: set[str] = set()
    for dist in importlib.metadata.distributions():
        # the name importlib itself deduplicates by (from the folder's name: no METADATA read)
        key = getattr(dist, "_normalized_name", None)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        try:
            points.extend(dist.entry_points)
        except Exception as exc:
            where = getattr(dist, "_path", None) or key or "a distribution"
            broken.append(f"{where}: cannot read its entry points ({type(exc).__name__}: {exc})")
    return importlib.metadata.EntryPoints(points), broken


def literal_type_name(config_cls: type) -> str | None:
    """The single value of a config model's ``type: Literal[...]`` field, if it has one."""
    field = getattr(config_cls, "model_fields", {}).get("type")
    if field is None or typing.get_origin(field.annotation) is not Literal:
        return None
    args = typing.get_args(field.annotation)
    return args[0] if len(args) == 1 else None


def missing_requirements(cls: type) -> list[tuple[str, str]]:
    """``(module, install command)`` for each module in ``cls.requires`` that cannot be found.
    A dotted module's parents are imported to find it: one that raises at import (any error: a
    half-upgraded package) makes the module missing, never a traceback out of ``kvstrata
    plugins`` for every plugin or out of ``open`` instead of the install command."""
    missing = []
    for module, install in getattr(cls, "requires", {}).items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (Exception, SystemExit):
            found = False
        if not found:
            missing.append((module, install))
    return missing


class Registry(Generic[T]):
    """Named plugin classes of one kind (``pool type`` or ``storage backend``)."""

    def __init__(
        self,
        kind: str,
        group: str,
        validate: Callable[[str, type], None],
        *,
        disabled: Iterable[str] = (),
    ) -> None:
        self.kind = kind
        self.group = group
        self._validate = validate
        self._disabled = set(disabled)
        self._entries: dict[str, list[PluginEntry]] = {}
        self._loaded: dict[str, type[T]] = {}
        self._errors: dict[str, PluginError] = {}
        self._blocked: list[PluginEntry] = []
        #: the entry points discovery read, by (name, distribution, target): what ``get`` loads
        self._points: dict[tuple[str, str, str], importlib.metadata.EntryPoint] = {}

    # --- discovery ---------------------------------------------------------------------------

    def discover(
        self,
        points: Iterable[importlib.metadata.EntryPoint] | None = None,
        distributions: DistributionNames | None = None,
    ) -> None:
        """Read entry points of this group (no imports). ``points``: this group's entry points
        from a scan the caller made (a :class:`~kvstrata.plugins.host.PluginHost` reads every
        installed distribution once for all its registries); None: scan now. ``distributions``:
        the names and versions of that scan's distributions read so far, shared by the caller's
        registries (each read parses a METADATA file). Safe to call again after installs."""
        # stevedore caches entry points per group for the whole process; a distribution added
        # after the cache was filled (a test's fake dist-info, a runtime pip install) would stay
        # invisible, so drop this group's cached copy before a fresh scan.
        ExtensionManager.ENTRY_POINT_CACHE.pop(self.group, None)
        if points is None:
            points = installed_entry_points()[0].select(group=self.group)
        seen: set[tuple[str, str, str]] = set()
        self._blocked = []
        self._points = {}
        self._errors = {}  # what failed to load may load now (its missing module installed since)
        about = {} if distributions is None else distributions
        for ep in points:
            provider, version = distribution_of(ep, about)
            key = (ep.name, provider, ep.value)
            if key in seen:  # same dist seen twice on sys.path
                continue
            seen.add(key)
            entry = PluginEntry(self.kind, ep.name, "entry_point", provider, version, ep.value)
            if disabled_item(self._disabled, ep.name, provider) is not None:
                self._blocked.append(entry)  # listed as disabled, never loaded
                continue
            self._points[key] = ep
            self._add(entry)

    def _add(self, entry: PluginEntry) -> None:
        existing = self._entries.setdefault(entry.name, [])
        if not any(e.origin == entry.origin and e.target == entry.target for e in existing):
            existing.append(entry)

    def register(self, cls: type[T], provider: str | None = None) -> None:
        """Add a class in-process (applications, tests): same validation as entry points."""
        name = getattr(cls, "name", None)
        if not isinstance(name, str):
            raise PluginLoadError(self.kind, repr(cls), provider, None, "class has no `name`")
        if name in self._disabled:
            return
        provider = provider or f"in-process module {cls.__module__}"
        entry = PluginEntry(
            self.kind, name, "in_process", provider, None, f"{cls.__module__}:{cls.__qualname__}"
        )
        others = [e for e in self._entries.get(name, []) if e.target != entry.target]
        if others:
            other = others[0]
            installed = other.provider if other.source == "entry_point" else None
            raise PluginCollisionError(self.kind, name, other.origin, entry.origin, installed=installed)
        try:
            self._validate(name, cls)
        except ValueError as exc:
            raise PluginLoadError(self.kind, name, provider, None, str(exc)) from exc
        self._entries[name] = [entry]
        self._loaded[name] = cls

    # --- queries -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[PluginEntry]:
        return [e for name in self.names() for e in self._entries[name]]

    def blocked(self) -> list[PluginEntry]:
        """Installed entry points skipped because their name is disabled (never imported)."""
        return list(self._blocked)

    def entry(self, name: str) -> PluginEntry:
        found = self._entries.get(name)
        if not found:
            blocked = [e for e in self._blocked if e.name == name]
            if blocked or name in self._disabled:
                items = [disabled_item(self._disabled, name, e.provider) or name for e in blocked] or [name]
                raise PluginDisabledError(self.kind, name, [e.origin for e in blocked], sorted(set(items)))
            raise UnknownPluginError(self.kind, name, self.names())
        if len(found) > 1:
            raise PluginCollisionError(
                self.kind, name, found[0].origin, found[1].origin, (found[0].provider, found[1].provider)
            )
        return found[0]

    def get(self, name: str) -> type[T]:
        """Import, validate and cache the named class; errors name the distribution."""
        if name in self._loaded:
            return self._loaded[name]
        if name in self._errors:
            raise self._errors[name]
        entry = self.entry(name)
        try:
            cls = self._load(entry)
            self._validate(name, cls)
        except PluginLoadError as exc:
            self._errors[name] = exc
            raise
        except (Exception, SystemExit) as exc:  # (a plugin calling sys.exit at import)
            error = PluginLoadError(self.kind, name, entry.provider, entry.version, str(exc))
            self._errors[name] = error
            raise error from exc
        self._loaded[name] = cls
        return cls

    def _load(self, entry: PluginEntry) -> type[T]:
        """Import exactly this entry (its distribution's target): loading by name alone would
        find every distribution's entry of that name, including one the user blocked."""
        try:
            cls = self._entry_point(entry).load()
        except (Exception, SystemExit) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            error = PluginLoadError(self.kind, entry.name, entry.provider, entry.version, reason)
            error.import_failed = True
            if isinstance(exc, ModuleNotFoundError):
                error.missing_module = exc.name
            raise error from exc
        return cls

    def _entry_point(self, entry: PluginEntry) -> importlib.metadata.EntryPoint:
        found = self._points.get((entry.name, entry.provider, entry.target))
        if found is not None:  # the one discovery read: no second scan of every distribution
            return found
        about: DistributionNames = {}
        for ep in installed_entry_points()[0].select(group=self.group, name=entry.name):
            if ep.value == entry.target and distribution_of(ep, about)[0] == entry.provider:
                return ep
        raise LookupError(
            f"entry point {entry.name} = {entry.target} of {entry.origin} is no longer installed"
        )

    def load_error(self, name: str) -> PluginError | None:
        """The error ``get(name)`` raises, or ``None``: for listings that must not stop."""
        try:
            self.get(name)
        except PluginError as exc:
            return exc
        return None

    def require(self, name: str) -> type[T]:
        """``get`` plus a check that the plugin's own dependencies are importable."""
        cls = self.get(name)
        missing = missing_requirements(cls)
        if missing:
            module, install = missing[0]
            raise MissingDependencyError(self.kind, name, module, install)
        return cls


def check_name(kind: str, entry_name: str, cls: type) -> None:
    """Shared part of the class contract: ``cls.name`` is valid and equals the entry-point name."""
    name = getattr(cls, "name", None)
    if name != entry_name:
        raise ValueError(f"class {cls.__qualname__} has name {name!r}, entry point says {entry_name!r}")
    if not NAME_PATTERN.match(entry_name):
        raise ValueError(f"{kind} names are lowercase [a-z0-9_]+, got {entry_name!r}")
    requires = getattr(cls, "requires", {})
    if not isinstance(requires, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in requires.items()
    ):
        raise ValueError(
            f"{cls.__qualname__}.requires must map module names to install commands "
            f"({{'mooncake': \"pip install 'kvstrata[mooncake]'\"}}), got {requires!r}"
        )
    config = getattr(cls, "Config", None)
    if literal_type_name(config) != entry_name:
        raise ValueError(
            f"{cls.__qualname__}.Config must be a pydantic model with `type: Literal[{entry_name!r}]`"
        )
