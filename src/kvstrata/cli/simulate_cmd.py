"""``kvstrata simulate``: the reference hit-rate simulation and policy sweeps."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from kvstrata.cli._app import (
    EXIT_INVALID,
    EXIT_RUNTIME,
    _fail,
    app,
    err,
    out,
)
from kvstrata.cli._checks import check_output_path, check_plot_format, describe_os_error
from kvstrata.cli.interrupt import writing_output
from kvstrata.core.config import (
    DEFAULT_MAX_REQUEST_TOKENS,
)
from kvstrata.plugins.errors import PluginError
from kvstrata.plugins.host import PluginHost
from kvstrata.progress import progress

if TYPE_CHECKING:
    from kvstrata.replay.simulate import SimulationConfig

#: policies ``simulate --sweep`` compares when ``--policies`` is not given (those installed)
SWEEP_POLICIES = ("fifo", "lru", "arc", "s3fifo", "reuse", "learned", "belady")
#: capacities of ``simulate --sweep`` in million tokens
SWEEP_CAPACITIES_M = (0.5, 1, 2, 3, 4, 6, 8, 12)


def _eviction_setting(text: str) -> str | dict[str, Any]:
    """``--eviction``: a policy name, or a YAML mapping with ``type`` and options."""
    try:
        value = yaml.safe_load(text) if text.lstrip().startswith("{") else text
    except yaml.YAMLError as exc:  # a brace left open: one error line, not a parser traceback
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"--eviction: cannot parse {text!r} as a YAML mapping ({problem})") from None
    if not isinstance(value, str | dict):
        raise ValueError(f"--eviction: expected a policy name or a mapping, got {text!r}")
    glued = [k for k, v in value.items() if v is None and ":" in str(k)] if isinstance(value, dict) else []
    if glued:  # YAML reads ``{type:s3fifo}`` as the key 'type:s3fifo' without a value
        raise ValueError(
            f"--eviction: YAML needs a space after ':' ({glued[0]!r} is read as one key without a "
            "value); write '{type: s3fifo, small_fraction: 0.2}'"
        )
    return value


@app.command()
def simulate(
    trace: Annotated[
        Path | None, typer.Argument(help="Mooncake-format JSONL trace (default: the bundled sample)")
    ] = None,
    capacity_tokens: Annotated[
        int | None,
        typer.Option(
            "--capacity-tokens", help="cache size in tokens, rounded up to whole blocks (default: unlimited)"
        ),
    ] = None,
    eviction: Annotated[
        str | None,
        typer.Option(
            "--eviction",
            help="eviction policy (default lru): a name (`kvstrata plugins`; `belady` is the offline "
            "reference) or a YAML mapping such as '{type: s3fifo, small_fraction: 0.2}'",
        ),
    ] = None,
    block_size: Annotated[int, typer.Option("--block-size", help="tokens per trace hash block")] = 512,
    warmup_fraction: Annotated[
        float, typer.Option("--warmup-fraction", help="leading share of requests that only warm the cache")
    ] = 0.0,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="read only the first N requests")
    ] = None,
    sweep_out: Annotated[
        Path | None,
        typer.Option(
            "--sweep",
            help="plot hit rate against capacity for several policies to this file, in the format "
            "its suffix names (.png, .svg, .pdf: any matplotlib writes)",
        ),
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

    for option, value in (("--capacities", capacities), ("--policies", policies)):
        if value is not None and sweep_out is None:  # once ignored without a word
            raise _fail(
                f"{option} applies to a sweep only: add --sweep FILE.png (one simulation takes "
                "--capacity-tokens and --eviction)",
                EXIT_INVALID,
            )
    for option, value in (("--capacity-tokens", capacity_tokens), ("--eviction", eviction)):
        if value is not None and sweep_out is not None:  # the converse: a sweep ignored them
            raise _fail(
                f"{option} applies to one simulation only: a sweep takes --capacities and --policies",
                EXIT_INVALID,
            )
    host = PluginHost()
    sizes = _sweep_sizes(sweep_out, capacities) if sweep_out is not None else None  # before any work
    try:
        names = _sweep_policies(host, policies) if sweep_out is not None else []
        config = SimulationConfig(
            block_size=block_size,
            capacity_tokens=capacity_tokens,
            warmup_fraction=warmup_fraction,
            eviction=_eviction_setting(eviction or "lru"),
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
    if sweep_out is not None and sizes is not None:
        _simulate_sweep(requests, host, sweep_out, names, sizes, config, trace, as_json)
        return
    _simulate_one(requests, host, config, trace, as_json)


def _sweep_policies(host: PluginHost, policies: str | None) -> list[str]:
    """``--policies`` of a sweep, each checked before any work (an unknown name failed only
    after the sweep of the names before it had run); the default set is what is installed."""
    if policies is None:
        installed = host.eviction_policies.names()
        return [p for p in SWEEP_POLICIES if p in installed]
    names = list(dict.fromkeys(p.strip() for p in policies.split(",") if p.strip()))
    if not names:
        raise ValueError(f"--policies: no policy named in {policies!r} (comma-separated names)")
    for name in names:
        _check_eviction(host, name)
    return names


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
    table = Table(title=escape(f"simulate {trace or 'bundled sample trace'}"), show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("cache", capacity)
    table.add_row("eviction policy", escape(result.eviction))
    table.add_row("block size", f"{config.block_size}")
    table.add_row("requests", f"{result.requests:,}")
    table.add_row("warm-up requests", f"{result.warmup_requests:,}")
    table.add_row("measured input tokens", f"{result.tokens:,}")
    table.add_row("hit tokens (full blocks)", f"{result.hit_tokens:,}")
    table.add_row("unique / evicted blocks", f"{result.unique_blocks:,} / {result.evicted_blocks:,}")
    table.add_row("refused requests (more new blocks than the cache holds)", f"{result.refused_requests:,}")
    table.add_row("[bold]hit rate[/]", f"[bold]{result.hit_rate:.2%}[/]")
    out.print(table)


def _sweep_sizes(png: Path, capacities: str | None) -> list[int]:
    """What ``--sweep`` needs, checked before the trace is read: matplotlib, a plot file it can
    write, and capacities that are positive numbers (tokens per point of the sweep)."""
    import importlib.util

    from kvstrata.replay.report import PLOT_INSTALL

    if importlib.util.find_spec("matplotlib") is None:
        raise _fail(ValueError(f"--sweep needs matplotlib: run `{PLOT_INSTALL}`"), EXIT_INVALID)
    check_output_path("--sweep", png)
    check_plot_format(png, "--sweep")
    if not capacities:
        return [int(c * 1e6) for c in SWEEP_CAPACITIES_M]
    try:
        values = [float(c) for c in capacities.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v * 1e6 >= 1 for v in values):
        raise _fail(
            ValueError(f"--capacities: expected positive numbers (million tokens), got {capacities!r}"),
            EXIT_INVALID,
        )
    return [int(v * 1e6) for v in values]


def _simulate_sweep(
    requests: list[Any],
    host: PluginHost,
    png: Path,
    names: list[str],
    sizes: list[int],
    config: SimulationConfig,
    trace: Path | None,
    as_json: bool,
) -> None:
    from kvstrata.replay.simulate import plot_sweep, sweep

    verb = f"sweep of {len(names)} policies x {len(sizes)} capacities: simulated"
    try:  # progress on stderr (a live bar on a terminal), as one simulation and replay show it
        with progress(err, verb, len(names) * len(sizes) * len(requests), quiet=as_json) as update:
            rates = sweep(
                requests,
                names,
                sizes,
                block_size=config.block_size,
                host=host,
                warmup_fraction=config.warmup_fraction,
                progress=update,
            )
    except PluginError as exc:
        raise _fail(exc, EXIT_INVALID) from None
    # the numbers first: a plot that cannot be written (its directory removed, a full disk)
    # must not lose a sweep that may have taken minutes
    if as_json:
        print(json.dumps({"capacities_tokens": sizes, "hit_rate": rates}, indent=2))
    else:
        title = f"hit rate by capacity (million tokens): {trace or 'bundled sample trace'}"
        table = Table(title=escape(title))
        table.add_column("policy")
        for size in sizes:
            table.add_column(f"{size / 1e6:g}M", justify="right")
        for name, values in rates.items():
            table.add_row(escape(name), *(f"{v:.2%}" for v in values))
        out.print(table)
    try:
        with writing_output("--sweep", png):
            plot_sweep(rates, sizes, png, title=f"hit rate vs capacity: {trace or 'bundled sample trace'}")
    except OSError as exc:
        raise _fail(f"cannot write --sweep {png}: {describe_os_error(exc)}", EXIT_RUNTIME) from None
    err.print(f"plot written to {png}", highlight=False, markup=False)
