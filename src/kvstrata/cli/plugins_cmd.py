"""``kvstrata plugins``: every installed plugin, its status, the reason and the fix."""

from __future__ import annotations

import importlib.metadata
import json
import re
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from kvstrata.cli._app import (
    app,
    out,
)
from kvstrata.plugins.errors import PluginLoadError
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.registry import UNKNOWN_DISTRIBUTION, PluginEntry, disabled_item, missing_requirements


def install_hint(distribution: str | None, missing_module: str | None) -> str | None:
    """What to run so a plugin that failed to import loads: its declared requirement for the
    missing module when the distribution names one, else a reinstall (which brings its
    dependencies back)."""
    if not distribution or distribution == UNKNOWN_DISTRIBUTION:
        return None
    if missing_module:
        top = missing_module.split(".")[0].lower().replace("_", "-")
        try:
            requirements = importlib.metadata.requires(distribution) or []
        except importlib.metadata.PackageNotFoundError:
            requirements = []
        for requirement in requirements:
            if ";" in requirement:
                continue  # extras and markers: not what a plain install needs
            name = re.split(r"[\s<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            if name == top:
                return f"pip install '{requirement}'"
    return f"pip install --force-reinstall '{distribution}'"


def _row(entry: PluginEntry, kind: str, status: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kind": kind,
        "name": entry.name,
        "distribution": entry.provider,
        "version": entry.version,
        "source": entry.source,
        "status": status,
        "error": None,
        "install": None,
        "missing": [],
        "capabilities": None,
    }
    row.update(fields)
    return row


def plugin_rows(host: PluginHost) -> list[dict[str, Any]]:
    """Everything ``kvstrata plugins`` shows: each installed plugin with its status (available,
    missing dependency, unavailable, load error, disabled), the reason and what to install."""
    rows: list[dict[str, Any]] = []
    for registry in (host.pool_types, host.storage_backends, host.eviction_policies):
        for entry in registry.entries():
            error = registry.load_error(entry.name)
            if error is not None:
                # a reinstall may mend a failed import, never a collision (the error names the
                # fix) or a class that breaks the contract (the plugin's authors must)
                failed_import = isinstance(error, PluginLoadError) and error.import_failed
                fix = install_hint(entry.provider, error.missing_module) if failed_import else None
                rows.append(_row(entry, registry.kind, "load error", error=str(error), install=fix))
                continue
            cls = registry.get(entry.name)
            row = _row(entry, registry.kind, "available")
            missing = missing_requirements(cls)
            if missing:
                row["missing"] = [{"module": m, "install": i} for m, i in missing]
                row.update(status="missing dependency", install=missing[0][1])
            else:
                try:
                    reason = getattr(cls, "unavailable_reason", lambda: None)()
                except Exception as exc:  # a plugin's bug: listed, the others still are
                    reason = f"unavailable_reason() raised {type(exc).__name__}: {exc}"
                if reason:
                    row.update(status="unavailable", error=str(reason))
            caps = getattr(cls, "capabilities", None)
            if caps is not None:
                row["capabilities"] = caps.model_dump(mode="json")
            rows.append(row)
        for entry in registry.blocked():
            item = disabled_item(host.disabled, entry.name, entry.provider) or entry.name
            rows.append(
                _row(
                    entry,
                    registry.kind,
                    "disabled",
                    error=f"disabled by KVSTRATA_DISABLED_PLUGINS; remove {item!r} from it to load it",
                )
            )
    for problem in host.distribution_errors:
        rows.append(
            {
                "kind": "package",
                "name": problem.partition(": ")[0],
                "distribution": None,
                "version": None,
                "source": "entry_point",
                "status": "load error",
                "error": problem.partition(": ")[2] + "; reinstall or remove that package",
                "install": None,
                "missing": [],
                "capabilities": None,
            }
        )
    for name, (distribution, version) in host.hook_plugins.items():  # (listed only when it failed)
        plugin = host.pm.get_plugin(name)
        hooks = sorted(caller.name for caller in host.pm.get_hookcallers(plugin) or [])
        rows.append(
            {
                "kind": "hook plugin",
                "name": name,
                "distribution": distribution,
                "version": version,
                "source": "entry_point",
                "status": "available",
                "error": None,
                "install": None,
                "missing": [],
                "capabilities": None,
                "hooks": hooks,
            }
        )
    for failed in host.hook_plugin_errors:
        rows.append(
            {
                "kind": "hook plugin",
                "name": failed.name,
                "distribution": failed.distribution,
                "version": failed.version,
                "source": "entry_point",
                "status": "load error",
                "error": failed.error,
                "install": install_hint(failed.distribution, None) if failed.import_failed else None,
                "missing": [],
                "capabilities": None,
            }
        )
    return rows


def _details(row: dict[str, Any]) -> str:
    """The reason and the fix of a plugin that cannot be used, else its capabilities."""
    details = row["error"] or ""
    if row["missing"]:
        return "; ".join(f"needs {m['module']}: {m['install']}" for m in row["missing"])
    if row["install"]:
        return f"{details}; fix: {row['install']}"
    if row.get("hooks"):
        return "hooks: " + ", ".join(row["hooks"])
    if row["capabilities"] and not row["error"]:
        caps = row["capabilities"]
        flags = [k for k, v in caps.items() if v is True]
        pools = f"pools: {', '.join(caps['pools'])}; " if "pools" in caps else ""
        return pools + ", ".join(flags)
    return details


@app.command()
def plugins(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """List installed pool types, storage backends and eviction policies: status, capabilities,
    and for a plugin that cannot be used the reason and what to install."""
    host = PluginHost()
    rows = plugin_rows(host)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    lines = [(row, _details(row)) for row in rows]
    if not out.is_terminal:  # a pipe or a CI log: one full line per plugin, never cut to a width
        for row, details in lines:
            dist = f"{row['distribution']} {row['version'] or ''}".strip()
            print(
                f"{row['kind']} {row['name']} ({dist}): {row['status']}" + (f": {details}" if details else "")
            )
    else:
        table = Table(title="kvstrata plugins")
        for column in ("kind", "name", "distribution", "status"):
            table.add_column(column)
        table.add_column("details", overflow="fold")  # folded, never an ellipsis
        for row, details in lines:
            dist = f"{row['distribution']} {row['version'] or ''}".strip()
            style = {"available": "green", "missing dependency": "yellow", "disabled": "dim"}.get(
                row["status"], "red"
            )
            table.add_row(
                escape(row["kind"]),
                escape(row["name"]),
                escape(dist),
                f"[{style}]{row['status']}[/]",
                escape(details),
            )
        out.print(table)
    if not host.autoload:
        out.print("entry points not scanned: KVSTRATA_DISABLE_PLUGIN_AUTOLOAD is set", highlight=False)
