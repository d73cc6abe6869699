"""kvstrata's conformance kit against a real server, plus the config and availability checks a
plugin should have. Needs ``valkey-server`` or ``redis-server`` on PATH."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvstrata_valkey import ValkeyBackend, ValkeyConfig
from kvstrata_valkey.testing import LOOPBACK, ValkeyServer, free_loopback_port
from pydantic import ValidationError

from kvstrata.plugins import (
    BufferRegion,
    MissingDependencyError,
    PluginHost,
    StorageBackend,
    StorageError,
    StorageObject,
)
from kvstrata.testing.conformance import BackendConformance


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as running:
        yield running


def opened(instance: str, url: str) -> ValkeyBackend:
    backend = ValkeyBackend(instance, ValkeyConfig(url=url))
    backend.open()
    return backend


class TestValkeyConformance(BackendConformance):
    """Every check of the kit, through kvstrata's real storage engine, against the server."""

    @pytest.fixture
    def backend_factory(self, server: ValkeyServer) -> Callable[[str], StorageBackend]:
        return lambda instance: opened(instance, server.url)


def test_entry_point_makes_it_a_kvstrata_backend() -> None:
    host = PluginHost(autoload=True, disabled=set())
    entry = host.storage_backends.entry("valkey")
    assert entry.provider == "kvstrata-valkey"
    assert host.storage_backends.require("valkey") is ValkeyBackend


def test_a_missing_valkey_client_names_the_command_that_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin is installed (kvstrata found it) but its client is not: the hint is the client's
    own requirement, not a reinstall of the plugin that pip would call already satisfied."""
    monkeypatch.setitem(sys.modules, "valkey", None)  # what find_spec reports as not importable
    host = PluginHost(autoload=True, disabled=set())
    with pytest.raises(MissingDependencyError) as info:
        host.storage_backends.require("valkey")
    assert "pip install 'valkey>=6'" in str(info.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"url": "http://127.0.0.1:6379/0"}, "scheme"),
        ({"url": "redis://127.0.0.1:6379/x"}, "must be a number"),
        ({"url": "redis://:6379/0"}, "no host"),
        ({"url": "redis://127.0.0.1:6379/0?decode_responses=True"}, "remove decode_responses"),
        ({"url": "unix://"}, "no socket path"),
        ({"url": "unix://localhost/run/valkey.sock"}, "not a host"),
        ({"url": "unix:///run/valkey.sock?db=x"}, "must be a number"),
        ({"host": "127.0.0.1"}, "Extra inputs are not permitted"),
    ],
)
def test_config_refuses_bad_urls_and_unknown_fields(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ValkeyConfig(**fields)


def test_a_unix_socket_url_reaches_the_same_server(tmp_path: Path) -> None:
    """The client speaks ``unix:///path?db=N`` (a local server without TCP's cost); the url
    check refused every scheme but redis:// and rediss://."""
    with ValkeyServer(tmp_path / "s", unixsocket=True) as running:
        over_socket = opened("l3", running.unix_url)
        over_tcp = opened("l3", running.url)
        try:
            payload = (ctypes.c_char * 64).from_buffer_copy(bytes(range(64)))
            stored = over_socket.put([StorageObject("u", (BufferRegion(ctypes.addressof(payload), 64),))])
            assert stored == [True]
            target = (ctypes.c_char * 64)()
            assert over_tcp.get([StorageObject("u", (BufferRegion(ctypes.addressof(target), 64),))]) == [64]
            assert target.raw == payload.raw
        finally:
            over_socket.close()
            over_tcp.close()
        url = f"unix://:s3cret@{tmp_path}/none.sock"
        missing = ValkeyBackend("l3", ValkeyConfig(url=url, socket_timeout_s=0.5))
        reason = missing.probe() or ""
        assert f"unix://{tmp_path}/none.sock?db=0 unreachable" in reason and "s3cret" not in reason


def test_a_bad_url_error_never_prints_its_password(tmp_path: Path) -> None:
    """``kvstrata.load`` (what an engine calls, and logs the error of) raises the validator's
    message unmasked: the bad-port message quoted the whole url, password included."""
    import kvstrata

    config = tmp_path / "stack.yaml"
    config.write_text(
        "model: {name: demo, page_size: 16, pools: {kv: {type: kv, layers: 1, kv_heads: 1, head_dim: 8}}}\n"
        "tiers: {storage: {l3: {type: valkey, url: 'redis://kv:s3cret@127.0.0.1:abc/0'}}}\n"
    )
    with pytest.raises(kvstrata.ConfigError, match=r"tiers\.storage\.l3\.url.*bad port") as info:
        kvstrata.load(config)
    assert "s3cret" not in str(info.value)


def test_unreachable_server_fails_open_with_the_address(tmp_path: Path) -> None:
    from kvstrata_valkey.testing import free_loopback_port

    url = f"redis://127.0.0.1:{free_loopback_port()}/0"
    backend = ValkeyBackend("l3", ValkeyConfig(url=url, socket_timeout_s=0.5))
    assert "unreachable" in (backend.probe() or "")
    with pytest.raises(StorageError, match="unreachable"):
        backend.open()


def test_a_value_of_another_type_under_a_key_is_found_short_and_removable(server: ValkeyServer) -> None:
    # a list under our key: GET fails with WRONGTYPE, which was a plain miss on every read while
    # puts (SET NX) left the key alone and reported it stored: the page was never cached again
    import ctypes

    import valkey

    from kvstrata.plugins import BufferRegion, StorageObject

    backend = opened("wrongtype", server.url)
    try:
        raw = valkey.Valkey.from_url(server.url)
        raw.rpush(backend._key("page-0"), b"not an object")
        target = ctypes.create_string_buffer(64)
        region = BufferRegion(ctypes.addressof(target), 64)
        assert backend.get([StorageObject("page-0", (region,))]) == [0], "found, zero bytes of an object"
        assert backend.remove(["page-0"]) == [True] and raw.type(backend._key("page-0")) == b"none"
        raw.close()
    finally:
        backend.close()


def test_probe_before_open_bounds_its_reads_by_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvstrata doctor`` and ``replay`` probe an unopened backend: its client had no read
    timeout, so a server that accepts and never answers held the probe for the client's default
    (5 s measured with ``socket_timeout_s=0.5``), not the setting."""
    import valkey

    made: list[dict[str, object]] = []
    real = valkey.Valkey.from_url

    def recorded(url: str, **kwargs: object) -> valkey.Valkey:
        made.append(kwargs)
        return real(url, **kwargs)

    monkeypatch.setattr(valkey.Valkey, "from_url", recorded)
    from kvstrata_valkey.testing import free_loopback_port

    url = f"redis://127.0.0.1:{free_loopback_port()}/0"
    backend = ValkeyBackend("l3", ValkeyConfig(url=url, socket_timeout_s=0.5))
    assert "unreachable" in (backend.probe() or "")
    assert made and made[0]["socket_timeout"] == 0.5 and made[0]["socket_connect_timeout"] == 0.5


def test_more_callers_than_connections_wait_for_one(server: ValkeyServer) -> None:
    """kvstrata calls a backend from several threads at once (writer, prefetcher, request path).
    The client's default pool raised ``ConnectionError('Too many connections')`` for a call that
    found every connection busy, failing the whole batch; the pool now makes it wait."""
    import ctypes
    import threading

    from kvstrata.plugins import BufferRegion, StorageObject

    backend = ValkeyBackend("pool", ValkeyConfig(url=server.url, max_connections=1))
    backend.open()
    payload = ctypes.create_string_buffer(b"v" * 65536, 65536)
    errors: list[str] = []
    answers: list[bool] = []

    def work(index: int) -> None:
        objects = [
            StorageObject(f"pool-{index}-{i}", (BufferRegion(ctypes.addressof(payload), 65536),))
            for i in range(8)
        ]
        for _ in range(10):
            try:
                answers.extend(backend.put(objects))
                answers.extend(count == 65536 for count in backend.get(objects))
            except Exception as exc:
                errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        backend.close()
    assert not errors, f"{len(errors)} calls failed: {errors[:3]}"
    assert answers and all(answers)


def test_a_server_refusing_every_read_fails_the_call_not_a_cold_cache(tmp_path: Path) -> None:
    """A replica whose master is down (``replica-serve-stale-data no``) answers MASTERDOWN to
    every read: the call fails (kvstrata's breaker counts it), where it read as all misses."""
    import valkey

    with ValkeyServer(tmp_path / "server") as running:
        backend = opened("l3", running.url)
        admin = valkey.Valkey.from_url(running.url)
        try:
            assert backend.exists(["k"]) == [False]  # answered: a real miss
            admin.config_set("replica-serve-stale-data", "no")
            admin.replicaof(LOOPBACK, free_loopback_port())  # nothing listens there
            with pytest.raises(StorageError, match=r"refused every read.*MASTERDOWN"):
                backend.exists(["k", "j"])
            target = (ctypes.c_char * 8)()
            with pytest.raises(StorageError, match="MASTERDOWN"):
                backend.get([StorageObject("k", (BufferRegion(ctypes.addressof(target), 8),))])
            admin.replicaof("NO", "ONE")
            assert backend.exists(["k"]) == [False]  # the server answers again
        finally:
            admin.close()
            backend.close()


def test_a_server_refusing_every_write_fails_the_call_but_a_full_one_refuses_per_key(tmp_path: Path) -> None:
    """A replica answers READONLY to every write: the put fails (kvstrata's write breaker counts
    it, the writer offers the pages again later), where it read as each object refused. A full
    server (``noeviction``) still refuses per key, and what it holds reads back exact."""
    import valkey

    payload = (ctypes.c_char * 4096).from_buffer_copy(b"p" * 4096)

    def objects(*keys: str) -> list[StorageObject]:
        return [StorageObject(key, (BufferRegion(ctypes.addressof(payload), 4096),)) for key in keys]

    with ValkeyServer(tmp_path / "server", maxmemory="2mb") as running:
        backend = opened("l3", running.url)
        admin = valkey.Valkey.from_url(running.url)
        try:
            assert backend.put(objects("a")) == [True]
            admin.replicaof(LOOPBACK, free_loopback_port())  # nothing listens there
            with pytest.raises(StorageError, match="refused every write: ReadOnlyError"):
                backend.put(objects("b", "c"))
            with pytest.raises(StorageError, match="ReadOnlyError"):
                backend.remove(["a"])
            admin.replicaof("NO", "ONE")
            assert backend.put(objects("b")) == [True]  # writes are taken again
            admin.config_set("maxmemory-policy", "noeviction")
            answers = backend.put(objects(*(f"fill-{i}" for i in range(1000))))
            assert 0 < answers.count(True) < len(answers), "some stored, then refused per key"
            # full: answered per key, not raised (whether these two fit depends on what the server
            # freed since -- its replication backlog, client buffers -- so only the shape is checked)
            assert len(backend.put(objects("late-1", "late-2"))) == 2
            target = (ctypes.c_char * 4096)()
            got = backend.get([StorageObject("fill-0", (BufferRegion(ctypes.addressof(target), 4096),))])
            assert got == [4096] and target.raw == payload.raw
        finally:
            admin.close()
            backend.close()


def test_a_node_of_a_cluster_of_several_shards_is_refused_at_open(tmp_path: Path) -> None:
    """Keys in another node's hash slots answer MOVED: each was a refused put and a miss, so a
    backend pointed at one node of an N-shard cluster silently kept about 1/N of what it stored.
    ``open`` (and ``kvstrata doctor``'s probe) now say so; a one-shard cluster serves every key."""
    import time

    import valkey

    buses: dict[str, int] = {}

    def node(name: str) -> ValkeyServer:
        conf = tmp_path / name / "nodes.conf"
        # the bus port defaults to port + 10000, past 65535 for a high free port
        buses[name] = free_loopback_port()
        bus = ("--cluster-port", str(buses[name]))
        return ValkeyServer(
            tmp_path / name, extra_args=("--cluster-enabled", "yes", "--cluster-config-file", str(conf), *bus)
        )

    with node("a") as first, node("b") as second:
        a, b = valkey.Valkey.from_url(first.url), valkey.Valkey.from_url(second.url)
        try:
            a.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 8191)
            b.execute_command("CLUSTER", "ADDSLOTSRANGE", 8192, 16383)
            a.execute_command("CLUSTER", "MEET", LOOPBACK, second.port, buses["b"])
            deadline = time.monotonic() + 10
            while b"cluster_state:ok" not in a.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the two nodes never formed a cluster"
                time.sleep(0.1)
            backend = ValkeyBackend("l3", ValkeyConfig(url=first.url))
            with pytest.raises(StorageError, match="Cluster node serving 8192 of 16384 hash slots"):
                backend.open()
        finally:
            a.close()
            b.close()
    with node("c") as alone:
        c = valkey.Valkey.from_url(alone.url)
        try:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            backend = ValkeyBackend("l3", ValkeyConfig(url=alone.url))
            assert backend.probe() is None, "one node serving every slot holds every key"
        finally:
            c.close()


def test_config_show_masks_the_url_password_unless_asked(tmp_path: Path) -> None:
    """``kvstrata config show`` lands in terminals and CI logs: a ``url``'s password is ``***``
    (it was printed in full), and ``--reveal-secrets`` prints it for a config meant to be reused."""
    import json
    import subprocess

    url = "redis://kv:s3cret@127.0.0.1:6379/0"
    config = tmp_path / "stack.yaml"
    config.write_text(
        "model: {name: demo, page_size: 16, pools: {kv: {type: kv, layers: 1, kv_heads: 1, head_dim: 8}}}\n"
        f"tiers: {{storage: {{l3: {{type: valkey, url: '{url}'}}}}}}\n"
    )

    def show(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kvstrata", "config", "show", str(config), "--json", *extra]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    masked = show()
    assert masked.returncode == 0, masked.stderr
    assert "s3cret" not in masked.stdout + masked.stderr
    assert json.loads(masked.stdout)["tiers"]["storage"]["l3"]["url"] == "redis://kv:***@127.0.0.1:6379/0"
    assert "1 URL password(s) shown as ***" in masked.stderr
    revealed = show("--reveal-secrets")
    assert json.loads(revealed.stdout)["tiers"]["storage"]["l3"]["url"] == url
