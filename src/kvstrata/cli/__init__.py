"""The ``kvstrata`` command line (typer + rich).

Exit codes (every command):

- 0: success;
- 1: runtime failure: requests or operations failed (``replay --tolerate-failures`` accepts
  failed ones), a backend failed, ``doctor`` found host memory short or a backend unusable, an
  output could not be written;
- 2: invalid input: a bad config (including one start-up refuses on this machine: a device that
  is not there, an unusable L3), trace, option or output path, or an unknown plugin; always
  checked before any work starts, one ``error:`` line;
- 3: ``replay`` served corrupt data (``corrupt_pages_served`` > 0); never tolerated;
- 130: interrupted (Ctrl-C); ``replay`` first reports the requests it replayed;
- 143: ``replay`` terminated (SIGTERM), its temporary L3 directory removed first; any command
  terminated while writing its plot (``replay --plot``, ``simulate --sweep``), the plot's
  temporary file removed first.

A reader that closes the pipe early (``| head -1``) changes none of these: what it no longer
reads is dropped without a word and the command exits with its own code.
"""

from __future__ import annotations

import signal
import sys
from contextlib import suppress

from kvstrata.cli import config_cmd, doctor_cmd, plugins_cmd, replay_cmd, simulate_cmd  # noqa: F401 (registers)
from kvstrata.cli._app import EXIT_CORRUPT, EXIT_INVALID, EXIT_RUNTIME, _fail, app, err, out
from kvstrata.cli._checks import (
    DEFAULT_CONFIG,
    blame_overrides,
    check_output_path,
    check_plot_format,
    check_stack,
    default_config_path,
    describe_os_error,
    load_cli_config,
)
from kvstrata.cli.doctor_cmd import build_pool_specs
from kvstrata.cli.interrupt import exit_on_interrupt
from kvstrata.cli.pipes import reader_gone_quiet
from kvstrata.cli.plugins_cmd import install_hint, plugin_rows
from kvstrata.cli.replay_cmd import describe_storage
from kvstrata.plugins.errors import ConfigError, KvstrataError, PluginError

__all__ = [
    "DEFAULT_CONFIG",
    "EXIT_CORRUPT",
    "EXIT_INVALID",
    "EXIT_RUNTIME",
    "app",
    "blame_overrides",
    "build_pool_specs",
    "check_output_path",
    "check_plot_format",
    "check_stack",
    "default_config_path",
    "describe_os_error",
    "describe_storage",
    "err",
    "install_hint",
    "load_cli_config",
    "main",
    "out",
    "plugin_rows",
]


def main() -> None:
    """Console-script entry point: maps kvstrata errors to exit codes instead of tracebacks, and
    a Ctrl-C to one line and exit 130 (``replay`` installs its own, gentler handler), and a
    pipe's reader that stopped reading to nothing at all (``cli/pipes.py``)."""
    previous = None
    with suppress(ValueError):  # ValueError: not the main thread (an embedding application)
        previous = signal.signal(signal.SIGINT, exit_on_interrupt)
    try:
        with reader_gone_quiet():
            _run()
    finally:
        if previous is not None:  # main() called in-process (tests) leaves the handler as it was
            signal.signal(signal.SIGINT, previous)


def _run() -> None:
    try:
        app()
    except (ConfigError, PluginError) as exc:
        _fail(exc, EXIT_INVALID)
        sys.exit(EXIT_INVALID)
    except KvstrataError as exc:
        _fail(exc, EXIT_RUNTIME)
        sys.exit(EXIT_RUNTIME)
