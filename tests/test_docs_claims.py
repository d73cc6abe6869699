"""Claims the docs make that a change elsewhere can silently falsify (audit s35): the tests the
docs cite as proof exist, and ``kvstrata.open`` raises the documented ``ConfigError`` for every
config ``kvstrata config validate`` refuses at start-up."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import kvstrata
from kvstrata.plugins import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_every_test_the_docs_cite_as_proof_exists() -> None:
    sources = {path.name: path.read_text() for path in (REPO / "tests").rglob("*.py")}
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for file, name in re.findall(r"(test_[a-z0-9_]+\.py)::(test_[a-z0-9_]+)(?![a-z0-9_*])", line):
                text = sources.get(file)
                if text is None or not re.search(rf"\bdef {name}\b", text):
                    missing.append(f"{doc.relative_to(REPO)}:{number}: {file}::{name}")
    assert not missing, "cited tests that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("case", ["host 0 under an L3", "two storage instances", "belady", "device 0"])
def test_open_raises_config_error_for_a_config_start_up_refuses(case: str, tmp_path: Path) -> None:
    """README: ``kvstrata.open`` raises ``kvstrata.plugins.ConfigError`` for a bad config. These
    raised ``StartupError``, a bare ``ValueError`` (still one, for callers catching that)."""
    kv = {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 4}
    config: dict[str, Any] = {
        "model": {"name": "claims", "page_size": 4, "pools": {"kv": kv}},
        "tiers": {"device": {"capacity_tokens": 64}, "host": {"capacity_tokens": 128}},
    }
    if case == "host 0 under an L3":
        config["tiers"]["host"]["capacity_tokens"] = 0
        config["tiers"]["storage"] = {"l3": {"type": "file", "path": str(tmp_path / "l3")}}
    elif case == "two storage instances":
        config["tiers"]["storage"] = {
            name: {"type": "file", "path": str(tmp_path / name)} for name in ("a", "b")
        }
    elif case == "belady":
        config["policy"] = {"eviction": "belady"}
    else:
        config["tiers"]["device"]["capacity_tokens"] = 0
    with pytest.raises(ConfigError) as raised:
        kvstrata.open(config, environ={})
    assert isinstance(raised.value, ValueError)
    assert raised.value.errors and str(raised.value)
