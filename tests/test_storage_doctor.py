"""`kvstrata doctor`: plan table, host budget, reachability, exit codes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.cli import app

DEMO = Path(__file__).parent.parent / "examples" / "configs" / "demo.yaml"
runner = CliRunner()


def doctor(*overrides: str):  # type: ignore[no-untyped-def]
    args = ["doctor", str(DEMO)]
    for item in overrides:
        args += ["--set", item]
    return runner.invoke(app, args, env={"COLUMNS": "200"})


def test_file_backend_passes(tmp_path: Path) -> None:
    result = doctor(f"tiers.storage.l3.path={tmp_path}")
    assert result.exit_code == 0, result.output
    assert "zero_copy" in result.output and "reachable" in result.output and "host budget" in result.output


def test_unavailable_backend_fails_with_reason(tmp_path: Path) -> None:
    result = doctor(f"tiers.storage.l3={{type: hf3fs, path: {tmp_path}}}")
    assert result.exit_code == 1
    assert "hf3fs_fuse.io" in result.output


def test_pool_that_cannot_be_stored_fails(tmp_path: Path) -> None:
    result = doctor(f"tiers.storage.l3={{type: hf3fs, path: {tmp_path}, mock: true, slot_bytes: 4096}}")
    assert result.exit_code == 1
    assert "max_object_bytes" in result.output and "cannot be stored" in result.output


def test_host_budget_overflow_fails(tmp_path: Path) -> None:
    result = doctor(f"tiers.storage.l3.path={tmp_path}", "tiers.host.capacity_tokens=100000000000")
    assert result.exit_code == 1
    # the table's console keeps the width it started with (80 columns where no terminal was
    # seen first): the words are asserted, not where the line wraps
    assert "does not fit" in " ".join(result.output.split())


def test_invalid_config_exit_code() -> None:
    result = doctor("tiers.storage.l3.capacity=1")
    assert result.exit_code == 2


def test_a_device_tier_on_the_cpu_counts_against_host_memory(tmp_path: Path) -> None:
    # start-up counts the CPU device tier in host memory; doctor counted only the host tier and
    # said "ok" for a config start-up refused, whose error named only tiers.host.capacity_tokens
    sets = [f"tiers.storage.l3.path={tmp_path}", "tiers.device.capacity_tokens=100000000000"]
    result = doctor(*sets, "tiers.host.capacity_tokens=512")
    assert result.exit_code == 1
    words = " ".join(result.output.split())
    assert "does not fit" in words and "device tier is on the CPU" in words
    start = runner.invoke(app, ["replay", "-c", str(DEMO), "--limit", "1", *(f"--set={s}" for s in sets)])
    assert start.exit_code != 0
    assert "lower tiers.device.capacity_tokens (the device tier is on the CPU" in " ".join(
        start.output.split()
    )


def test_an_install_hint_keeps_its_extra_in_brackets(monkeypatch: pytest.MonkeyPatch) -> None:
    # rich read `[mooncake]` as a tag and printed `pip install 'kvstrata'`, which installs no extra
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as on a machine without the wheel
    result = doctor("tiers.storage.l3={type: mooncake}")
    assert result.exit_code == 1, result.output
    # the command for this machine, runnable as printed (it held "(CPU-only machines: ...)")
    extra = "mooncake" if os.path.exists("/dev/nvidiactl") else "mooncake-cpu"
    assert f"run `pip install 'kvstrata[{extra}]'`" in " ".join(result.output.split())


def test_a_path_that_looks_like_markup_is_printed_not_parsed(tmp_path: Path) -> None:
    # an L3 path holding `[/y]` crashed doctor with rich's MarkupError traceback
    (tmp_path / "q[").mkdir()
    blocker = tmp_path / "q[" / "y]"
    blocker.write_text("a file where the L3 directory should be")
    result = doctor(f"tiers.storage.l3={{type: file, path: '{blocker}', capacity_bytes: 1000000}}")
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "problem:" in result.output and "q[/y]" in result.output


def test_sizes_no_machine_has_are_not_printed_as_twenty_digits_of_gib(tmp_path: Path) -> None:
    # a capacity typo (10**26 tokens) printed `11920928955078125568.000 GiB`
    result = doctor(f"tiers.storage.l3.path={tmp_path}", f"tiers.host.capacity_tokens={10**26}")
    assert result.exit_code == 1, result.output
    words = " ".join(result.output.split())
    assert "11920928955078125568" not in words
    assert "need 1.280e+28 bytes per rank" in words, words


def test_large_sizes_are_named_in_the_largest_binary_unit() -> None:
    from kvstrata.cli.doctor_cmd import human_size

    assert human_size(167772160) == "0.156 GiB"
    assert human_size(3 * 2**40) == "3.000 TiB"
    assert human_size(5 * 2**60) == "5.000 EiB"
    assert human_size(10**28) == "1.000e+28 bytes"


def test_the_verdict_lines_are_one_line_each_in_a_log() -> None:
    """Piped (a CI log, ``| grep``), rich wrapped ``doctor``'s host-budget line and ``config
    validate``'s ``valid:`` line at 80 columns, mid-phrase; ``error:`` and ``problem:`` lines
    were already one line each."""
    env = {"COLUMNS": "80"}
    budget = runner.invoke(app, ["doctor", str(DEMO), "--set", "tiers.storage={}"], env=env)
    assert budget.exit_code == 0, budget.output
    line = next(text for text in budget.stdout.splitlines() if text.startswith("host budget:"))
    assert line.endswith(": fits"), budget.stdout
    name = "a-model-name-long-enough-to-cross-eighty-columns-on-its-own"
    valid = runner.invoke(app, ["config", "validate", str(DEMO), "--set", f"model.name={name}"], env=env)
    assert valid.exit_code == 0, valid.output
    assert valid.stdout.count("\n") == 1 and "storage: l3 (file)" in valid.stdout, valid.stdout


def test_no_usable_backend_is_one_line_not_an_empty_plan_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend that cannot even be set up (a plugin whose constructor or capabilities raise)
    left the "I/O plan" table with its headers and no row: one line says so instead."""
    from kvstrata.storage_backends.file import FileBackend

    def broken(self: object) -> object:
        raise RuntimeError("plugin bug")

    monkeypatch.setattr(FileBackend, "instance_capabilities", broken)
    result = doctor(f"tiers.storage.l3.path={tmp_path}")
    assert result.exit_code == 1, result.output
    assert "I/O plan per" not in result.stdout and "┏" in result.stdout  # the backends table stays
    assert "I/O plan: none, no storage backend could be set up" in result.stdout
    assert "RuntimeError: plugin bug" in " ".join(result.output.split())


def test_doctor_leaves_no_directory_it_created_to_probe_the_l3(tmp_path: Path) -> None:
    """The file backend's probe ran ``mkdir -p`` on the L3 path and left it there: a diagnostic
    created what it checked. It still creates and writes it (that is the test of writability),
    then removes the directories it created, and only those."""
    kept = tmp_path / "existing"
    kept.mkdir()
    (kept / "mine.txt").write_text("the user's")
    target = kept / "new" / "l3"
    result = doctor(f"tiers.storage.l3.path={target}")
    assert result.exit_code == 0, result.output
    assert "reachable" in result.output
    assert not (kept / "new").exists()
    assert sorted(p.name for p in kept.iterdir()) == ["mine.txt"]  # nothing else touched
    already = doctor(f"tiers.storage.l3.path={kept}")  # an existing directory stays, as it was
    assert already.exit_code == 0, already.output
    assert sorted(p.name for p in kept.iterdir()) == ["mine.txt"]


def test_the_probe_still_refuses_a_path_it_cannot_create(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = doctor(f"tiers.storage.l3.path={blocker / 'l3'}")
    assert result.exit_code == 1, result.output
    assert "cannot create" in result.output and blocker.read_text() == "not a directory"
