"""Fault matrix: hostile traces, configs and output paths (issue 15, defect 7).

What must hold for every case: exit code 2, one ``error:`` line naming the problem and where it is
(file:line, the dotted setting, the option), no traceback, and nothing run (checked before any
work starts). ``config validate``, ``doctor`` and ``replay`` refuse a config start-up would refuse
with the same line. Most cases call the console-script function in-process (``run_main``); the
first ones run it as a fresh process, as a user would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fault_support import REPO, assert_clean_refusal, file_l3, run_cli, run_main, write_stack

pytestmark = pytest.mark.faults

GOOD = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}


def hostile_trace(tmp_path: Path, case: str) -> tuple[Path, str]:
    """(trace file, what the error line must say) for one hostile trace."""
    path = tmp_path / f"{case}.jsonl"
    good = json.dumps(GOOD).encode() + b"\n"
    if case == "not_utf8":
        path.write_bytes(good + b'{"timestamp": 1, \xff\xfe}\n')
        return path, f"{path}:2: not UTF-8 text (byte 0xff at column 18)"
    if case == "nested":
        path.write_bytes(good + b"[" * 50_000 + b"]" * 50_000 + b"\n")
        return path, f"{path}:2: JSON nested too deeply"
    if case == "id_beyond_64_bits":
        path.write_text(json.dumps({**GOOD, "hash_ids": [1, (1 << 64) + 5]}) + "\n")
        return path, f"{path}:1: hash_ids must be below 2^64"
    if case == "ten_million_ids":
        ids = ",".join(["7"] * 10_000_000)
        path.write_text(
            f'{{"timestamp": 0, "input_length": 5120000000, "output_length": 1, "hash_ids": [{ids}]}}\n'
        )
        return path, f"{path}:1: line longer than"
    if case == "request_over_the_bound":
        path.write_text(
            json.dumps({**GOOD, "input_length": 4096 * 512, "hash_ids": list(range(4096))}) + "\n"
        )
        return path, f"{path}:1: input_length 2,097,152 is above the longest request allowed (1,048,576"
    raise AssertionError(case)


TRACE_CASES = ["not_utf8", "nested", "id_beyond_64_bits", "ten_million_ids", "request_over_the_bound"]


@pytest.mark.parametrize("case", TRACE_CASES[:2])
def test_hostile_trace_in_a_fresh_process(case: str, tmp_path: Path) -> None:
    trace, message = hostile_trace(tmp_path, case)
    assert_clean_refusal(run_cli("replay", trace, cwd=tmp_path), message)


@pytest.mark.parametrize("command", ["replay", "simulate"])
@pytest.mark.parametrize("case", TRACE_CASES)
def test_hostile_trace_is_refused_with_file_and_line(
    case: str,
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace, message = hostile_trace(tmp_path, case)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main([command, trace], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert message in line, line
    assert "replaying" not in err


def test_the_request_bound_is_a_config_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, _ = hostile_trace(tmp_path, "request_over_the_bound")
    stack = write_stack(tmp_path / "stack.yaml")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(
        ["replay", trace, "-c", stack, "--set", "model.max_request_tokens=1000"], capsys, monkeypatch
    )
    assert code == 2 and "above the longest request allowed (1,000" in err
    code, _, err = run_main(
        ["config", "validate", stack, "--set", "model.max_request_tokens=0"], capsys, monkeypatch
    )
    assert code == 2 and "model.max_request_tokens" in err


# --- output paths: refused before the run, not after it ----------------------------------------


@pytest.mark.parametrize(
    ("option", "target", "message"),
    [
        ("--json", "/sys/kvstrata-result.json", "cannot be written"),  # root passes os.access here
        ("--json", "/proc/self/kvstrata.json", "/proc/self/kvstrata.json:"),
        ("--plot", "{tmp}/plot.xyz", "matplotlib cannot write '.xyz' files"),
    ],
)
def test_unwritable_output_is_refused_before_the_run(
    option: str,
    target: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    path = target.format(tmp=tmp_path)
    code, _, err = run_main(["replay", "--limit", "2", option, path], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {option} {path}") and message in line, line
    assert "replaying" not in err
    assert not Path(path).exists()


def test_the_writability_probe_leaves_an_existing_file_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.cli import check_output_path

    existing = tmp_path / "keep.json"
    existing.write_text("user data")
    check_output_path("--json", existing)
    check_output_path("--json", tmp_path / "new.json")
    assert existing.read_text() == "user data" and not (tmp_path / "new.json").exists()


# --- configs start-up would refuse: validate, doctor and replay say the same line ---------------


CONFIG_CASES = {
    "host_tier_zero_under_l3": (
        ["tiers.host.capacity_tokens=0"],
        "tiers.storage needs a host tier (L3 reads and writes go through L2)",
    ),
    "two_storage_instances": (
        ["tiers.storage.second={type: file, path: second-l3}"],
        "tiers.storage: one storage instance per cache is supported, got ['l3', 'second']",
    ),
    "device_capacity_zero": (
        ["tiers.device.capacity_tokens=0"],
        "tiers.device.capacity_tokens is 0: pool 'kv' would get no device units",
    ),
    "device_units_zero": (
        ["model.pools.kv.device_units=0"],
        "model.pools.kv.device_units is 0: the pool would hold nothing on the device",
    ),
    "host_units_zero_under_a_host_tier": (
        ["model.pools.kv.host_units=0"],
        "model.pools.kv.host_units is 0: no page of the stack could be on the host tier or in L3",
    ),
    "state_interval_on_token_pages": (
        ["model.pools.kv.state_every_pages=4"],
        "model.pools.kv.state_every_pages: state_every_pages sizes node-state pools",
    ),
    "not_a_torch_device": (["tiers.device.device=tpu7"], "tiers.device.device 'tpu7' is not a torch device"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_validate_doctor_and_replay_refuse_what_start_up_refuses_with_one_message(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides, message = CONFIG_CASES[case]
    stack = write_stack(tmp_path / "stack.yaml", storage=file_l3(tmp_path / "l3"))
    sets = [arg for text in overrides for arg in ("--set", text)]
    monkeypatch.chdir(tmp_path)
    lines = {}
    for command in (
        ["config", "validate", stack],
        ["doctor", stack],
        ["replay", "-c", stack, "--limit", "2"],
    ):
        code, _, err = run_main([*command, *sets], capsys, monkeypatch)
        assert code == 2 and "Traceback" not in err, (command, err)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (command, err)
        assert "replaying" not in err
        lines[command[0]] = errors[0]
    assert len(set(lines.values())) == 1, lines
    assert not (tmp_path / "l3").exists(), "nothing was opened"


def test_library_start_up_raises_the_same_message(tmp_path: Path) -> None:
    import kvstrata
    from kvstrata.core.builder import StartupError

    stack = write_stack(tmp_path / "stack.yaml")
    with pytest.raises(
        StartupError, match=r"tiers\.device\.capacity_tokens is 0: pool .kv. would get no device"
    ):
        kvstrata.open(stack, overrides=["tiers.device.capacity_tokens=0"])


def test_a_device_this_machine_lacks_is_refused_by_doctor_and_replay_not_by_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config written for another machine is valid; running it here is not."""
    device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    stack = write_stack(tmp_path / "stack.yaml")
    sets = ["--set", f"tiers.device.device={device}"]
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_main(["config", "validate", stack, *sets], capsys, monkeypatch)
    assert code == 0 and "valid" in out
    for command in (["doctor", stack], ["replay", "-c", stack, "--limit", "1"]):
        code, _, err = run_main([*command, *sets], capsys, monkeypatch)
        assert code == 2 and "Traceback" not in err, err
        assert f"error: tiers.device.device '{device}' cannot be used on this machine" in err


def test_every_example_config_passes_the_start_up_checks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for example in sorted((REPO / "examples" / "configs").glob("*.yaml")):
        code, out, err = run_main(["config", "validate", example], capsys, monkeypatch)
        assert code == 0 and "valid" in out, (example, err)
