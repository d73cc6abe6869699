"""A hybrid prefix read from L3 whose state or window object at its end fails -- damaged, or the
backend raising mid-batch after the pages' objects were read -- is restored to the last earlier
end where every pool verified, never as the pages without their state (audit 41)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import pytest

from controller_support import host_units_held_by_tree, host_units_in_use, open_cache, serve, tokens, verify
from kvstrata.core.controller import PoolKind
from kvstrata.plugins import PluginHost
from kvstrata.plugins.storage_backend import ReadCheck, StorageObject
from kvstrata.storage_backends._file_config import FileConfig
from kvstrata.storage_backends.file import FileBackend

WAIT = "policy.prefetch.policy=wait_complete"


class _MidBatchConfig(FileConfig):
    type: Literal["midbatch"] = "midbatch"  # type: ignore[assignment]


class MidBatchFileBackend(FileBackend):
    """FAULT INJECTION: a file backend whose next get of a key containing ``fail_on`` reads every
    object into the caller's regions and then raises (a transport failing after the bytes landed)."""

    name = "midbatch"
    Config = _MidBatchConfig
    fail_on: str | None = None

    def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
        got = super().get(objects, check)
        if self.fail_on is not None and any(self.fail_on in obj.key for obj in objects):
            self.fail_on = None  # once: the read of the earlier end goes through
            raise ConnectionError("injected: the connection dropped after the read")
        return got


@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba", "logical-swa"])
@pytest.mark.parametrize("fault", ["damaged", "raises"])
def test_a_failed_state_or_window_object_at_the_end_restores_the_earlier_end(
    stack: str, fault: str, tmp_path: Path
) -> None:
    whole = tokens(45, 8)
    l3 = f"tiers.storage.l3={{type: midbatch, path: {tmp_path}}}"
    host = PluginHost()
    host.storage_backends.register(MidBatchFileBackend)
    with open_cache(stack, None, [l3], host=host) as writer:
        serve(writer, whole[: 3 * 64])  # state and window ends at 3 and 8
        lease, _ = serve(writer, whole)
        writer.flush()
        ends = [n for n in writer.pools.pools if writer.pool_kind(n) is not PoolKind.PAGES]
        assert ends, "the stack has a state or window pool"
        engine = writer.parts.engine
        assert engine is not None
        end_keys = [
            key for name in ends for keys in engine.object_keys(name, lease.page_hashes[7:]) for key in keys
        ]
    probe = MidBatchFileBackend("probe", _MidBatchConfig(path=tmp_path))
    for key in end_keys if fault == "damaged" else []:
        path = probe.path_for(key)
        path.write_bytes(path.read_bytes()[:-1])
    with open_cache(stack, None, [l3, WAIT], host=host) as cold:
        backend = cold.backend
        assert isinstance(backend, MidBatchFileBackend)
        if fault == "raises":
            assert cold.parts.engine is not None
            backend.fail_on = "." + cold.parts.engine.schemas[ends[0]].pool + "."
        lease = cold.lookup(whole)
        cold.admit(lease)
        assert (lease.cached_pages, lease.hit_pages["storage"]) == (3, 3)
        assert verify(cold, lease) == 0, "every restored byte, the state at page 3 included, is exact"
        cold.release(lease)
        cold.flush()
        assert host_units_in_use(cold) == host_units_held_by_tree(cold), "the units of pages 3..8 were freed"
