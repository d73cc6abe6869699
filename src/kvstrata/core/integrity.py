"""Object header: makes a corrupt, truncated, foreign or mis-shaped object a miss, never data.

Every stored object is ``header (HEADER_BYTES) + payload``; the core builds the header and passes
it as the object's FIRST region, so backends store opaque bytes. Header layout (little endian)::

    0  magic        4s   b"KVS1"
    4  version      u16  FORMAT_VERSION
    6  checksum     u16  0 = none, 1 = xxh3_64 of the header (this field zero) and the payload
    8  fingerprint  16s  layout fingerprint of (pool type, buffers, dtypes, shapes, page size, suffix)
    24 key digest   u64  xxh3_64 of the object's key: an object served under another key is rejected
    32 payload len  u64
    40 checksum     u64
    48 reserved     16s  zero

The checksum covers the header too (format version 2): a rewritten header field -- a checksum
kind downgraded to "none", a fingerprint, a length -- fails it like a flipped payload byte. A
reader whose policy is ``xxh3`` refuses an object that declares no checksum (it cannot be checked,
so it is not trusted); a reader with policy ``none`` checks everything but the checksum.

The payload byte order is canonical -- for each buffer of the ObjectSpec in order, each layer in
order, the unit's elements -- whatever the host layout, so the fingerprint leaves the host layout
out and a page written from a layer-first host pool can be read into a page-first one.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Literal

import numpy as np
import xxhash

from kvstrata.plugins.pool_type import BufferSpec, PoolSpec, UnitLayout
from kvstrata.plugins.storage_backend import OBJECT_MAGIC, BufferRegion, region_view

MAGIC = OBJECT_MAGIC
#: Suffix of the header-only marker object a pool without buffers (a logical anchor) stores per
#: unit: its existence is the commit marker that gates reading the other pools of the page.
MARKER_SUFFIX = "marker"
#: 2: the checksum covers the header as well as the payload (version 1 objects are foreign).
FORMAT_VERSION = 2
HEADER_BYTES = 64
_STRUCT = struct.Struct("<4sHH16sQQQ16s")
assert _STRUCT.size == HEADER_BYTES
_CHECKSUM_AT = 40  # offset of the checksum field, zero while the checksum is computed
_CHECKSUM_FIELD = struct.Struct("<Q")
_RESERVED = bytes(16)
_ZERO_CHECKSUM = bytes(_CHECKSUM_FIELD.size)
#: A batch of headers is built and checked as 8 little-endian uint64 words per row (magic, version
#: and checksum kind share word 0; fingerprint 1-2; key digest 3; payload length 4; checksum 5): one
#: array operation per field for the whole batch instead of a ``struct`` call per object, since
#: Python per-object work was most of the engine's cost around the bytes themselves.
_MAGIC_WORD = int.from_bytes(MAGIC, "little")

ChecksumPolicy = Literal["xxh3", "none"]


class ChecksumKind(IntEnum):
    NONE = 0
    XXH3_64 = 1


_CHECKSUM_KINDS = frozenset(int(kind) for kind in ChecksumKind)


class Verdict(StrEnum):
    """Outcome of verifying one object read back."""

    OK = "ok"
    SHORT_READ = "short_read"  # fewer bytes than a header (missing or truncated object)
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # another pool type / layout / shape
    KEY_MISMATCH = "key_mismatch"  # object stored under a different key
    LENGTH_MISMATCH = "length_mismatch"  # truncated, or payload size differs from the spec
    CHECKSUM_MISMATCH = "checksum_mismatch"  # header or payload bytes changed
    CHECKSUM_MISSING = "checksum_missing"  # declares no checksum; the reader's policy demands one


#: Verdicts that mean the bytes under our key are damaged (or cannot be trusted): counted as
#: corruption, and removed so they are not read again.
DAMAGE = frozenset(
    {
        Verdict.SHORT_READ,
        Verdict.BAD_MAGIC,
        Verdict.LENGTH_MISMATCH,
        Verdict.CHECKSUM_MISMATCH,
        Verdict.CHECKSUM_MISSING,
        # our own layout, intact, but another key's object: the store handed back the wrong one
        # (a layout change shows as FINGERPRINT_MISMATCH first, a format change as BAD_VERSION)
        Verdict.KEY_MISMATCH,
    }
)
#: Verdicts that mean an intact object that is not what this reader stores under the key: another
#: layout (a layout change under the same model name), another format version, another key's
#: object. Counted apart from corruption, and removed too, so the key can be written again.
FOREIGN = frozenset({Verdict.BAD_VERSION, Verdict.FINGERPRINT_MISMATCH})


def stored_objects(spec: PoolSpec) -> tuple[tuple[str, int], ...]:
    """``(suffix, payload bytes)`` of every object stored per unit of ``spec``.

    A pool with no objects (no buffers: a logical anchor) still stores one header-only marker
    object per unit, so its pages can be committed and their existence gated like any other.
    """
    if not spec.objects:
        return ((MARKER_SUFFIX, 0),)
    return tuple((obj.suffix, spec.object_bytes(obj.suffix)) for obj in spec.objects)


def layout_fingerprint(spec: PoolSpec, suffix: str) -> bytes:
    """16-byte digest of everything that shapes one object's bytes or says what they are (the
    model layers they hold), not the host layout."""
    if not spec.objects and suffix == MARKER_SUFFIX:
        buffer_names: tuple[str, ...] = ()
    else:
        obj = next((o for o in spec.objects if o.suffix == suffix), None)
        if obj is None:
            raise ValueError(f"pool {spec.name!r} has no object with suffix {suffix!r}")
        buffer_names = obj.buffers
    by_name = {b.name: b for b in spec.buffers}
    description = {
        "pool_type": spec.pool_type,
        "page_size": spec.page_size,
        "granularity": str(spec.granularity),
        "suffix": suffix,
        "buffers": [_buffer_description(by_name[name]) for name in buffer_names],
    }
    if spec.layer_ids is not None and tuple(spec.layer_ids) != tuple(range(len(spec.layer_ids))):
        # which model layers the pool's layers hold: layers 4..7 are not the state of 0..3. Named
        # only where they are not the default numbering, so every earlier fingerprint stays
        description["layer_ids"] = list(spec.layer_ids)
    if spec.fingerprint_extra:  # (named only where a pool declares some: other keys stay)
        description["extra"] = [list(fact) for fact in sorted(spec.fingerprint_extra)]
    text = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"kvstrata-fp-v1").digest()


def _buffer_description(buffer: BufferSpec) -> list[object]:
    """What shapes a buffer's bytes. A head-major unit can have the token-major unit's shape
    (``kv_heads == page_size``), so the unit layout is named, but only when it is not the
    default: every fingerprint written before unit layouts existed stays the same. A buffer with
    no unit layout (a state slot) says its dimension order only by the names it declares: a GDN
    state ``[heads, key_dim, value_dim]`` and its transpose have one shape when the two dims are
    equal, so declared names are part of it too (none declared: the fingerprint is as before)."""
    described: list[object] = [buffer.name, buffer.dtype, buffer.layers, list(buffer.unit_shape)]
    if buffer.unit_layout is not None and buffer.unit_layout != UnitLayout.TOKEN_MAJOR:
        described.append(str(buffer.unit_layout))
    elif buffer.unit_layout is None and buffer.unit_dims:
        described.append(list(buffer.unit_dims))
    return described


def key_digest(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def payload_checksum(regions: Sequence[BufferRegion]) -> int:
    """xxh3_64 streamed over the regions in order (no concatenation copy)."""
    hasher = xxhash.xxh3_64()
    for region in regions:
        hasher.update(region_view(region))
    return hasher.intdigest()


def object_checksum(header: bytes | bytearray | memoryview, payload: Sequence[BufferRegion]) -> int:
    """xxh3_64 of the header (its checksum field read as zero) followed by the payload."""
    hasher = xxhash.xxh3_64()
    hasher.update(header[:_CHECKSUM_AT])
    hasher.update(_ZERO_CHECKSUM)
    hasher.update(header[_CHECKSUM_AT + _CHECKSUM_FIELD.size : HEADER_BYTES])
    for region in payload:
        hasher.update(region_view(region))
    return hasher.intdigest()


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    fingerprint: bytes
    key_digest: int
    payload_nbytes: int
    checksum_kind: ChecksumKind = ChecksumKind.NONE
    checksum: int = 0
    version: int = FORMAT_VERSION
    magic: bytes = MAGIC

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> ObjectHeader:
        magic, version, kind, fingerprint, digest, nbytes, checksum, _ = _STRUCT.unpack(bytes(data))
        try:
            checksum_kind = ChecksumKind(kind)
        except ValueError:
            checksum_kind = ChecksumKind.NONE
            version = -1  # unknown checksum kind: treat like an unknown format
        return cls(fingerprint, digest, nbytes, checksum_kind, checksum, version, magic)


def build_header(
    key: str, fingerprint: bytes, payload: Sequence[BufferRegion], checksum: ChecksumPolicy
) -> bytes:
    """The header bytes for one object whose payload lies in ``payload``."""
    nbytes = sum(region.nbytes for region in payload)
    kind = ChecksumKind.XXH3_64 if checksum == "xxh3" else ChecksumKind.NONE
    # Packed directly (not through ObjectHeader): this runs once per object on the put path.
    header = _STRUCT.pack(MAGIC, FORMAT_VERSION, kind, fingerprint, key_digest(key), nbytes, 0, _RESERVED)
    if kind is ChecksumKind.NONE:
        return header
    value = _CHECKSUM_FIELD.pack(object_checksum(header, payload))
    return header[:_CHECKSUM_AT] + value + header[_CHECKSUM_AT + _CHECKSUM_FIELD.size :]


def verify_object(
    header: bytes | memoryview,
    *,
    key: str,
    fingerprint: bytes,
    payload: Sequence[BufferRegion],
    bytes_read: int,
    checksum: ChecksumPolicy,
) -> Verdict:
    """Check an object read back into ``header`` + ``payload``; anything but OK is a miss.

    With policy ``xxh3`` the object must carry a checksum, verified over its header and payload;
    policy ``none`` trades detection of silent bit flips for read bandwidth (every other field is
    still checked). When the whole object was read, the checksum is verified before the layout
    fields, so a damaged header counts as damage rather than as another layout's object.
    """
    if bytes_read < HEADER_BYTES:
        return Verdict.SHORT_READ
    # Unpacked directly (not through ObjectHeader): this runs once per object on every read.
    magic, version, kind, stored_fingerprint, digest, nbytes, stored_checksum, _ = _STRUCT.unpack(header)
    if magic != MAGIC:
        return Verdict.BAD_MAGIC
    if version != FORMAT_VERSION or kind not in _CHECKSUM_KINDS:  # unknown kind: unknown format
        return Verdict.BAD_VERSION
    verify_checksum = checksum == "xxh3"
    if verify_checksum and kind != ChecksumKind.XXH3_64:
        return Verdict.CHECKSUM_MISSING  # weaker than the reader's policy: never trusted
    expected = sum(region.nbytes for region in payload)
    complete = nbytes == expected and bytes_read == HEADER_BYTES + expected
    if complete and verify_checksum and object_checksum(header, payload) != stored_checksum:
        return Verdict.CHECKSUM_MISMATCH
    if stored_fingerprint != fingerprint:
        return Verdict.FINGERPRINT_MISMATCH
    if digest != key_digest(key):
        return Verdict.KEY_MISMATCH
    if not complete:
        return Verdict.LENGTH_MISMATCH
    return Verdict.OK


# --- whole batches: headers built and checked with array operations -----------------------------


def fingerprint_words(fingerprints: Sequence[bytes]) -> np.ndarray:
    """``(len(fingerprints), 2)`` uint64: each 16-byte fingerprint as the two words a header holds."""
    return np.frombuffer(b"".join(fingerprints), dtype="<u8").reshape(len(fingerprints), 2).copy()


def key_digests(keys: Sequence[str]) -> np.ndarray:
    """:func:`key_digest` of every key, as the uint64 array the batch checks compare against."""
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(key.encode()) for key in keys), dtype=np.uint64, count=len(keys))


def fill_headers(
    headers: np.ndarray,
    *,
    digests: np.ndarray,
    fingerprints: np.ndarray,
    payload_nbytes: np.ndarray,
    payloads: Sequence[Sequence[memoryview]],
    checksum: ChecksumPolicy,
) -> None:
    """Write every header of a batch into ``headers`` (zeroed ``(n, HEADER_BYTES)`` uint8): the
    same bytes :func:`build_header` makes per object, the fields set for all rows at once;
    ``payloads``: per row, byte views of the payload. The checksum field is still zero when the
    checksum is computed, so each header is hashed whole (:func:`prefixed_checksum`)."""
    _fill_fields(headers, digests, fingerprints, payload_nbytes, checksum)
    if checksum != "xxh3":
        return
    words = headers.view("<u8")
    flat = headers.reshape(-1).data
    sums = words[:, _CHECKSUM_AT // 8]  # a view: assignments land in ``headers``
    sums[:] = 0
    computed = [
        prefixed_checksum(flat[row * HEADER_BYTES : (row + 1) * HEADER_BYTES], payload)
        for row, payload in enumerate(payloads)
    ]
    sums[:] = np.asarray(computed, dtype=np.uint64)


def _fill_fields(
    headers: np.ndarray,
    digests: np.ndarray,
    fingerprints: np.ndarray,
    payload_nbytes: np.ndarray,
    checksum: ChecksumPolicy,
) -> None:
    """Every header field but the checksum (left as it is: zero in a fresh array)."""
    words = headers.view("<u8")  # (n, 8), see _MAGIC_WORD
    kind = ChecksumKind.XXH3_64 if checksum == "xxh3" else ChecksumKind.NONE
    words[:, 0] = _MAGIC_WORD | FORMAT_VERSION << 32 | int(kind) << 48
    words[:, 1:3] = fingerprints
    words[:, 3] = digests
    words[:, 4] = payload_nbytes


def expected_prefixes(digests: np.ndarray, fingerprints: np.ndarray, payload_nbytes: np.ndarray) -> bytes:
    """Per row, the header an ``xxh3`` writer of this layout puts before the payload, with its
    checksum field zero (``HEADER_BYTES`` each, concatenated): what an object's checksum starts
    with whenever its header is the expected one. A reader hashes this and the payload as each
    object arrives (no header bytes to wait for or patch); :func:`intact_rows` accepts a row only
    when every other header word is the expected one, so that checksum is then the object's."""
    rows = np.zeros((len(digests), HEADER_BYTES), dtype=np.uint8)
    _fill_fields(rows, digests, fingerprints, payload_nbytes, "xxh3")
    return rows.tobytes()


def prefixed_checksum(prefix: bytes | memoryview, payload: Sequence[memoryview]) -> int:
    """xxh3_64 of ``prefix`` (a header with its checksum field zero) followed by the payload's
    byte views: :func:`object_checksum` for a header known in advance, in two hash updates."""
    hasher = xxhash.xxh3_64(prefix)
    for view in payload:
        hasher.update(view)
    return hasher.intdigest()


def intact_rows(
    headers: np.ndarray,
    read: np.ndarray,
    *,
    payload_nbytes: np.ndarray,
    fingerprints: np.ndarray,
    digests: np.ndarray,
    checksum: ChecksumPolicy,
    computed: np.ndarray,
    expected: np.ndarray | None = None,
) -> np.ndarray:
    """The batch fast path: which objects are, word for word, what this reader writes -- every one
    of them is an object :func:`verify_object` calls OK, found with a dozen array operations for
    the whole batch instead of a header unpacked per object. The other rows (damaged, foreign, a
    plain miss, or merely unusual, e.g. reserved bytes another writer set) need
    :func:`verify_object`, which alone decides their verdict.

    ``read``: bytes read per object; ``computed``: per complete object, the checksum of the
    expected header (:func:`expected_prefixes`) and the payload read (policy ``xxh3``), as its
    I/O thread or the caller computed it: the object's checksum wherever the row passes, since a
    row passes only when every other header word (reserved ones too) is the expected one.
    ``expected``: the :func:`expected_prefixes` of these rows as ``(n, 8)`` words, where the caller
    has them (policy ``xxh3``): then a row is one comparison with them, its checksum word set.
    """
    words = headers.view("<u8")  # (n, 8): the header's little-endian words
    complete = read == payload_nbytes + HEADER_BYTES
    if checksum == "xxh3":  # exactly the header this reader writes, with the checksum computed
        if expected is None:
            expected = np.frombuffer(expected_prefixes(digests, fingerprints, payload_nbytes), dtype="<u8")
        want = expected.reshape(len(words), HEADER_BYTES // 8).copy()
        want[:, _CHECKSUM_AT // 8] = computed
        return (words == want).all(axis=1) & complete
    # the reader checks everything but the checksum: either kind will do
    lead = words[:, 0]  # magic | version << 32 | checksum kind << 48
    intact = (lead & 0xFFFF_FFFF_FFFF) == _MAGIC_WORD | FORMAT_VERSION << 32
    intact &= (lead >> np.uint64(48)) <= max(_CHECKSUM_KINDS)
    intact &= words[:, 1] == fingerprints[:, 0]
    intact &= words[:, 2] == fingerprints[:, 1]
    intact &= words[:, 3] == digests
    intact &= words[:, 4] == payload_nbytes.astype(np.uint64)
    intact &= (words[:, 6] == 0) & (words[:, 7] == 0)  # reserved: what this reader writes
    return intact & complete
