"""docs/storage.md's "Mooncake as L3" recipe with the real binaries (issue 27, item 3), through the
``kvstrata`` console script: standalone mode keeps objects across runs, embedded mode says at
start-up that its objects go with the process."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvstrata.testing.mooncake_servers import MooncakeStandaloneClient
from test_newcomer_second_hour import EXAMPLES, kvstrata


def l3_config(path: Path, **l3: object) -> Path:
    path.write_text(yaml.safe_dump({"tiers": {"storage": {"l3": {"type": "mooncake", **l3}}}}))
    return path


def storage_tokens(stdout: str) -> int:
    row = next(line for line in stdout.splitlines() if line.startswith("│ storage "))
    return int(row.split("│")[-2].strip().replace(",", ""))


def test_standalone_mode_serves_the_second_run_from_l3(
    mooncake_standalone_client: MooncakeStandaloneClient, tmp_path: Path
) -> None:
    master = mooncake_standalone_client.master
    config = l3_config(
        tmp_path / "mooncake-l3.yaml",
        master=master.address,
        metadata_server=master.metadata_url,
        standalone=True,
        client=mooncake_standalone_client.address,
    )
    # a namespace of its own: the session's client segment is shared with other tests
    args = ["replay", "-c", str(EXAMPLES / "kv.yaml"), "-c", str(config), "--limit", "8"]
    args += ["--set", f"model.name=howto-{tmp_path.name}"]
    first = kvstrata(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (
        f"in the segment of the standalone mooncake_client {mooncake_standalone_client.address}"
        in first.stderr
    )
    assert "objects outlive this process" in first.stderr
    second = kvstrata(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert storage_tokens(second.stdout) > 0, second.stdout
    assert "from an earlier run" in second.stdout


def test_embedded_mode_says_its_objects_go_with_the_process(
    mooncake_standalone_client: MooncakeStandaloneClient, tmp_path: Path
) -> None:
    master = mooncake_standalone_client.master
    config = l3_config(
        tmp_path / "embedded.yaml",
        master=master.address,
        metadata_server=master.metadata_url,
        segment_bytes=32 << 20,
    )
    args = ["replay", "-c", str(EXAMPLES / "kv.yaml"), "-c", str(config), "--limit", "4"]
    proc = kvstrata(*args, "--set", f"model.name=embedded-{tmp_path.name}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "embedded mode, the objects go when this process exits" in proc.stderr
    assert "standalone: true" in proc.stderr  # how to keep them
    # Mooncake's set-up chatter (glog INFO, ~15 lines) is counted, not shown; warnings still are
    assert not re.search(r"(?m)^I\d{4} ", proc.stderr), proc.stderr
    assert "info lines not shown (KVSTRATA_NATIVE_INFO=1 shows them)" in proc.stderr
