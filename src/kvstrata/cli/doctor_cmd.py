"""``kvstrata doctor``: a configuration against this machine."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from kvstrata.cli._app import (
    EXIT_INVALID,
    EXIT_RUNTIME,
    ConfigFiles,
    ConfigOption,
    SetOption,
    _fail,
    app,
    err,
    masked,
    out,
)
from kvstrata.cli._checks import backend_problem, check_stack, config_paths, load_cli_config
from kvstrata.core.config import (
    anchor_instances,
)
from kvstrata.plugins.errors import ConfigError, PluginError
from kvstrata.plugins.host import PluginHost


def build_pool_specs(config: Any, host: PluginHost) -> dict[str, Any]:
    """PoolSpecs of the configured stack (instantiates the selected pool types only)."""
    from kvstrata.plugins.pool_type import ModelContext

    anchor = anchor_instances(config.model.pools, host)[0]  # validation guarantees exactly one
    context = ModelContext(page_size=config.model.page_size, anchor=anchor)
    return {
        name: host.pool_types.require(pool.type)(name, pool, context).spec()
        for name, pool in config.model.pools.items()
    }


#: Binary units ``human_size`` names, from GiB (what a host budget is counted in) up.
_UNITS = ("GiB", "TiB", "PiB", "EiB")


def human_size(n: int) -> str:
    """Bytes in the largest binary unit from GiB to EiB that keeps the number readable; beyond
    EiB (a capacity no machine has, e.g. a typo in ``capacity_tokens``) the bytes in scientific
    notation, instead of a 20-digit figure of GiB."""
    value = n / 2**30
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    if value >= 1024:
        return f"{n:.3e} bytes"
    return f"{value:.3f} {unit}"


@app.command()
def doctor(files: ConfigFiles = None, config_option: ConfigOption = None, set_: SetOption = None) -> None:
    """Check a configuration against this machine: I/O plan per (backend, pool), host memory
    budget, backend reachability. Exits 2 for a config start-up refuses, 1 when something on this
    machine cannot work as configured."""
    import torch

    from kvstrata.core.builder import startup_host_bytes
    from kvstrata.core.io_plan import IOMode, plan_backend
    from kvstrata.core.pool_group import host_memory_budget

    host = PluginHost()
    paths = config_paths(files, config_option)
    config = load_cli_config(paths, set_ or [], host, user_overrides=set_ or [])
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
        who = (escape(instance), escape(backend_config.type))  # user and plugin text, never markup
        try:
            cls = host.storage_backends.require(backend_config.type)
        except PluginError as exc:
            reach_table.add_row(*who, "[red]missing[/]", escape(masked(str(exc))))
            problems.append(f"backend {instance!r}: {exc}")
            continue
        try:  # a third-party plugin's bug is this backend's problem, not a traceback
            caps = cls(instance, backend_config).instance_capabilities()
        except Exception as exc:
            broken = f"{type(exc).__name__}: {exc}"
            reach_table.add_row(*who, "[red]broken[/]", escape(masked(broken)))
            problems.append(f"backend {instance!r} ({backend_config.type}): {broken}")
            continue
        plans = plan_backend(instance, caps, specs.values(), parallel=config.parallel)
        for name, plan in plans.items():
            style = {IOMode.ZERO_COPY: "green", IOMode.COPY: "yellow"}.get(plan.mode, "red")
            sizes = ", ".join(f"{k}={v}" for k, v in plan.object_bytes.items())
            plan_table.add_row(
                *map(escape, (instance, name, plan.pool_type)),
                f"[{style}]{plan.mode}[/]",
                escape(sizes),
                escape(plan.reason),
            )
            if plan.mode is IOMode.OFF:
                problems.append(f"pool {name!r} cannot be stored on backend {instance!r}: {plan.reason}")
        reason = backend_problem(instance, backend_config, host)
        if reason is None:
            reach_table.add_row(*who, "[green]reachable[/]", "")
        else:
            reach_table.add_row(*who, "[red]unavailable[/]", escape(masked(reason)))
            problems.append(f"backend {instance!r} ({backend_config.type}): {reason}")
    if config.tiers.storage:
        if plan_table.row_count:
            out.print(plan_table)
        else:  # an empty table with its headers read as "nothing to plan", not "nothing usable"
            out.print(
                "I/O plan: none, no storage backend could be set up (see the backends below)",
                soft_wrap=True,
                highlight=False,
            )
        out.print(reach_table)
    else:
        out.print("no storage tier configured (tiers.storage is empty)")

    # Host budget: what start-up checks (the host tier, and the device tier when it is on the CPU)
    host_tier = config.tiers.host
    required = startup_host_bytes(config, host)
    available = host_memory_budget(host_tier)
    verdict = "[green]fits[/]" if required <= available else "[red]does not fit[/]"
    device_on_host = torch.device(config.tiers.device.device).type == "cpu"
    tiers = "host and device tiers (the device tier is on the CPU)" if device_on_host else "host tier"
    out.print(
        f"host budget: the pools' {tiers} need {human_size(required)} per rank; "
        f"available {human_size(available)} per rank "
        f"(available memory - reserve_bytes, / ranks_per_host {host_tier.ranks_per_host}): {verdict}",
        soft_wrap=True,  # one line, as the ``problem:`` lines are, never cut at 80 columns in a log
    )
    if required > available:
        problems.append(f"the pools' {tiers} need {required:,} bytes per rank, {available:,} available")
    if problems:
        for problem in problems:
            err.print(f"[bold red]problem:[/] {escape(masked(problem))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_RUNTIME)
    out.print("[green]ok[/]: every pool can be stored as configured")
