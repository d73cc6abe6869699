"""``kvstrata replay``: a trace through the real tiers, every restored byte verified."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from kvstrata.cli._app import (
    EXIT_CORRUPT,
    EXIT_INVALID,
    EXIT_RUNTIME,
    SetOption,
    _fail,
    app,
    err,
    out,
)
from kvstrata.cli._checks import (
    check_backends,
    check_output_path,
    check_plot_format,
    check_stack,
    default_config_path,
    describe_os_error,
    load_cli_config,
    without_password,
)
from kvstrata.cli.interrupt import sigint_handled, writing_output
from kvstrata.core.config import (
    KvstrataConfig,
)
from kvstrata.plugins.errors import KvstrataError
from kvstrata.plugins.host import PluginHost
from kvstrata.progress import progress


def _human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_storage(config: KvstrataConfig, host: PluginHost | None = None) -> list[str]:
    """One line per storage instance: where its objects live, how much it may keep and (from
    the backend's own ``where()``, when ``host`` is given) how long they last."""
    lines = []
    for instance, backend in config.tiers.storage.items():
        fields = backend.model_dump(mode="json")
        where = next((str(fields[k]) for k in ("path", "url", "master") if fields.get(k)), "")
        where = without_password(where)
        text = f"L3 {instance} ({backend.type})" + (f": {where}" if where else "")
        if "capacity_bytes" in fields:
            cap = fields["capacity_bytes"]
            text += (
                f", capped at {_human_bytes(cap)}"
                if cap
                else f", NO size cap (set tiers.storage.{instance}.capacity_bytes)"
            )
        told = None
        if host is not None:
            try:
                told = host.storage_backends.require(backend.type)(instance, backend).where()
            except (KvstrataError, ValueError):
                told = None  # start-up reports an unusable backend itself
        lines.append(text + (f"; {told}" if told else ""))
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
            help="a config file; repeat it for several, later ones override earlier ones (default: the "
            "packaged copy of examples/configs/hybrid-mamba.yaml, file L3 in a temporary directory)",
            show_default=False,
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
        Path | None,
        typer.Option(
            "--plot",
            help="draw hit rate per tier over the trace to this file, in the format its suffix names "
            "(.png, .svg, .pdf: any matplotlib writes)",
        ),
    ] = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="replay against an empty L3 (a temporary directory for path-based backends, a "
            "namespace of its own for the others), so nothing an earlier run wrote is served",
        ),
    ] = False,
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
    with sigint_handled() as interrupt:
        try:
            files = list(config_files or [])
            user_overrides = list(set_ or [])
            overrides = list(user_overrides)
            if not files:
                scratch = Path(tempfile.mkdtemp(prefix="kvstrata-replay-l3-"))
                files = [default_config_path()]
                overrides = [f"tiers.storage.l3.path={scratch}", *overrides]
            config = load_cli_config(files, overrides, host, user_overrides=user_overrides)
            if fresh and config.tiers.storage:
                scratch = scratch or Path(tempfile.mkdtemp(prefix="kvstrata-replay-l3-"))
                overrides += fresh_overrides(config, scratch)
                config = load_cli_config(files, overrides, host, user_overrides=user_overrides)
            interrupt.scratch = scratch  # removed by a second Ctrl-C's exit at once, too
            check_stack(config, host, machine=True)
            check_backends(config, host)
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
            # the scratch directory, unless a --set pointed the L3 elsewhere (the user's, kept)
            temporary = scratch is not None and str(scratch) in config.tiers.model_dump_json()
            for line in describe_storage(config, host):
                err.print(
                    line + (" (empty, temporary, removed afterwards)" if temporary else ""),
                    highlight=False,
                    markup=False,
                )
            # a request holds its whole pages on the device; the tier is whole pages, rounded up
            longest, page = max((r.input_length for r in requests), default=0), config.model.page_size
            if longest // page > -(-config.tiers.device.capacity_tokens // page):
                err.print(
                    f"warning: tiers.device.capacity_tokens={config.tiers.device.capacity_tokens:,} is "
                    f"smaller than the longest request of the trace ({longest:,} tokens, "
                    f"{longest // page:,} whole pages of {page}): requests longer than the device tier "
                    "will fail",
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
                stop=interrupt,
            )
            # an interrupted run reports what it replayed too (table, --json, --plot), then exits 130
            render_summary(result, details, out)
            if json_out is not None:
                try:
                    json_out.write_text(result.to_json() + "\n")
                except OSError as exc:
                    raise _fail(
                        f"cannot write --json {json_out}: {describe_os_error(exc)}", EXIT_RUNTIME
                    ) from None
            if plot_out is not None and not details.timeline_tokens:  # stopped in the warm-up
                err.print(
                    f"--plot {plot_out}: not drawn, no request was measured", highlight=False, markup=False
                )
            elif plot_out is not None:
                try:
                    with writing_output("--plot", plot_out):
                        plot_hit_rates(
                            details, plot_out, title=f"kvstrata replay: {trace or 'bundled sample trace'}"
                        )
                except OSError as exc:
                    raise _fail(
                        f"cannot write --plot {plot_out}: {describe_os_error(exc)}", EXIT_RUNTIME
                    ) from None
                err.print(f"plot written to {plot_out}", highlight=False, markup=False)
            if details.interrupted_after is not None:
                _interrupted(result, details, len(requests))
            _finish_replay(result, details, config, tolerate_failures)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)


def fresh_overrides(config: KvstrataConfig, scratch: Path) -> list[str]:
    """``--fresh``: each storage instance with a path gets a directory under ``scratch``; with
    any other backend, the model's namespace gets a suffix no earlier run used."""
    import uuid

    overrides = []
    for instance, backend in config.tiers.storage.items():
        fields = backend.model_dump()
        paths = [name for name, value in fields.items() if isinstance(value, Path)]
        if paths:
            overrides += [f"tiers.storage.{instance}.{name}={scratch / instance}" for name in paths]
        else:
            overrides.append(f"model.name={config.model.name}-fresh-{uuid.uuid4().hex[:12]}")
    return overrides


def _run_quietly(config: KvstrataConfig, host: PluginHost, requests: Any, **options: Any) -> tuple[Any, Any]:
    """The replay itself, with repeated warnings (Python's and native libraries') collapsed into
    counts per interval, and a summary of what was held back; errors mapped to exit codes."""
    from kvstrata.replay.driver import run_replay_detailed
    from kvstrata.replay.noise import native_line_limiter, repeated_warnings_limited

    with native_line_limiter(), repeated_warnings_limited(sys.stderr) as limiter:
        try:
            options["stop"].running = True  # from here on a Ctrl-C stops between requests
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


def _interrupted(result: Any, details: Any, total: int) -> None:
    """The line a Ctrl-C adds after the report of what was replayed (exit 130); served
    corruption still exits 3."""
    from kvstrata.cli.interrupt import EXIT_INTERRUPTED
    from kvstrata.replay.report import corruption_sentence

    err.print(
        f"interrupted after {details.interrupted_after:,} of {total:,} requests; "
        f"L3 writes flushed: {details.writes_flushed_on_stop:,} batches in flight, abandoned: 0",
        highlight=False,
        markup=False,
    )
    corrupt = corruption_sentence(result)
    if corrupt:
        raise _fail(corrupt, EXIT_CORRUPT)
    raise typer.Exit(EXIT_INTERRUPTED)


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
