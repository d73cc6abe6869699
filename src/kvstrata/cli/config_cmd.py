"""``kvstrata config validate | show | schema``."""

from __future__ import annotations

import json
from typing import Annotated

import typer
import yaml
from rich.markup import escape

from kvstrata.cli._app import (
    ConfigFiles,
    ConfigOption,
    SetOption,
    config_app,
    err,
    out,
)
from kvstrata.cli._checks import check_stack, config_paths, load_cli_config, without_passwords
from kvstrata.core.config import (
    KvstrataConfig,
    config_json_schema,
)
from kvstrata.plugins.host import PluginHost


@config_app.command("validate")
def config_validate(
    files: ConfigFiles = None, config_option: ConfigOption = None, set_: SetOption = None
) -> None:
    """Check that the composed configuration is valid and that start-up would accept it (one
    storage instance, a host tier under L3, device units for every pool ...); errors name the
    setting. Machine-specific checks (device present, memory, backend reachable) are `doctor`'s."""
    host = PluginHost()
    paths = config_paths(files, config_option)
    config = load_cli_config(paths, set_ or [], host, user_overrides=set_ or [])
    check_stack(config, host, machine=False)
    pools = ", ".join(f"{k} ({v.type})" for k, v in config.model.pools.items())
    storage = ", ".join(f"{k} ({v.type})" for k, v in config.tiers.storage.items()) or "none"
    summary = f"model {config.model.name!r}; pools: {pools}; storage: {storage}"  # user text, not markup
    # one line however long (the file wraps it, not rich at 80 columns): a CI log greps it
    out.print(f"[green]valid[/]: {escape(summary)}", highlight=False, soft_wrap=True)


@config_app.command("show")
def config_show(
    files: ConfigFiles = None,
    config_option: ConfigOption = None,
    set_: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of YAML")] = False,
    reveal_secrets: Annotated[
        bool, typer.Option("--reveal-secrets", help="print URL passwords (masked as *** by default)")
    ] = False,
) -> None:
    """Print the resolved configuration, defaults included (URL passwords masked)."""
    paths = config_paths(files, config_option)
    config = load_cli_config(paths, set_ or [], PluginHost(), user_overrides=set_ or [])
    data, masked = config.model_dump(mode="json"), 0
    if not reveal_secrets:  # what it prints lands in terminals and CI logs, as replay's lines do
        data, masked = without_passwords(data)
    for line in capacity_rounding(config):
        err.print(f"note: {line}", markup=False, highlight=False)
    if masked:
        note = f"note: {masked} URL password(s) shown as ***; --reveal-secrets prints them"
        err.print(note, markup=False, highlight=False)
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
