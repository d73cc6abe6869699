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
from collections.abc import Callable, Sequence
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
#: The header as a numpy record: a whole batch of headers is built and checked field by field with
#: array operations (one pass per field over every object) instead of a ``struct`` call per object;
#: Python per-object work was most of the engine's cost around the bytes themselves.
HEADER_RECORD = np.dtype(
    {
        "names": ["magic", "version", "kind", "fp0", "fp1", "key_digest", "nbytes", "checksum"],
        "formats": ["<u4", "<u2", "<u2", "<u8", "<u8", "<u8", "<u8", "<u8"],
        "offsets": [0, 4, 6, 8, 16, 24, 32, _CHECKSUM_AT],
        "itemsize": HEADER_BYTES,
    }
)
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
    }
)
#: Verdicts that mean an intact object that is not what this reader stores under the key: another
#: layout (a layout change under the same model name), another format version, another key's
#: object. Counted apart from corruption, and removed too, so the key can be written again.
FOREIGN = frozenset({Verdict.BAD_VERSION, Verdict.FINGERPRINT_MISMATCH, Verdict.KEY_MISMATCH})


def stored_objects(spec: PoolSpec) -> tuple[tuple[str, int], ...]:
    """``(suffix, payload bytes)`` of every object stored per unit of ``spec``.

    A pool with no objects (no buffers: a logical anchor) still stores one header-only marker
    object per unit, so its pages can be committed and their existence gated like any other.
    """
    if not spec.objects:
        return ((MARKER_SUFFIX, 0),)
    return tuple((obj.suffix, spec.object_bytes(obj.suffix)) for obj in spec.objects)


def layout_fingerprint(spec: PoolSpec, suffix: str) -> bytes:
    """16-byte digest of everything that shapes one object's bytes (not the host layout)."""
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
    text = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"kvstrata-fp-v1").digest()


def _buffer_description(buffer: BufferSpec) -> list[object]:
    """What shapes a buffer's bytes. A head-major unit can have the token-major unit's shape
    (``kv_heads == page_size``), so the unit layout is named, but only when it is not the
    default: every fingerprint written before unit layouts existed stays the same."""
    described: list[object] = [buffer.name, buffer.dtype, buffer.layers, list(buffer.unit_shape)]
    if buffer.unit_layout is not None and buffer.unit_layout != UnitLayout.TOKEN_MAJOR:
        described.append(str(buffer.unit_layout))
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
    hasher.update(bytes(_CHECKSUM_FIELD.size))
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

#: Verdict codes of :func:`verify_headers`: the index of the verdict in this tuple (``OK`` is 0).
VERDICTS: tuple[Verdict, ...] = tuple(Verdict)
_CODE = {verdict: np.uint8(code) for code, verdict in enumerate(VERDICTS)}


def fingerprint_words(fingerprints: Sequence[bytes]) -> np.ndarray:
    """``(len(fingerprints), 2)`` uint64: each 16-byte fingerprint as the two words a header holds."""
    return np.frombuffer(b"".join(fingerprints), dtype="<u8").reshape(len(fingerprints), 2).copy()


def key_digests(keys: Sequence[str]) -> np.ndarray:
    """:func:`key_digest` of every key, as the uint64 array the batch checks compare against."""
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(key.encode()) for key in keys), dtype=np.uint64, count=len(keys))


def header_records(headers: np.ndarray) -> np.ndarray:
    """The ``(n, HEADER_BYTES)`` uint8 rows of a batch viewed as ``n`` :data:`HEADER_RECORD` s."""
    return headers.reshape(-1).view(HEADER_RECORD)


def fill_headers(
    headers: np.ndarray,
    *,
    digests: np.ndarray,
    fingerprints: np.ndarray,
    payload_nbytes: np.ndarray,
    payloads: Sequence[Sequence[BufferRegion]],
    checksum: ChecksumPolicy,
) -> None:
    """Write every header of a batch into ``headers`` (zeroed ``(n, HEADER_BYTES)`` uint8): the
    same bytes :func:`build_header` makes per object, the fields set for all rows at once."""
    records = header_records(headers)
    records["magic"] = _MAGIC_WORD
    records["version"] = FORMAT_VERSION
    records["kind"] = ChecksumKind.XXH3_64 if checksum == "xxh3" else ChecksumKind.NONE
    records["fp0"] = fingerprints[:, 0]
    records["fp1"] = fingerprints[:, 1]
    records["key_digest"] = digests
    records["nbytes"] = payload_nbytes
    if checksum != "xxh3":
        return
    flat = headers.reshape(-1).data
    sums = records["checksum"]  # a view: assignments land in ``headers``
    for row, payload in enumerate(payloads):
        start = row * HEADER_BYTES
        sums[row] = object_checksum(flat[start : start + HEADER_BYTES], payload)


def verify_headers(
    headers: np.ndarray,
    read: np.ndarray,
    *,
    payload_nbytes: np.ndarray,
    fingerprints: np.ndarray,
    digests: np.ndarray,
    checksum: ChecksumPolicy,
    computed: np.ndarray,
    have: np.ndarray,
    compute: Callable[[int], int],
) -> np.ndarray:
    """:func:`verify_object` for a whole batch: one verdict code (index into :data:`VERDICTS`) per
    object, the same verdict, in the same order of precedence, that it gives one object.

    ``read``: bytes read per object (negative: not found; its code means nothing). ``computed`` /
    ``have``: checksums the backend's I/O threads already computed over the bytes they read (see
    ``StorageBackend.get``'s ``check``); ``compute(row)`` supplies any other one that is needed.
    """
    records = header_records(headers)
    kind = records["kind"]
    expected = payload_nbytes.astype(np.uint64, copy=False)
    complete = (records["nbytes"] == expected) & (read == HEADER_BYTES + payload_nbytes.astype(np.int64))
    short = read < HEADER_BYTES
    bad_magic = records["magic"] != _MAGIC_WORD
    bad_version = (records["version"] != FORMAT_VERSION) | (kind > max(_CHECKSUM_KINDS))
    conditions = [short, bad_magic, bad_version]
    codes = [_CODE[Verdict.SHORT_READ], _CODE[Verdict.BAD_MAGIC], _CODE[Verdict.BAD_VERSION]]
    if checksum == "xxh3":
        missing = kind != ChecksumKind.XXH3_64
        checked = complete & ~(short | bad_magic | bad_version | missing)
        for row in np.flatnonzero(checked & ~have).tolist():  # not computed in an I/O thread
            computed[row] = compute(row)
        conditions += [missing, checked & (computed != records["checksum"])]
        codes += [_CODE[Verdict.CHECKSUM_MISSING], _CODE[Verdict.CHECKSUM_MISMATCH]]
    conditions += [
        (records["fp0"] != fingerprints[:, 0]) | (records["fp1"] != fingerprints[:, 1]),
        records["key_digest"] != digests,
        ~complete,
    ]
    codes += [
        _CODE[Verdict.FINGERPRINT_MISMATCH],
        _CODE[Verdict.KEY_MISMATCH],
        _CODE[Verdict.LENGTH_MISMATCH],
    ]
    return np.select(conditions, codes, default=_CODE[Verdict.OK]).astype(np.uint8, copy=False)
