"""Object header verification and I/O planning."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.core.config import ParallelConfig
from kvstrata.core.integrity import (
    DAMAGE,
    HEADER_BYTES,
    MARKER_SUFFIX,
    ObjectHeader,
    Verdict,
    build_header,
    layout_fingerprint,
    verify_object,
)
from kvstrata.core.io_plan import IOMode, IOPlan, plan_pool
from kvstrata.plugins.pool_type import Replication
from kvstrata.plugins.storage_backend import ANY_POOL, BackendCapabilities, BufferRegion, PoolCapabilities
from kvstrata.testing.conformance import conformance_specs


def regions_of(*arrays: np.ndarray) -> list[BufferRegion]:
    return [BufferRegion(int(a.ctypes.data), a.nbytes) for a in arrays]


def make_object(checksum: str = "xxh3") -> tuple[bytes, list[np.ndarray], bytes]:
    spec = conformance_specs()["state"]
    fp = layout_fingerprint(spec, "state")
    payload = [np.arange(100, dtype=np.uint8), np.arange(50, dtype=np.uint8)[::-1].copy()]
    header = build_header("key-1", fp, regions_of(*payload), checksum)  # type: ignore[arg-type]
    return header, payload, fp


def verify(header: bytes, payload: list[np.ndarray], fp: bytes, *, key: str = "key-1",
           read: int | None = None, checksum: str = "xxh3") -> Verdict:  # fmt: skip
    total = HEADER_BYTES + sum(p.nbytes for p in payload)
    return verify_object(header, key=key, fingerprint=fp, payload=regions_of(*payload),
                         bytes_read=total if read is None else read, checksum=checksum)  # type: ignore[arg-type]  # fmt: skip


def test_header_round_trip_and_every_rejection() -> None:
    header, payload, fp = make_object()
    assert len(header) == HEADER_BYTES
    parsed = ObjectHeader.unpack(header)
    assert parsed.payload_nbytes == 150 and parsed.fingerprint == fp
    assert verify(header, payload, fp) is Verdict.OK
    assert verify(header, payload, fp, read=10) is Verdict.SHORT_READ
    assert verify(header, payload, fp, read=HEADER_BYTES + 149) is Verdict.LENGTH_MISMATCH
    assert verify(b"XXXX" + header[4:], payload, fp) is Verdict.BAD_MAGIC
    assert verify(header[:4] + b"\x09\x00" + header[6:], payload, fp) is Verdict.BAD_VERSION
    assert verify(header, payload, bytes(16)) is Verdict.FINGERPRINT_MISMATCH
    assert verify(header, payload, fp, key="key-2") is Verdict.KEY_MISMATCH
    payload[1][7] ^= 1
    assert verify(header, payload, fp) is Verdict.CHECKSUM_MISMATCH
    assert verify(header, payload, fp, checksum="none") is Verdict.OK  # reader opted out
    unchecked, payload2, _ = make_object("none")
    payload2[0][0] ^= 1
    assert verify(unchecked, payload2, fp, checksum="none") is Verdict.OK  # neither side checks
    # a reader whose policy is a checksum never trusts an object that carries none
    assert verify(unchecked, payload2, fp) is Verdict.CHECKSUM_MISSING


def test_checksum_covers_the_header() -> None:
    """Any header field rewritten after the fact fails the checksum (format version 2)."""
    header, payload, fp = make_object()
    for offset in (8, 24, 33, 50, 63):  # fingerprint, key digest, payload length, reserved bytes
        forged = bytearray(header)
        forged[offset] ^= 0x10
        assert verify(bytes(forged), payload, fp) is not Verdict.OK, offset
    reserved = bytearray(header)
    reserved[60] ^= 1  # a field no check reads: only the checksum notices
    assert verify(bytes(reserved), payload, fp) is Verdict.CHECKSUM_MISMATCH
    flipped_fp = bytearray(header)
    flipped_fp[9] ^= 1  # damage, not another layout: counted as corruption
    assert verify(bytes(flipped_fp), payload, fp) is Verdict.CHECKSUM_MISMATCH


def test_header_downgraded_to_no_checksum_is_refused() -> None:
    """The attack of issue 15: declare "no checksum" in the header, then change payload bytes."""
    header, payload, fp = make_object()
    downgraded = bytearray(header)
    downgraded[6:8] = (0).to_bytes(2, "little")  # checksum kind: none
    downgraded[40:48] = bytes(8)
    payload[0][3] ^= 0xFF
    assert verify(bytes(downgraded), payload, fp) is Verdict.CHECKSUM_MISSING
    assert Verdict.CHECKSUM_MISSING in DAMAGE


def test_fingerprint_tracks_shape_dtype_suffix_not_pool_name() -> None:
    specs = conformance_specs()
    attn = specs["attn"]
    assert layout_fingerprint(attn, "k") != layout_fingerprint(attn, "v")
    assert layout_fingerprint(attn, "k") != layout_fingerprint(conformance_specs("bfloat16")["attn"], "k")
    renamed = attn.model_copy(update={"name": "other"})
    assert layout_fingerprint(renamed, "k") == layout_fingerprint(attn, "k")
    with pytest.raises(ValueError, match="suffix"):
        layout_fingerprint(attn, "nope")


CAPS_ZERO = BackendCapabilities(pools={ANY_POOL: PoolCapabilities(zero_copy=True)}, multi_buffer_objects=True)


def test_plan_modes_follow_capabilities() -> None:
    spec = conformance_specs()["attn"]
    parallel = ParallelConfig()
    assert plan_pool("b", CAPS_ZERO, spec, parallel=parallel).mode is IOMode.ZERO_COPY
    single = CAPS_ZERO.model_copy(update={"multi_buffer_objects": False})
    assert plan_pool("b", single, spec, parallel=parallel).mode is IOMode.COPY
    alloc = CAPS_ZERO.model_copy(update={"host_allocator": True})
    assert plan_pool("b", alloc, spec, parallel=parallel).mode is IOMode.COPY
    assert (
        plan_pool("b", alloc, spec, parallel=parallel, host_memory_from_backend=True).mode is IOMode.ZERO_COPY
    )
    copy_only = BackendCapabilities(pools={ANY_POOL: PoolCapabilities()})
    assert plan_pool("b", copy_only, spec, parallel=parallel).mode is IOMode.COPY


def test_plan_off_reasons() -> None:
    spec = conformance_specs()["attn"]
    parallel = ParallelConfig()
    narrow = BackendCapabilities(pools={"other": PoolCapabilities()})
    plan = plan_pool("b", narrow, spec, parallel=parallel)
    assert plan.mode is IOMode.OFF and "conf_kv" in plan.reason and not plan.enabled
    plan = plan_pool("b", CAPS_ZERO, spec, parallel=parallel, split_heads=True)
    assert plan.mode is IOMode.OFF and "split_heads" in plan.reason
    limit = spec.object_bytes("k") + HEADER_BYTES
    small = CAPS_ZERO.model_copy(update={"max_object_bytes": limit - 1})
    plan = plan_pool("b", small, spec, parallel=parallel)
    assert plan.mode is IOMode.OFF and "max_object_bytes" in plan.reason
    exact = CAPS_ZERO.model_copy(update={"max_object_bytes": limit})
    assert plan_pool("b", exact, spec, parallel=parallel).mode is IOMode.ZERO_COPY
    logical = spec.model_copy(update={"buffers": (), "objects": ()})
    assert plan_pool("b", narrow, logical, parallel=parallel).mode is IOMode.OFF


def test_bufferless_pool_plans_one_header_only_marker_object() -> None:
    logical = conformance_specs()["attn"].model_copy(update={"buffers": (), "objects": ()})
    parallel = ParallelConfig()
    plan = plan_pool("b", CAPS_ZERO, logical, parallel=parallel)
    assert plan.enabled and plan.writes and "marker" in plan.reason
    assert plan.object_bytes == {MARKER_SUFFIX: HEADER_BYTES}
    copy_only = BackendCapabilities(pools={ANY_POOL: PoolCapabilities()})
    assert plan_pool("b", copy_only, logical, parallel=parallel).mode is IOMode.COPY
    # the marker's fingerprint is its own: never equal to a real object's of the same pool type
    assert layout_fingerprint(logical, MARKER_SUFFIX) != layout_fingerprint(conformance_specs()["attn"], "k")
    with pytest.raises(ValueError, match="no object with suffix"):
        layout_fingerprint(conformance_specs()["attn"], MARKER_SUFFIX)


def test_replicated_pool_read_only_on_other_ranks() -> None:
    spec = conformance_specs()["attn"].model_copy(update={"replication": Replication.REPLICATED})
    rank0 = plan_pool("b", CAPS_ZERO, spec, parallel=ParallelConfig(tp_rank=0, tp_size=2))
    rank1 = plan_pool("b", CAPS_ZERO, spec, parallel=ParallelConfig(tp_rank=1, tp_size=2))
    assert rank0.writes and not rank0.read_only
    assert rank1.read_only and not rank1.writes and rank1.enabled and "read-only" in rank1.reason
    with pytest.raises(ValueError, match="extra"):
        IOPlan.model_validate({**rank1.model_dump(), "unexpected": 1})
