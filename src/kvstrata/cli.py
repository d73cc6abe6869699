"""The ``kvstrata`` command line (typer + rich).

Exit codes (every command):

- 0: success;
- 1: runtime failure: requests or operations failed (``replay --tolerate-failures`` accepts
  failed ones), a backend or the machine cannot do what the config asks;
- 2: invalid input: a bad config (including one start-up would refuse), trace, option or output
  path, or an unknown plugin; always checked before any work starts, one ``error:`` line;
- 3: ``replay`` served corrupt data (``corrupt_pages_served`` > 0); never tolerated.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstrata import __version__
from kvstrata.core.config import (
    DEFAULT_MAX_REQUEST_TOKENS,
    ENV_NESTING,
    ENV_PREFIX,
    KvstrataConfig,
    anchor_instances,
    config_json_schema,
    load_config,
)
from kvstrata.plugins.errors import ConfigError, KvstrataError, PluginError
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.registry import PluginEntry, missing_requirements
from kvstrata.progress import progress

EXIT_RUNTIME = 1
EXIT_INVALID = 2
EXIT_CORRUPT = 3

app = typer.Typer(
    name="kvstrata",
    help="Hierarchical state cache for hybrid LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Compose, validate and inspect configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")

out = Console()
err = Console(stderr=True, soft_wrap=True)

ConfigFiles = Annotated[
    list[Path], typer.Argument(help="YAML/TOML/JSON files, later ones override earlier ones")
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="override a field: dotted.path=value (value parsed as YAML)"),
]


def _fail(exc: BaseException | str, code: int) -> typer.Exit:
    """Print ``error: ...`` (the text escaped: ``kvstrata[mooncake]`` is not rich markup)."""
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        print(f"kvstrata {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """Hierarchical state cache for hybrid LLM inference."""


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


def install_hint(distribution: str | None, missing_module: str | None) -> str | None:
    """What to run so a plugin that failed to import loads: its declared requirement for the
    missing module when the distribution names one, else a reinstall (which brings its
    dependencies back)."""
    if not distribution or distribution == "unknown distribution":
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
                missing_module = getattr(error, "missing_module", None)
                rows.append(
                    _row(
                        entry,
                        registry.kind,
                        "load error",
                        error=str(error),
                        install=install_hint(entry.provider, missing_module),
                    )
                )
                continue
            cls = registry.get(entry.name)
            row = _row(entry, registry.kind, "available")
            missing = missing_requirements(cls)
            if missing:
                row["missing"] = [{"module": m, "install": i} for m, i in missing]
                row.update(status="missing dependency", install=missing[0][1])
            else:
                reason = getattr(cls, "unavailable_reason", lambda: None)()
                if reason:
                    row.update(status="unavailable", error=reason)
            caps = getattr(cls, "capabilities", None)
            if caps is not None:
                row["capabilities"] = caps.model_dump(mode="json")
            rows.append(row)
        for entry in registry.blocked():
            rows.append(
                _row(
                    entry,
                    registry.kind,
                    "disabled",
                    error=f"named in KVSTRATA_DISABLED_PLUGINS; remove {entry.name!r} from it to load it",
                )
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
                "install": install_hint(failed.distribution, None),
                "missing": [],
                "capabilities": None,
            }
        )
    return rows


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
    table = Table(title="kvstrata plugins")
    for column in ("kind", "name", "distribution", "status", "details"):
        table.add_column(column)
    for row in rows:
        details = row["error"] or ""
        if row["missing"]:
            details = "; ".join(f"needs {m['module']}: {m['install']}" for m in row["missing"])
        elif row["install"]:
            details = f"{details}; fix: {row['install']}"
        elif row["capabilities"] and not row["error"]:
            caps = row["capabilities"]
            flags = [k for k, v in caps.items() if v is True]
            pools = f"pools: {', '.join(caps['pools'])}; " if "pools" in caps else ""
            details = pools + ", ".join(flags)
        dist = f"{row['distribution']} {row['version'] or ''}".strip()
        style = {"available": "green", "missing dependency": "yellow", "disabled": "dim"}.get(
            row["status"], "red"
        )
        table.add_row(row["kind"], row["name"], escape(dist), f"[{style}]{row['status']}[/]", escape(details))
    out.print(table)
    if not host.autoload:
        out.print("entry points not scanned: KVSTRATA_DISABLE_PLUGIN_AUTOLOAD is set", highlight=False)


@config_app.command("validate")
def config_validate(files: ConfigFiles, set_: SetOption = None) -> None:
    """Check that the composed configuration is valid and that start-up would accept it (one
    storage instance, a host tier under L3, device units for every pool ...); errors name the
    setting. Machine-specific checks (device present, memory, backend reachable) are `doctor`'s."""
    host = PluginHost()
    config = load_cli_config(files, set_ or [], host, user_overrides=set_ or [])
    check_stack(config, host, machine=False)
    pools = ", ".join(f"{k} ({v.type})" for k, v in config.model.pools.items())
    storage = ", ".join(f"{k} ({v.type})" for k, v in config.tiers.storage.items()) or "none"
    out.print(f"[green]valid[/]: model {config.model.name!r}; pools: {pools}; storage: {storage}")


@config_app.command("show")
def config_show(
    files: ConfigFiles,
    set_: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of YAML")] = False,
) -> None:
    """Print the resolved configuration, defaults included."""
    config = load_cli_config(files, set_ or [], PluginHost(), user_overrides=set_ or [])
    data = config.model_dump(mode="json")
    for line in capacity_rounding(config):
        err.print(f"note: {line}", markup=False, highlight=False)
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False), end="")


def capacity_rounding(config: KvstrataConfig) -> list[str]:
    """What each tier really holds when its ``capacity_tokens`` is not a whole number of pages
    (capacities round up to whole pages)."""
    page = config.model.page_size
    lines = []
    for tier in ("device", "host"):
        tokens = getattr(config.tiers, tier).capacity_tokens
        if tokens % page:
            pages = -(-tokens // page)
            lines.append(
                f"tiers.{tier}.capacity_tokens {tokens:,} is rounded up to whole pages: "
                f"{pages:,} pages of {page} = {pages * page:,} tokens"
            )
    return lines


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the root config (every installed plugin's config included)."""
    print(json.dumps(config_json_schema(PluginHost()), indent=2))


#: policies ``simulate --sweep`` compares when ``--policies`` is not given (those installed)
SWEEP_POLICIES = ("fifo", "lru", "arc", "s3fifo", "reuse", "learned", "belady")
#: capacities of ``simulate --sweep`` in million tokens
SWEEP_CAPACITIES_M = (0.5, 1, 2, 3, 4, 6, 8, 12)


def _eviction_setting(text: str) -> str | dict[str, Any]:
    """``--eviction``: a policy name, or a YAML mapping with ``type`` and options."""
    value = yaml.safe_load(text) if text.lstrip().startswith("{") else text
    if not isinstance(value, str | dict):
        raise ValueError(f"--eviction: expected a policy name or a mapping, got {text!r}")
    return value


@app.command()
def simulate(
    trace: Annotated[
        Path | None, typer.Argument(help="Mooncake-format JSONL trace (default: the bundled sample)")
    ] = None,
    capacity_tokens: Annotated[
        int | None, typer.Option("--capacity-tokens", help="cache size in tokens (default: unlimited)")
    ] = None,
    eviction: Annotated[
        str,
        typer.Option(
            "--eviction",
            help="eviction policy: a name (`kvstrata plugins`; `belady` is the offline optimum) or a "
            "YAML mapping such as '{type: s3fifo, small_fraction: 0.2}'",
        ),
    ] = "lru",
    block_size: Annotated[int, typer.Option("--block-size", help="tokens per trace hash block")] = 512,
    warmup_fraction: Annotated[
        float, typer.Option("--warmup-fraction", help="leading share of requests that only warm the cache")
    ] = 0.0,
    limit: Annotated[int | None, typer.Option("--limit", help="read only the first N requests")] = None,
    sweep_out: Annotated[
        Path | None,
        typer.Option("--sweep", help="plot hit rate against capacity for several policies into this PNG"),
    ] = None,
    policies: Annotated[
        str | None, typer.Option("--policies", help="--sweep: comma-separated policies (default: a set)")
    ] = None,
    capacities: Annotated[
        str | None,
        typer.Option("--capacities", help="--sweep: comma-separated capacities in million tokens"),
    ] = None,
    max_request_tokens: Annotated[
        int,
        typer.Option("--max-request-tokens", min=1, help="refuse a trace holding a longer request"),
    ] = DEFAULT_MAX_REQUEST_TOKENS,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Hit-rate simulation of a trace through the cache's prefix tree and an eviction policy
    (full blocks, token-weighted): the replay's reference and the bench for policies."""
    from pydantic import ValidationError

    from kvstrata.replay.simulate import SimulationConfig
    from kvstrata.replay.trace import TraceError, read_trace

    host = PluginHost()
    try:
        config = SimulationConfig(
            block_size=block_size,
            capacity_tokens=capacity_tokens,
            warmup_fraction=warmup_fraction,
            eviction=_eviction_setting(eviction),
        )
        _check_eviction(host, config.eviction)
        requests = read_trace(
            trace, limit=limit, block_size=block_size, max_request_tokens=max_request_tokens
        )
    except ValidationError as exc:
        reasons = "; ".join(
            f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors()
        )
        raise _fail(ValueError(reasons), EXIT_INVALID) from None
    except (TraceError, PluginError, ValueError) as exc:
        raise _fail(exc, EXIT_INVALID) from None
    if sweep_out is not None:
        _simulate_sweep(requests, host, sweep_out, policies, capacities, block_size, trace, as_json)
        return
    _simulate_one(requests, host, config, trace, as_json)


def _check_eviction(host: PluginHost, setting: str | dict[str, Any]) -> None:
    """Validate ``--eviction`` now: an unknown name lists the installed policies, a bad option
    is named as ``--eviction.<option>``."""
    from pydantic import ValidationError

    from kvstrata.core.policies import policy_config

    try:
        policy_config(host, setting)
    except ValidationError as exc:
        reasons = "; ".join(f"--eviction.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(reasons) from None


def _simulate_one(
    requests: list[Any], host: PluginHost, config: Any, trace: Path | None, as_json: bool
) -> None:
    from kvstrata.replay.simulate import simulate as run_simulation

    with progress(err, "simulated", len(requests), quiet=as_json) as update:
        result = run_simulation(requests, config, progress=lambda n: update(n, len(requests)), host=host)
    if as_json:
        print(result.model_dump_json(indent=2, exclude={"per_request_hits", "per_request_tokens"}))
        return
    capacity = f"{config.capacity_tokens:,} tokens" if config.capacity_tokens is not None else "unlimited"
    table = Table(title=f"simulate {trace or 'bundled sample trace'}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("cache", capacity)
    table.add_row("eviction policy", result.eviction)
    table.add_row("block size", f"{config.block_size}")
    table.add_row("requests", f"{result.requests:,}")
    table.add_row("warm-up requests", f"{result.warmup_requests:,}")
    table.add_row("measured input tokens", f"{result.tokens:,}")
    table.add_row("hit tokens (full blocks)", f"{result.hit_tokens:,}")
    table.add_row("unique / evicted blocks", f"{result.unique_blocks:,} / {result.evicted_blocks:,}")
    table.add_row("[bold]hit rate[/]", f"[bold]{result.hit_rate:.2%}[/]")
    out.print(table)


def _simulate_sweep(
    requests: list[Any],
    host: PluginHost,
    png: Path,
    policies: str | None,
    capacities: str | None,
    block_size: int,
    trace: Path | None,
    as_json: bool,
) -> None:
    import importlib.util

    from kvstrata.replay.report import PLOT_INSTALL
    from kvstrata.replay.simulate import plot_sweep, sweep

    if importlib.util.find_spec("matplotlib") is None:
        raise _fail(ValueError(f"--sweep needs matplotlib: run `{PLOT_INSTALL}`"), EXIT_INVALID)
    installed = host.eviction_policies.names()
    names = (
        [p.strip() for p in policies.split(",") if p.strip()]
        if policies
        else [p for p in SWEEP_POLICIES if p in installed]
    )
    try:
        sizes = [int(float(c) * 1e6) for c in capacities.split(",")] if capacities else None
    except ValueError:
        raise _fail(
            ValueError(f"--capacities: expected numbers (million tokens), got {capacities!r}"), 2
        ) from None
    sizes = sizes or [int(c * 1e6) for c in SWEEP_CAPACITIES_M]
    try:
        rates = sweep(requests, names, sizes, block_size=block_size, host=host)
    except PluginError as exc:
        raise _fail(exc, EXIT_INVALID) from None
    plot_sweep(rates, sizes, png, title=f"hit rate vs capacity: {trace or 'bundled sample trace'}")
    if as_json:
        print(json.dumps({"capacities_tokens": sizes, "hit_rate": rates}, indent=2))
        return
    table = Table(title=f"hit rate by capacity (million tokens): {trace or 'bundled sample trace'}")
    table.add_column("policy")
    for size in sizes:
        table.add_column(f"{size / 1e6:g}M", justify="right")
    for name, values in rates.items():
        table.add_row(name, *(f"{v:.2%}" for v in values))
    out.print(table)
    err.print(f"plot written to {png}", highlight=False)


def build_pool_specs(config: Any, host: PluginHost) -> dict[str, Any]:
    """PoolSpecs of the configured stack (instantiates the selected pool types only)."""
    from kvstrata.plugins.pool_type import ModelContext

    anchor = anchor_instances(config.model.pools, host)[0]  # validation guarantees exactly one
    context = ModelContext(page_size=config.model.page_size, anchor=anchor)
    return {
        name: host.pool_types.require(pool.type)(name, pool, context).spec()
        for name, pool in config.model.pools.items()
    }


@app.command()
def doctor(files: ConfigFiles, set_: SetOption = None) -> None:
    """Check a configuration against this machine: I/O plan per (backend, pool), host memory
    budget, backend reachability. Exits 2 for a config start-up refuses, 1 when something on this
    machine cannot work as configured."""
    from kvstrata.core.io_plan import IOMode, plan_backend
    from kvstrata.core.pool_group import host_memory_budget

    host = PluginHost()
    config = load_cli_config(files, set_ or [], host, user_overrides=set_ or [])
    check_stack(config, host, machine=True)
    try:
        specs = build_pool_specs(config, host)
    except (ConfigError, PluginError) as exc:
        raise _fail(exc, EXIT_INVALID) from None
    problems: list[str] = []

    plan_table = Table(title="I/O plan per (backend, pool)")
    for column in ("backend", "pool", "type", "mode", "object bytes", "reason"):
        plan_table.add_column(column)
    reach_table = Table(title="backends")
    for column in ("backend", "type", "status", "details"):
        reach_table.add_column(column)
    for instance, backend_config in config.tiers.storage.items():
        try:
            cls = host.storage_backends.require(backend_config.type)
        except PluginError as exc:
            reach_table.add_row(instance, backend_config.type, "[red]missing[/]", str(exc))
            problems.append(f"backend {instance!r}: {exc}")
            continue
        backend = cls(instance, backend_config)
        caps = backend.instance_capabilities()
        plans = plan_backend(instance, caps, specs.values(), parallel=config.parallel)
        for name, plan in plans.items():
            style = {IOMode.ZERO_COPY: "green", IOMode.COPY: "yellow"}.get(plan.mode, "red")
            sizes = ", ".join(f"{k}={v}" for k, v in plan.object_bytes.items())
            plan_table.add_row(instance, name, plan.pool_type, f"[{style}]{plan.mode}[/]", sizes, plan.reason)
            if plan.mode is IOMode.OFF:
                problems.append(f"pool {name!r} cannot be stored on backend {instance!r}: {plan.reason}")
        reason = cls.unavailable_reason(backend_config)
        if reason is None:
            try:
                reason = backend.probe()
            except Exception as exc:  # a probe must not crash the doctor
                reason = f"probe failed: {exc!r}"
        if reason is None:
            reach_table.add_row(instance, backend_config.type, "[green]reachable[/]", "")
        else:
            reach_table.add_row(instance, backend_config.type, "[red]unavailable[/]", reason)
            problems.append(f"backend {instance!r} ({backend_config.type}): {reason}")
    if config.tiers.storage:
        out.print(plan_table)
        out.print(reach_table)
    else:
        out.print("no storage tier configured (tiers.storage is empty)")

    # Host budget: every pool holds capacity_tokens / page_size units in the host tier.
    host_tier = config.tiers.host
    units = host_tier.capacity_tokens // config.model.page_size
    required = sum(spec.bytes_per_unit * units for spec in specs.values())
    available = host_memory_budget(host_tier)
    verdict = "[green]fits[/]" if required <= available else "[red]does not fit[/]"
    out.print(
        f"host budget: {units} units per pool need {required / 2**30:.3f} GiB per rank; "
        f"available {available / 2**30:.3f} GiB per rank "
        f"(available memory - reserve_bytes, / ranks_per_host {host_tier.ranks_per_host}): {verdict}"
    )
    if required > available:
        problems.append(f"host tier needs {required} bytes per rank, {available} available")
    if problems:
        for problem in problems:
            err.print(f"[bold red]problem:[/] {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_RUNTIME)
    out.print("[green]ok[/]: every pool can be stored as configured")


#: Stack the no-argument ``replay`` runs: a copy of examples/configs/hybrid-mamba.yaml shipped
#: inside the package (so a non-editable install has it); its L3 moves to a temporary directory.
DEFAULT_CONFIG = "hybrid-mamba.yaml"


def default_config_path() -> Path:
    """The packaged default stack (``kvstrata/replay/data/hybrid-mamba.yaml``)."""
    from importlib import resources

    return Path(str(resources.files("kvstrata.replay") / "data" / DEFAULT_CONFIG))


def _human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_storage(config: KvstrataConfig) -> list[str]:
    """One line per storage instance: where its objects live and how much it may keep."""
    lines = []
    for instance, backend in config.tiers.storage.items():
        fields = backend.model_dump(mode="json")
        where = next((str(fields[k]) for k in ("path", "url", "master") if fields.get(k)), "")
        text = f"L3 {instance} ({backend.type})" + (f": {where}" if where else "")
        if "capacity_bytes" in fields:
            cap = fields["capacity_bytes"]
            text += (
                f", capped at {_human_bytes(cap)}"
                if cap
                else f", NO size cap (set tiers.storage.{instance}.capacity_bytes)"
            )
        lines.append(text)
    return lines


@app.command()
def replay(
    trace: Annotated[
        Path | None, typer.Argument(help="Mooncake-format JSONL trace (default: the bundled sample)")
    ] = None,
    config_files: Annotated[
        list[Path] | None,
        typer.Option(
            "--config",
            "-c",
            help="config file(s), later override earlier (default: the packaged copy of "
            "examples/configs/hybrid-mamba.yaml, file L3 in a temporary directory)",
        ),
    ] = None,
    set_: SetOption = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="replay only the first N requests")
    ] = None,
    warmup_fraction: Annotated[
        float,
        typer.Option("--warmup-fraction", help="leading share of requests that only warm the cache [0, 1)"),
    ] = 0.0,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="write the result (fixed keys) as JSON to this file")
    ] = None,
    plot_out: Annotated[
        Path | None, typer.Option("--plot", help="draw hit rate per tier over the trace to this PNG")
    ] = None,
    tolerate_failures: Annotated[
        bool,
        typer.Option(
            "--tolerate-failures",
            help="exit 0 although requests or operations failed (an L3 outage you expect); "
            "served corruption still exits 3",
        ),
    ] = False,
) -> None:
    """Replay a request trace through the real tiers and backend, verifying every restored byte;
    prints per-tier hit rates, bytes moved, throughput, latencies, failures and corruption.
    Exits 1 when requests or operations failed (a summary names them) unless --tolerate-failures,
    3 when corrupt pages were served, 2 on bad input (checked before the run)."""
    import importlib.util
    import shutil
    import tempfile

    from kvstrata.replay.report import (
        PLOT_INSTALL,
        plot_hit_rates,
        render_summary,
    )
    from kvstrata.replay.simulate import SimulationConfig, simulate
    from kvstrata.replay.trace import TraceError, read_trace

    if not 0.0 <= warmup_fraction < 1.0:
        raise _fail(f"--warmup-fraction must be in [0, 1), got {warmup_fraction}", EXIT_INVALID)
    if plot_out is not None and importlib.util.find_spec("matplotlib") is None:
        raise _fail(f"--plot needs matplotlib: run `{PLOT_INSTALL}`", EXIT_INVALID)
    check_output_path("--json", json_out)
    check_output_path("--plot", plot_out)
    check_plot_format(plot_out)
    host = PluginHost()
    scratch: Path | None = None
    try:
        files = list(config_files or [])
        user_overrides = list(set_ or [])
        overrides = list(user_overrides)
        if not files:
            scratch = Path(tempfile.mkdtemp(prefix="kvstrata-replay-l3-"))
            files = [default_config_path()]
            overrides = [f"tiers.storage.l3.path={scratch}", *overrides]
        config = load_cli_config(files, overrides, host, user_overrides=user_overrides)
        check_stack(config, host, machine=True)
        try:
            requests = read_trace(trace, limit=limit, max_request_tokens=config.model.max_request_tokens)
        except TraceError as exc:
            raise _fail(exc, EXIT_INVALID) from None
        baseline = simulate(requests, SimulationConfig(warmup_fraction=warmup_fraction)).hit_rate
        storage = ", ".join(f"{k} ({v.type})" for k, v in config.tiers.storage.items()) or "none"
        err.print(
            f"replaying {len(requests):,} requests of {trace or 'the bundled sample trace'} on "
            f"{', '.join(map(str, files))} (model {config.model.name!r}, page {config.model.page_size}, "
            f"storage: {storage})",
            highlight=False,
            markup=False,
        )
        for line in describe_storage(config):
            err.print(
                line + (" (temporary, removed afterwards)" if scratch else ""), highlight=False, markup=False
            )
        longest = max((r.input_length for r in requests), default=0)
        if longest > config.tiers.device.capacity_tokens:
            err.print(
                f"warning: tiers.device.capacity_tokens={config.tiers.device.capacity_tokens:,} is "
                f"smaller than the longest request of the trace ({longest:,} tokens): requests "
                "longer than the device tier will fail",
                style="bold yellow",
                highlight=False,
                markup=False,
            )
        result, details = _run_quietly(
            config,
            host,
            requests,
            warmup_fraction=warmup_fraction,
            baseline_hit_rate=baseline,
            baseline_label="reference simulator (unlimited LRU, blocks)",
        )
        render_summary(result, details, out)
        if json_out is not None:
            try:
                json_out.write_text(result.to_json() + "\n")
            except OSError as exc:
                raise _fail(
                    f"cannot write --json {json_out}: {describe_os_error(exc)}", EXIT_RUNTIME
                ) from None
        if plot_out is not None:
            try:
                plot_hit_rates(details, plot_out, title=f"kvstrata replay: {trace or 'bundled sample trace'}")
            except OSError as exc:
                raise _fail(
                    f"cannot write --plot {plot_out}: {describe_os_error(exc)}", EXIT_RUNTIME
                ) from None
            err.print(f"plot written to {plot_out}", highlight=False, markup=False)
        _finish_replay(result, details, config, tolerate_failures)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_quietly(config: KvstrataConfig, host: PluginHost, requests: Any, **options: Any) -> tuple[Any, Any]:
    """The replay itself, with repeated warnings (Python's and native libraries') collapsed into
    counts per interval, and a summary of what was held back; errors mapped to exit codes."""
    from kvstrata.replay.driver import run_replay_detailed
    from kvstrata.replay.noise import native_line_limiter, repeated_warnings_limited

    with native_line_limiter(), repeated_warnings_limited(sys.stderr) as limiter:
        try:
            with progress(err, "replayed", len(requests)) as update:
                return run_replay_detailed(config, host, requests, progress=update, **options)
        except OSError as exc:
            raise _fail(describe_os_error(exc, config), EXIT_RUNTIME) from None
        except ValueError as exc:  # a stack the controller refuses to build (e.g. L3 without L2)
            raise _fail(exc, EXIT_INVALID) from None
        except (KvstrataError, MemoryError, RuntimeError) as exc:
            raise _fail(exc, EXIT_RUNTIME) from None
        finally:
            for line in limiter.summary():
                err.print(f"warnings: {line}", highlight=False, markup=False)


def _finish_replay(result: Any, details: Any, config: KvstrataConfig, tolerate_failures: bool) -> None:
    """The replay's verdict in loud lines and its exit code: corruption first (3, never
    tolerated), then failed requests and operations (1 unless tolerated)."""
    from kvstrata.replay.report import (
        corruption_sentence,
        failed_operations_sentence,
        failed_requests_sentence,
    )

    failures = []
    if details.failed_requests:
        failures.append(failed_requests_sentence(result, details, config.tiers.device.capacity_tokens))
    operations = failed_operations_sentence(result, details)
    if operations:
        failures.append(operations)
    corrupt = corruption_sentence(result)
    if tolerate_failures:
        for sentence in failures:
            err.print(f"[bold yellow]tolerated (--tolerate-failures):[/] {escape(sentence)}", highlight=False)
    elif failures and not corrupt:
        for sentence in failures[:-1]:
            err.print(f"[bold red]error:[/] {escape(sentence)}", highlight=False)
        raise _fail(failures[-1] + "; pass --tolerate-failures to accept failures", EXIT_RUNTIME)
    else:
        for sentence in failures:
            err.print(f"[bold red]error:[/] {escape(sentence)}", highlight=False)
    if corrupt:
        raise _fail(corrupt, EXIT_CORRUPT)


def main() -> None:
    """Console-script entry point: maps kvstrata errors to exit codes instead of tracebacks."""
    try:
        app()
    except (ConfigError, PluginError) as exc:
        _fail(exc, EXIT_INVALID)
        sys.exit(EXIT_INVALID)
    except KvstrataError as exc:
        _fail(exc, EXIT_RUNTIME)
        sys.exit(EXIT_RUNTIME)
