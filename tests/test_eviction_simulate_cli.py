"""``kvstrata simulate --eviction / --sweep``: one policy, the offline optimum, a sweep plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.cli import app
from kvstrata.replay.simulate import SimulationConfig, simulate
from kvstrata.replay.trace import read_trace

runner = CliRunner()


def test_simulate_with_a_named_policy_and_options() -> None:
    ok = runner.invoke(
        app, ["simulate", "--limit", "100", "--capacity-tokens", "200000", "--eviction", "s3fifo", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    expected = simulate(read_trace(limit=100), SimulationConfig(capacity_tokens=200_000, eviction="s3fifo"))
    assert data["eviction"] == "s3fifo" and data["hit_rate"] == expected.hit_rate
    mapped = runner.invoke(
        app,
        [
            *["simulate", "--limit", "100", "--capacity-tokens", "200000", "--json", "--eviction"],
            "{type: s3fifo, small_fraction: 0.5}",
        ],
    )
    assert mapped.exit_code == 0, mapped.output
    assert json.loads(mapped.stdout)["config"]["eviction"] == {"type": "s3fifo", "small_fraction": 0.5}


def test_belady_is_the_offline_reference() -> None:
    rates = {}
    for name in ("lru", "belady"):
        out = runner.invoke(app, ["simulate", "--capacity-tokens", "300000", "--eviction", name, "--json"])
        assert out.exit_code == 0, out.output
        rates[name] = json.loads(out.stdout)["hit_rate"]
    assert rates["belady"] > rates["lru"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--eviction", "lur"], "installed: arc, belady"),
        (["--eviction", "{type: arc, speed: 1}"], "--eviction.speed"),
        # was "an eviction policy needs a `type`": YAML read the key 'type:s3fifo', no value
        (["--eviction", "{type:s3fifo,small_fraction:0.2}"], "YAML needs a space after ':' ('type:s3fifo'"),
        (["--sweep", "x.png", "--capacities", "a,b"], "--capacities"),
        (["--sweep", "x.png", "--policies", "lru,nope"], "unknown eviction policy 'nope'"),
        # checked before the sweep runs (they ran it whole, then failed with a traceback)
        (["--sweep", "x.png", "--capacities", "-1"], "--capacities: expected positive numbers"),
        (["--limit", "-1"], "Invalid value for '--limit'"),  # was "bad trace None: limit must be"
        (["--sweep", "x.png", "--capacities", "inf"], "--capacities: expected positive numbers"),
        (["--sweep", "x.xyz"], "matplotlib cannot write '.xyz' files"),
        (["--sweep", "missing/x.png"], "does not exist"),
    ],
)
def test_bad_input_is_a_one_line_error(args: list[str], message: str, tmp_path: Path) -> None:
    args = [str(tmp_path / a) if a.endswith((".png", ".xyz")) else a for a in args]
    out = runner.invoke(app, ["simulate", "--limit", "20", *args])
    assert out.exit_code == 2 and message in out.output
    assert "Traceback" not in out.output


def test_sweep_plots_every_policy_against_capacity(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    out = runner.invoke(
        app,
        [
            "simulate",
            "--limit",
            "150",
            "--sweep",
            str(png),
            *["--policies", "lru,reuse,belady", "--capacities", "0.1,0.3,1", "--json"],
        ],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["capacities_tokens"] == [100_000, 300_000, 1_000_000]
    assert list(data["hit_rate"]) == ["lru", "reuse", "belady"]
    for rates in data["hit_rate"].values():
        assert rates == sorted(rates)  # more room never hurts on this sample
    belady, lru, reuse = (data["hit_rate"][p] for p in ("belady", "lru", "reuse"))
    assert all(b >= max(x, y) for b, x, y in zip(belady, lru, reuse, strict=True))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("setting", ["{type: s3fifo", "{"])
def test_an_eviction_mapping_that_does_not_parse_is_a_one_line_error(setting: str) -> None:
    """A brace left open was a yaml ParserError traceback (exit 1)."""
    out = runner.invoke(app, ["simulate", "--limit", "5", "--eviction", setting])
    assert out.exit_code == 2, out.output
    assert "--eviction: cannot parse" in out.output and "Traceback" not in out.output


def test_a_sweep_applies_the_warm_up_and_refuses_the_options_of_one_simulation(tmp_path: Path) -> None:
    """``--sweep`` with ``--warmup-fraction`` measured every request (the warm-up was dropped
    without a word), and ``--eviction`` / ``--capacity-tokens`` beside it were ignored."""
    pytest.importorskip("matplotlib")
    png = str(tmp_path / "sweep.png")
    sweep = [
        "simulate",
        "--limit",
        "150",
        "--sweep",
        png,
        "--policies",
        "lru",
        "--capacities",
        "0.3",
        "--json",
    ]
    single = ["simulate", "--limit", "150", "--capacity-tokens", "300000", "--json"]
    for warm_up in ("0", "0.5"):
        swept = runner.invoke(app, [*sweep, "--warmup-fraction", warm_up])
        one = runner.invoke(app, [*single, "--warmup-fraction", warm_up])
        assert swept.exit_code == 0 and one.exit_code == 0, swept.output + one.output
        assert json.loads(swept.stdout)["hit_rate"]["lru"] == [json.loads(one.stdout)["hit_rate"]]
    for option, value, takes in (
        ("--eviction", "belady", "--policies"),
        ("--capacity-tokens", "1000", "--capacities"),
    ):
        out = runner.invoke(app, [*sweep, option, value])
        assert out.exit_code == 2 and option in out.output and takes in out.output, out.output


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ("lru,nope", "unknown eviction policy 'nope'"),
        (",", "--policies: no policy named"),
        (" ", "no policy"),
    ],
)
def test_sweep_policies_are_checked_before_the_trace_is_read(
    policies: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown name after a known one failed only once the known one's sweep had run (minutes
    on a full trace); ``--policies ,`` plotted an empty sweep and exited 0."""
    import kvstrata.replay.trace as trace_module

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the trace was read before --policies was checked")

    monkeypatch.setattr(trace_module, "read_trace", never)
    png = tmp_path / "sweep.png"
    out = runner.invoke(app, ["simulate", "--limit", "20", "--sweep", str(png), "--policies", policies])
    assert out.exit_code == 2, out.output
    assert message in out.output and "Traceback" not in out.output
    assert not png.exists()


def test_the_table_says_how_many_requests_the_cache_refused() -> None:
    """A cache smaller than a request refuses it (nothing inserted): the JSON counted them in
    ``refused_requests``, the table only showed a low hit rate."""
    args = ["simulate", "--limit", "20", "--capacity-tokens", "4096"]
    refused = json.loads(runner.invoke(app, [*args, "--json"]).stdout)["refused_requests"]
    assert refused > 0
    table = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    row = next(line for line in table.output.splitlines() if "refused requests" in line)
    assert row.split("│")[2].strip() == f"{refused:,}", row


def test_a_plot_that_cannot_be_written_keeps_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot's directory removed while the sweep ran: the plot was written before the numbers
    were printed, so a FileNotFoundError traceback (exit 1) lost the whole sweep. The numbers now
    come first, then one ``error:`` line naming ``--sweep`` and exit 1 (an output not written)."""
    pytest.importorskip("matplotlib")
    import kvstrata.replay.simulate as simulate_module

    folder = tmp_path / "plots"
    folder.mkdir()
    real_sweep = simulate_module.sweep

    def sweep_then_remove_the_folder(*args: object, **kwargs: object) -> dict[str, list[float]]:
        rates = real_sweep(*args, **kwargs)  # type: ignore[arg-type]
        folder.rmdir()
        return rates

    monkeypatch.setattr(simulate_module, "sweep", sweep_then_remove_the_folder)
    args = ["simulate", "--limit", "20", "--sweep", str(folder / "s.png"), "--policies", "lru"]
    out = runner.invoke(app, [*args, "--capacities", "0.1", "--json"])
    assert out.exit_code == 1, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), repr(out.exception)
    assert f"cannot write --sweep {folder / 's.png'}" in out.stderr
    assert json.loads(out.stdout)["hit_rate"]["lru"][0] > 0  # the sweep's numbers were printed


def test_an_interrupted_plot_leaves_no_half_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C (or a full disk) while the sweep's PNG was being written left a truncated image
    under the name the user asked for; it is written beside it and renamed into place, so an
    earlier plot stays whole and nothing else is left in the folder."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from kvstrata.replay.simulate import plot_sweep

    png = tmp_path / "s.png"
    png.write_bytes(b"an earlier plot")

    def cut_short(self: Figure, target: object, **_kwargs: object) -> None:
        if isinstance(target, str | Path):  # a file name: savefig opens it, truncating it
            Path(target).write_bytes(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", cut_short)
    with pytest.raises(KeyboardInterrupt):
        plot_sweep({"lru": [0.1, 0.2]}, [1_000_000, 2_000_000], png, title="t")
    assert png.read_bytes() == b"an earlier plot"
    assert [p.name for p in tmp_path.iterdir()] == ["s.png"]
    monkeypatch.undo()
    plot_sweep({"lru": [0.1, 0.2]}, [1_000_000, 2_000_000], png, title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["s.png"]


def test_a_plot_path_that_is_a_link_or_no_regular_file_is_written_not_replaced(tmp_path: Path) -> None:
    """The plot is renamed into place, but never over what is not a regular file (``--sweep
    /dev/null`` as root would have replaced the device with a file) nor over a symbolic link
    (the file it points at gets the plot, as ``savefig(path)`` wrote it)."""
    pytest.importorskip("matplotlib")
    import os
    import stat
    import threading

    from kvstrata.replay.simulate import plot_sweep

    rates, sizes = {"lru": [0.1, 0.2]}, [1_000_000, 2_000_000]
    real, link = tmp_path / "real.png", tmp_path / "link.png"
    real.write_bytes(b"old")
    link.symlink_to(real)
    plot_sweep(rates, sizes, link, title="t")
    assert link.is_symlink() and real.read_bytes()[:4] == b"\x89PNG"
    fifo = tmp_path / "pipe.svg"  # (PNG needs a seekable file)
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    plot_sweep(rates, sizes, fifo, title="t")
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a file"
    assert received and b"<svg" in received[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.png", "pipe.svg", "real.png"]


def test_the_plot_options_help_names_every_format_not_only_png() -> None:
    """``--sweep`` (and ``replay --plot``) said "into this PNG" although any suffix matplotlib
    writes is accepted (``check_plot_format``) and written in that format."""
    import typer.main

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for command, option in (("simulate", "sweep_out"), ("replay", "plot_out")):
        params = {p.name: p for p in commands[command].params}
        text = str(getattr(params[option], "help", ""))
        assert "this PNG" not in text and ".svg" in text and "suffix" in text, text


def _sweep_args(png: Path) -> list[str]:
    return [
        "simulate",
        "--limit",
        "300",
        "--sweep",
        str(png),
        "--policies",
        "lru,fifo",
        "--capacities",
        "0.5,1",
    ]


def test_a_sweep_shows_its_progress_on_stderr_only(tmp_path: Path) -> None:
    """Several policies at 8 capacities on a full trace ran for minutes without a word: the sweep
    now reports requests simulated over all its runs, on stderr, as plain lines when stderr is no
    terminal (no ANSI codes); stdout keeps exactly the table, and ``--json`` stays silent."""
    env = {"KVSTRATA_PROGRESS_S": "0", "COLUMNS": "200"}
    piped = runner.invoke(app, _sweep_args(tmp_path / "a.png"), env=env)
    assert piped.exit_code == 0, piped.output
    lines = piped.stderr.splitlines()
    assert any(
        line.startswith("sweep of 2 policies x 2 capacities: simulated 1,200/1,200 requests (100%), in ")
        for line in lines
    ), piped.stderr
    assert "\x1b[" not in piped.stderr and "\x1b[" not in piped.stdout
    assert "simulated" not in piped.stdout and piped.stdout.lstrip().startswith("hit rate by capacity")
    as_json = runner.invoke(app, [*_sweep_args(tmp_path / "b.png"), "--json"], env=env)
    assert as_json.exit_code == 0, as_json.output
    assert "simulated" not in as_json.stderr and json.loads(as_json.stdout)["capacities_tokens"]


def test_a_sweep_on_a_terminal_draws_a_live_bar_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from rich.console import Console

    import kvstrata.cli.simulate_cmd as simulate_cmd

    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    monkeypatch.setattr(simulate_cmd, "err", terminal)
    out = runner.invoke(app, _sweep_args(tmp_path / "a.png"), env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    drawn = terminal.file.getvalue()  # type: ignore[attr-defined]
    assert "sweep of 2 policies x 2 capacities: simulated" in drawn and "\x1b[" in drawn
    assert "\x1b[" not in out.stdout and "simulated" not in out.stdout


def test_sweep_reports_requests_over_every_run() -> None:
    from kvstrata.replay.simulate import sweep

    requests = read_trace(limit=300)
    seen: list[tuple[int, int]] = []
    sweep(requests, ["lru", "fifo"], [500_000, 1_000_000], progress=lambda d, t: seen.append((d, t)))
    assert {t for _, t in seen} == {1200}
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1] == (1200, 1200)
    assert (300, 1200) in seen and (900, 1200) in seen  # each run's end
