"""Deterministic page content: reproducible, distinct per identity/page/layer, verifier catches flips."""

from __future__ import annotations

import pytest
import torch

from kvstrata.replay.content import (
    ContentIdentity,
    fill_units,
    generate,
    page_identities,
    page_identity,
    unit_seeds,
    verify_units,
    word_table,
)

IDENT = ContentIdentity(namespace="model-a", pool="kv", buffer="k", dtype="bfloat16", unit_nbytes=256)


def filled(identity: ContentIdentity = IDENT, layer: int = 0, units: int = 16) -> torch.Tensor:
    buf = torch.zeros(units, identity.unit_nbytes, dtype=torch.uint8)
    fill_units(buf, torch.arange(units), torch.arange(100, 100 + units), identity, layer)
    return buf


def test_deterministic_and_verifies_clean() -> None:
    a, b = filled(), filled()
    assert torch.equal(a, b)
    assert a.float().std() > 50  # pseudo-random bytes, not a constant pattern
    assert verify_units(a, torch.arange(16), torch.arange(100, 116), IDENT, 0).numel() == 0


@pytest.mark.parametrize(
    "other",
    [
        ContentIdentity("model-b", "kv", "k", "bfloat16", 256),
        ContentIdentity("model-a", "kv2", "k", "bfloat16", 256),
        ContentIdentity("model-a", "kv", "v", "bfloat16", 256),
        ContentIdentity("model-a", "kv", "k", "float16", 256),
    ],
)
def test_identity_changes_every_unit(other: ContentIdentity) -> None:
    a, b = filled(), filled(other)
    assert (a != b).any(dim=1).all()
    # the verifier sees foreign content as wrong on every unit
    assert verify_units(b, torch.arange(16), torch.arange(100, 116), IDENT, 0).tolist() == list(range(16))


def test_layers_and_pages_differ() -> None:
    assert (filled(layer=0) != filled(layer=1)).any(dim=1).all()
    a = filled()
    assert (a[0] != a[1]).sum() > 200  # neighbouring pages differ in nearly every byte


def test_verifier_catches_flipped_byte_and_swapped_pages() -> None:
    buf = filled()
    buf[5, 77] ^= 0x01
    buf[[9, 10]] = buf[[10, 9]].clone()
    bad = verify_units(buf, torch.arange(16), torch.arange(100, 116), IDENT, 0)
    assert bad.tolist() == [5, 9, 10]


def test_scattered_unit_indices_and_odd_unit_size() -> None:
    ident = ContentIdentity("ns", "mamba", "ssm", "float32", 13)  # not a multiple of 8 bytes
    buf = torch.zeros(10, 13, dtype=torch.uint8)
    index = torch.tensor([7, 2, 5])
    pages = torch.tensor([page_identity(b"\x01" * 16), page_identity("abc"), page_identity(42)])
    fill_units(buf, index, pages, ident, layer=3)
    assert buf[[0, 1, 3, 4, 6, 8, 9]].eq(0).all()  # untouched units stay untouched
    assert verify_units(buf, index, pages, ident, 3).numel() == 0
    buf[2, 12] ^= 0x80  # last byte of the unit at position 1
    assert verify_units(buf, index, pages, ident, 3).tolist() == [1]
    # same bytes as the 8-byte-word path would give, truncated
    expected = generate(unit_seeds(ident, pages, 3), word_table(ident, 3), 13)
    assert torch.equal(buf[[7, 5]], expected[[0, 2]])


def test_rejects_non_byte_buffers() -> None:
    with pytest.raises(ValueError, match="uint8 tensor"):
        fill_units(torch.zeros(4, 8), [0], torch.tensor([1]), ContentIdentity("a", "b", "c", "d", 8), 0)


def test_page_identities_stable_and_distinct() -> None:
    keys = [b"\x00" * 32, b"\x00" * 31 + b"\x01", "prefix:1,2,3", 7, 2**64 - 1]
    ids = page_identities(keys)
    assert ids.dtype == torch.int64 and ids.tolist() == page_identities(keys).tolist()
    assert len(set(ids.tolist())) == len(keys)
