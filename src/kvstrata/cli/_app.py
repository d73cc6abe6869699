"""The typer application, its consoles, exit codes and the one ``error:`` line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from kvstrata import __version__

EXIT_RUNTIME = 1
EXIT_INVALID = 2
EXIT_CORRUPT = 3

app = typer.Typer(
    name="kvstrata",
    help="Hierarchical state cache for hybrid LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings reflow as paragraphs, never wrapped mid-sentence
)
config_app = typer.Typer(
    help="Compose, validate and inspect configurations.", no_args_is_help=True, rich_markup_mode="markdown"
)
app.add_typer(config_app, name="config")

out = Console()
err = Console(stderr=True, soft_wrap=True)

ConfigFiles = Annotated[
    list[Path] | None,
    typer.Argument(
        help="config files (YAML/TOML/JSON), later ones override earlier ones; the same as -c",
        show_default=False,
    ),
]
ConfigOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        help="a config file (YAML/TOML/JSON); repeat it for several, later ones override earlier ones "
        "(default: the packaged copy of examples/configs/hybrid-mamba.yaml)",
        show_default=False,
    ),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="override a field: dotted.path=value (value parsed as YAML)"),
]


#: the password of a URL (``redis://user:secret@host``), wherever a message quotes one
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)[^\s@/]+@")


def masked(text: str) -> str:
    """``text`` with every URL password shown as ``***``: an error quotes the value it refuses
    (``KVSTRATA_TIERS__STORAGE__L3__URL=redis://u:secret@host:port0``), and what the CLI prints
    lands in terminals and CI logs, where ``config show`` already masks them."""
    return _URL_PASSWORD.sub(r"\1***@", text)


def _fail(exc: BaseException | str, code: int) -> typer.Exit:
    """Print ``error: ...`` (the text escaped: ``kvstrata[mooncake]`` is not rich markup)."""
    err.print(f"[bold red]error:[/] {escape(masked(str(exc)))}", highlight=False, soft_wrap=True)
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
