"""What a Mooncake endpoint answers: the return codes the backend reacts to, and whether an
address accepts TCP and answers at all (probes that bound ``open``, ``close`` and calls after
an outage; see ``mooncake.py``)."""

from __future__ import annotations

import socket
import time
from enum import StrEnum

from kvstrata.plugins.errors import StorageError

#: Mooncake ``ErrorCode`` values the backend reacts to (see mooncake-store ``types.h``).
NO_AVAILABLE_HANDLE = -200  # segment full: the object was not stored
INVALID_PARAMS = -600
REPLICA_NOT_READY = -703  # another writer's put of this key is still in flight
OBJECT_NOT_FOUND = -704
#: Waits before re-reading objects that answered -703 (a put of the same key by another thread or
#: process is finishing; Mooncake reports success to the second writer at once). ~40 ms in all.
NOT_READY_BACKOFF_S = (0.001, 0.002, 0.004, 0.008, 0.025)
TRANSFER_FAIL = -800  # e.g. a multi-buffer read whose regions do not match the object size
RPC_FAIL = -900  # -9xx: master / client RPC failed
#: Mooncake refuses smaller segments ("Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
#: Returned by :meth:`MooncakeBackend.get` for an object the backend could not even try to read
#: (kvstrata's own code: Mooncake's -600 means a target smaller than the object).
STAGING_TOO_SMALL = -1600


def outage_code(code: int) -> bool:
    """Whether a code says the service did not answer -- an RPC failure (-9xx) or a master in
    high-availability transition (-10xx) -- rather than refusing one object: a file-offload
    error (-11xx), a bucket limit (-12xx), offload off (-13xx), a task limit (-14xx) or a
    tenant's quota (-17xx) is that key not stored, never an outage that opens the breaker."""
    return -1100 < code <= RPC_FAIL


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StorageError(f"mooncake address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def tcp_probe(address: str, timeout_s: float) -> str | None:
    """``None`` when ``address`` accepts a TCP connection within ``timeout_s``, else why not."""
    try:
        host, port = _split_address(address)
    except StorageError as exc:
        return str(exc)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{address} did not accept a TCP connection within {timeout_s:g} s ({exc})"


class Endpoint(StrEnum):
    ANSWERS = "answers"
    SILENT = "silent"  # accepts TCP, reads nothing: a stopped process, or a socket nobody serves
    UNREACHABLE = "unreachable"  # refused, or no TCP connection within the deadline


def check_endpoint(address: str, timeout_s: float) -> tuple[Endpoint, str]:
    """Whether a process at ``address`` reads what it is sent within ``timeout_s``, and why not.

    Mooncake's RPC services answer a malformed request (64 zero bytes) at once, by closing the
    connection or with an error frame; a stopped process, or a socket nobody serves, lets it sit
    in the kernel's buffers. Accepting TCP alone proves neither: the kernel accepts for them.
    """
    try:
        host, port = _split_address(address)
    except StorageError as exc:
        return Endpoint.UNREACHABLE, str(exc)
    deadline = time.monotonic() + timeout_s
    try:
        connection = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        return (
            Endpoint.UNREACHABLE,
            f"{address} did not accept a TCP connection within {timeout_s:g} s ({exc})",
        )
    with connection:
        try:
            connection.sendall(bytes(64))
            connection.settimeout(max(0.001, deadline - time.monotonic()))
            connection.recv(64)  # data or an orderly close: somebody read the request
        except TimeoutError:
            return Endpoint.SILENT, (
                f"{address} accepts connections but did not answer within {timeout_s:g} s "
                "(a stopped process, or not a Mooncake service?)"
            )
        except OSError:
            pass  # reset or broken pipe: the peer read the request and refused it
    return Endpoint.ANSWERS, f"{address} answers"


def answer_probe(address: str, timeout_s: float) -> str | None:
    """``None`` when the endpoint answers within ``timeout_s`` (:func:`check_endpoint`), else why not."""
    state, reason = check_endpoint(address, timeout_s)
    return None if state is Endpoint.ANSWERS else reason
