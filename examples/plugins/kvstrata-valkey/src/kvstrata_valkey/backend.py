"""``valkey``: one Valkey (or Redis) key per kvstrata object.

kvstrata hands a backend objects made of a key and memory regions (the integrity header first,
then the page's buffers). This backend joins the regions into one value on ``put`` and scatters
the value back into the regions on ``get``; it never looks inside, so a damaged or foreign value
is caught by kvstrata's header check and becomes a miss.

* ``SET key value NX``: a key appears whole or not at all (atomic visibility), and an existing
  key is never rewritten (equal keys carry equal bytes).
* Every call is one pipeline round trip for the whole batch; per-key errors fail that key only,
  but a server refusing the whole batch for what it is (a replica, loading, a failed save) fails
  the call, so kvstrata's breaker sees it.
* The server evicts on its own (``maxmemory`` + an ``allkeys-*`` policy), so a put may fail per
  key when it is full and an object may vanish later: both are misses, never wrong data.

Imports only ``kvstrata.plugins`` (the plugin API) and, inside :meth:`ValkeyBackend.open`, the
``valkey`` client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, field_validator

from kvstrata.plugins import (
    BackendCapabilities,
    BackendConfig,
    PoolCapabilities,
    StorageBackend,
    StorageError,
    StorageObject,
    region_views,
)

#: What ``get`` returns for a key that is not there (kvstrata reads any negative value as a miss).
MISS = -1
#: Valkey's and Redis's default ``proto-max-bulk-len``: the largest value one SET accepts.
MAX_VALUE_BYTES = 512 * 1024 * 1024
#: A Valkey (or Redis) Cluster's hash slots: a node serving all of them holds every key.
CLUSTER_SLOTS = 16384
#: The client's own requirement (pyproject.toml): the plugin itself is installed if kvstrata found it.
INSTALL = "pip install 'valkey>=6'"


class ValkeyConfig(BackendConfig):
    """What a user writes under ``tiers.storage.<name>`` (unknown fields are refused)."""

    type: Literal["valkey"] = "valkey"
    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description=(
            "server as redis://[user:password@]host:port/db (rediss:// for TLS), or a local one's "
            "socket as unix:///path/to/valkey.sock?db=N"
        ),
    )
    key_prefix: str = Field(default="kvstrata:", description="prepended to every key")
    socket_timeout_s: float = Field(default=5.0, gt=0, description="per call; a dead server fails fast")
    max_connections: int = Field(
        default=8,
        ge=1,
        description="connection pool size; a call finding all busy waits (up to socket_timeout_s)",
    )

    @field_validator("url")
    @classmethod
    def _standard_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme == "unix":  # the client's own form: the socket's path, the db as ?db=N
            return _unix_url(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(
                "expected redis://host:port/db, rediss://... or unix:///path?db=N, "
                f"got scheme {parts.scheme!r}"
            )
        if not parts.hostname:
            raise ValueError("the url names no host (redis://host:port/db)")
        try:
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        except ValueError as exc:
            # not the url itself: it may carry a password, and kvstrata.load()'s ConfigError (what
            # an engine logs) prints this message as it is; the field path names the setting
            raise ValueError(f"bad port: {exc}") from None
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ValueError(f"the database after the port must be a number, got {db!r}")
        if "decode_responses" in parse_qs(parts.query):
            # the client would decode every value as text: each get raised UnicodeDecodeError
            # while puts and exists still answered, so the L3 was written and never read
            raise ValueError("remove decode_responses from the url: values are binary objects, read as bytes")
        return url


def _unix_url(url: str) -> str:
    """A ``unix://`` url names a socket path (``unix:///run/valkey.sock?db=1``)."""
    parts = urlsplit(url)
    if not parts.path or parts.path == "/":
        raise ValueError("the url names no socket path (unix:///path/to/valkey.sock?db=N)")
    if parts.hostname:
        raise ValueError(
            f"a unix:// url names a path, not a host (unix:///path, three slashes), got {parts.hostname!r}"
        )
    query = parse_qs(parts.query)
    if any(not db.isdigit() for db in query.get("db", [])):
        raise ValueError(f"the database (?db=) must be a number, got {query['db']!r}")
    if "decode_responses" in query:
        raise ValueError("remove decode_responses from the url: values are binary objects, read as bytes")
    return url


def _cluster_slots(client: Any) -> int | None:
    """How many of the cluster's hash slots this server serves, or None when it is not a
    cluster node (or will not say: a user whose ACL refuses INFO or CLUSTER still connects)."""
    import valkey

    try:
        if not client.info("cluster").get("cluster_enabled"):
            return None
        nodes = client.execute_command("CLUSTER", "NODES")
    except valkey.exceptions.ResponseError:
        return None
    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8 or "myself" not in fields[2].split(","):
            continue
        if "master" not in fields[2].split(","):
            return 0  # a replica serves no slot itself: it redirects to its primary
        served = 0
        for item in fields[8:]:
            if item.startswith("["):  # a slot being migrated: still counted where it is
                continue
            low, _, high = item.partition("-")
            served += int(high or low) - int(low) + 1
        return served
    return None


class ValkeyBackend(StorageBackend):
    """Valkey / Redis through the official ``valkey`` client."""

    name = "valkey"
    Config = ValkeyConfig
    requires = {"valkey": INSTALL}  # checked by kvstrata before open(): a clear install hint
    capabilities = BackendCapabilities(
        pools={"*": PoolCapabilities(zero_copy=False)},  # values are bytes: kvstrata stages them
        batch_exists=True,
        multi_buffer_objects=True,
        atomic_visibility=True,
        overwrite="skip_existing",
        persistent=False,  # depends on the server's RDB/AOF settings: promise nothing
        shared_across_instances=True,
        self_evicting=True,
        removable=True,
        max_object_bytes=MAX_VALUE_BYTES,
    )

    config: ValkeyConfig

    def __init__(self, instance: str, config: BackendConfig) -> None:
        super().__init__(instance, config)
        self._client: Any = None
        self._pool: Any = None

    # -- lifecycle --------------------------------------------------------------------------------

    def open(self) -> None:
        import valkey  # the heavy import happens here, not when kvstrata lists plugins

        # A blocking pool: a call finding every connection busy waits for one (up to the timeout).
        # The client's default pool raises "Too many connections" instead, which failed whole
        # batches (and opened kvstrata's circuit breaker) whenever more threads called at once
        # than max_connections allows: kvstrata's writer, prefetcher and request threads do.
        timeout = self.config.socket_timeout_s
        pool = valkey.BlockingConnectionPool.from_url(
            self.config.url,
            max_connections=self.config.max_connections,
            timeout=timeout,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )
        self._pool = pool  # a client given a pool leaves it open on close(): close() does it
        self._client = valkey.Valkey(connection_pool=pool)
        reason = self.probe()
        if reason is not None:
            self.close()
            raise StorageError(f"valkey backend {self.instance!r}: {reason}")

    def close(self) -> None:
        client, pool = self._client, self._pool
        self._client = self._pool = None
        if client is not None:
            client.close()
        if pool is not None:
            pool.disconnect()

    def probe(self) -> str | None:
        client = self._client
        if client is None:
            import valkey

            timeout = self.config.socket_timeout_s  # a server that accepts and never answers, too
            client = valkey.Valkey.from_url(
                self.config.url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        try:
            client.ping()
            slots = _cluster_slots(client)
        except Exception as exc:  # any client error means "not reachable" for the doctor
            return f"{self._where()} unreachable: {type(exc).__name__}: {exc}"
        finally:
            if client is not self._client:
                client.close()
        if slots is not None and slots < CLUSTER_SLOTS:
            # every key of another node's slots answers MOVED: a refused put, a miss on get, per
            # key, so a cluster of N shards silently kept about 1/N of what kvstrata stored
            return (
                f"{self._where()} is a Valkey Cluster node serving {slots} of {CLUSTER_SLOTS} hash "
                "slots: this backend talks to one server (keys in the other slots would answer "
                "MOVED); point it at a standalone server or a one-shard cluster's primary"
            )
        return None

    def _where(self) -> str:
        parts = urlsplit(self.config.url)
        if parts.scheme == "unix":
            db = parse_qs(parts.query).get("db", ["0"])[0]
            return f"unix://{parts.path}?db={db}"  # never the password (unix://:pw@/path)
        return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or ''}"

    def _key(self, key: str) -> str:
        return self.config.key_prefix + key

    def _pipeline(self) -> Any:
        client = self._client  # read once: close() on another thread clears it
        if client is None:
            raise RuntimeError(f"valkey backend {self.instance!r} is not open")
        return client.pipeline(transaction=False)

    # -- the data path: one round trip per batch --------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._pipeline()
        for key in keys:
            pipe.exists(self._key(key))
        return [result is True or result == 1 for result in self._read(pipe)]

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        pipe = self._pipeline()
        for obj in objects:
            pipe.set(self._key(obj.key), b"".join(region_views(obj.regions)), nx=True)
        # True: stored now; None: the key existed (NX), equal bytes by construction; an exception
        # (out of memory, value too large): that key failed
        return [not isinstance(result, Exception) for result in self._write(pipe)]

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        pipe = self._pipeline()
        for obj in objects:
            pipe.get(self._key(obj.key))
        results = []
        for obj, value in zip(objects, self._read(pipe), strict=True):
            if isinstance(value, Exception) and str(value).startswith("WRONGTYPE"):
                # another type (a list, a hash) under our key: found, zero bytes of an object, so
                # kvstrata counts it as damage and removes it (a miss would keep it forever: puts
                # with NX leave an existing key alone)
                results.append(0)
                continue
            if value is None or isinstance(value, Exception):
                results.append(MISS)
                continue
            data = memoryview(value)
            done = 0
            for view in region_views(obj.regions):  # scatter into the regions, in order
                take = min(len(view), len(data) - done)
                if take <= 0:
                    break
                view[:take] = data[done : done + take]
                done += take
            results.append(done)  # short when the value is: kvstrata's length check makes it a miss
        return results

    def _read(self, pipe: Any) -> list[Any]:
        """A read pipeline's answers, one per command. A server that refused every command of
        the batch (a replica whose master is down: MASTERDOWN; LOADING after a restart) fails the
        call: read as misses, it looked like a cold cache, so kvstrata's breaker never opened and
        every request paid the round trip. Another type under a key (WRONGTYPE) is that key's."""
        answers = pipe.execute(raise_on_error=False)
        refused = [a for a in answers if isinstance(a, Exception) and not str(a).startswith("WRONGTYPE")]
        if answers and len(refused) == len(answers):
            raise StorageError(
                f"valkey backend {self.instance!r}: the server refused every read: {refused[0]}"
            )
        return answers

    def _write(self, pipe: Any) -> list[Any]:
        """A write pipeline's answers, one per command. A server refusing every write of the
        batch for what it is, not for the objects (a replica: READONLY; MISCONF after a failed
        save; MASTERDOWN; an ACL: NOPERM) fails the call: answered per key, kvstrata's write
        breaker never opened, the writer shipped every value again, and the lost writes were not
        offered again once the server took writes. Out of memory stays per key: the server is
        full (or the object too large for it), a refusal of those objects."""
        import valkey

        answers = pipe.execute(raise_on_error=False)
        refused = [a for a in answers if isinstance(a, Exception)]
        full = [a for a in refused if isinstance(a, valkey.exceptions.OutOfMemoryError)]
        if answers and len(refused) == len(answers) and not full:
            first = refused[0]
            raise StorageError(
                f"valkey backend {self.instance!r}: the server refused every write: "
                f"{type(first).__name__}: {first}"
            )
        return answers

    def remove(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._pipeline()
        for key in keys:
            pipe.delete(self._key(key))
        return [not isinstance(result, Exception) for result in self._write(pipe)]

    # -- for kvstrata's conformance kit: damage an object on demand -------------------------------

    def corrupt_for_test(self, key: str, mode: Literal["flip", "truncate"], offset: int = -1) -> bool:
        """Flip one byte or cut the value in half (tests only; never called by kvstrata itself)."""
        if self._client is None:
            return False
        value = self._client.get(self._key(key))
        if not value:
            return False
        data = bytearray(value)
        if mode == "flip":
            data[offset] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        self._client.set(self._key(key), bytes(data))
        return True
