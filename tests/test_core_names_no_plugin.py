"""The core decides from specs and capabilities; it must never branch on a plugin's name."""

from __future__ import annotations

import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "src" / "kvstrata" / "core"
PLUGIN_NAMES = re.compile(r'"(mooncake|file|hf3fs|kv|mla|nsa|swa|mamba|draft|logical)"')


def test_core_source_names_no_builtin_plugin() -> None:
    offenders = [
        f"{path.relative_to(CORE)}:{number}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PLUGIN_NAMES.search(line)
    ]
    assert not offenders, "core/ names plugins:\n" + "\n".join(offenders)
    assert list(CORE.rglob("*.py")), "core/ has no modules?"
