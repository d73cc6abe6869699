"""The CUDA-only branch of ``copy_units`` (a CUDA tier <-> host memory, on a side stream), run on
a CPU-only machine by fault injection: a host tier that claims to be on ``cuda:0`` (its memory is
host memory, so every copy really runs) and stand-ins for the side stream, the current stream, the
stream context and the event, which record what the copy asks of them. What these tests check is
the ordering the copy promises (what is waited for, what is kept alive), not CUDA itself."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvstrata.core import transfer
from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.transfer import copy_units
from kvstrata.plugins.pool_type import Layout, ModelContext
from kvstrata.pool_types.kv import KVConfig, KVPoolType

UNITS = 8


class FakeStream:
    """Fault injection: a side stream that records the calls a copy makes on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def wait_stream(self, other: object) -> None:
        self.calls.append("wait_stream")

    def synchronize(self) -> None:
        self.calls.append("synchronize")


class FakeEvent:
    """Fault injection: an event that records the stream it was recorded on."""

    def __init__(self) -> None:
        self.recorded_on: object = None

    def record(self, stream: object) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    """Fault injection: ``torch.cuda``'s stream API as stand-ins (CPU-only torch has none)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return FakeStream()


def tiers() -> tuple[PoolBuffers, PoolBuffers]:
    """A host tier and one that claims ``cuda:0`` (host memory: the copies really run), each with
    two buffers (k and v: two views, so a copy can fail after its first). One layer, so a run of
    units is one contiguous block: the copies need no pinned staging (CPU-only torch has none)."""
    spec = KVPoolType(
        "kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ModelContext(page_size=4, anchor="kv")
    ).spec()
    host = PoolBuffers(spec, UNITS, layout=Layout.LAYER_FIRST)
    device = PoolBuffers(spec, UNITS, layout=Layout.LAYER_FIRST)
    device.device = torch.device("cuda", 0)
    for pool, seed in ((host, 1), (device, 2)):
        assert pool.backing is not None
        pool.backing.copy_(
            torch.randint(0, 256, pool.backing.shape, generator=torch.Generator().manual_seed(seed))
        )
    return host, device


@pytest.mark.parametrize("to_device", [True, False])
def test_a_side_stream_copy_waits_for_the_compute_stream_and_records_its_event(
    fake_cuda: FakeStream, to_device: bool
) -> None:
    host, device = tiers()
    src, dst = (host, device) if to_device else (device, host)
    src_idx, dst_idx = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    handle = copy_units(src, src_idx, dst, dst_idx, stream=fake_cuda)  # type: ignore[arg-type]
    assert fake_cuda.calls == ["wait_stream"], "the side stream waits for the compute stream's writes"
    assert isinstance(handle.event, FakeEvent) and handle.event.recorded_on is fake_cuda
    for name in src.placements:
        assert torch.equal(src.unit_view(name)[src_idx], dst.unit_view(name)[dst_idx])


@pytest.mark.parametrize("to_device", [True, False])
def test_a_side_stream_copy_that_raises_part_way_waits_for_the_copies_it_issued(
    fake_cuda: FakeStream, monkeypatch: pytest.MonkeyPatch, to_device: bool
) -> None:
    """Fault injection (the second view's copy raises): the first view's copy was on the side
    stream with no event and no handle left with the error, so a caller freed (and reused) units
    an asynchronous copy still read or wrote. The side stream is now synchronized first."""
    host, device = tiers()
    src, dst = (host, device) if to_device else (device, host)
    real = transfer._cross_copy
    copied: list[int] = []

    def fails_second(*args: object) -> None:
        if copied:
            raise RuntimeError("injected copy fault")
        copied.append(1)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(transfer, "_cross_copy", fails_second)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        copy_units(src, torch.tensor([5, 6]), dst, torch.tensor([0, 1]), stream=fake_cuda)  # type: ignore[arg-type]
    assert copied, "one copy was issued before the fault"
    assert fake_cuda.calls == ["wait_stream", "synchronize"], "the issued copy was waited for"


def test_a_failing_wait_after_a_fault_leaves_the_copys_own_error(
    fake_cuda: FakeStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the side stream's wait fails too (a broken CUDA context): the copy's error
    is the one raised."""
    host, device = tiers()

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(fake_cuda, "synchronize", broken)
    monkeypatch.setattr(transfer, "_cross_copy", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        copy_units(host, torch.tensor([1]), device, torch.tensor([2]), stream=fake_cuda)  # type: ignore[arg-type]


@pytest.mark.parametrize("to_device", [True, False])
def test_a_side_stream_copy_keeps_the_indices_it_reads_until_waited_for(
    fake_cuda: FakeStream, to_device: bool
) -> None:
    """The side stream reads the index tensors after ``copy_units`` returns; a caller's CUDA
    indices (allocated on its own stream) were dropped with nothing holding them, so the caching
    allocator could reuse their memory for that stream's next tensor while the copy still read
    them (units gathered from or scattered to the wrong places). The handle now holds them."""
    host, device = tiers()
    src, dst = (host, device) if to_device else (device, host)
    src_idx, dst_idx = torch.tensor([1, 2]), torch.tensor([4, 5])
    handle = copy_units(src, src_idx, dst, dst_idx, stream=fake_cuda)  # type: ignore[arg-type]
    held = {id(t) for t in handle.keep_alive}
    assert id(src_idx) in held and id(dst_idx) in held
    handle.wait()
    assert not handle.keep_alive, "released once the copy is waited for"
