"""pytest plugin (entry point ``pytest11``): fixtures to build isolated plugin hosts.

``kvstrata_host`` gives a :class:`~kvstrata.plugins.PluginHost` that scanned entry points as
usual; ``kvstrata_bare_host`` one that scanned none, so a test registers exactly what it needs.
Register classes in-process with ``host.pool_types.register(cls)`` or through a hook plugin
(``host.register_plugin(obj)`` with ``kvstrata_register_*`` hooks).

``mooncake_master`` / ``mooncake_standalone_client`` (session scope) run the REAL Mooncake binaries
on free loopback ports (see :mod:`kvstrata.testing.mooncake_servers`); their log tails are attached
to the report of any failing test that used them. ``mooncake_inprocess_config`` /
``mooncake_standalone_config`` give ready ``MooncakeConfig`` objects for them, so a conformance
subclass only needs ``MooncakeBackend(instance, mooncake_inprocess_config)`` in its factory.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

# The kits' asserts show their values (``assert 5 == 3``) only when pytest rewrites the kit
# modules, and only modules marked before their first import are rewritten: mark them here,
# before anything imports them (the package itself is already imported, so name the modules).
_KIT_MODULES = (
    "_allocator_kit",
    "_backend_kit",
    "_lifecycle_kit",
    "conformance",
    "conformance_optional",
    "faults",
    "policy_kit",
    "pool_kit",
)
pytest.register_assert_rewrite(*(f"kvstrata.testing.{module}" for module in _KIT_MODULES))

from kvstrata.plugins.host import PluginHost  # noqa: E402
from kvstrata.storage_backends.mooncake import MooncakeConfig  # noqa: E402
from kvstrata.testing.mooncake_servers import (  # noqa: E402
    ManagedProcess,
    MooncakeMaster,
    MooncakeStandaloneClient,
)


@pytest.fixture
def kvstrata_host() -> Iterator[PluginHost]:
    """A fresh host with the installed entry-point plugins (no state shared between tests)."""
    host = PluginHost(autoload=True, disabled=set())
    yield host
    host.close()


@pytest.fixture
def kvstrata_bare_host() -> Iterator[PluginHost]:
    """A fresh host that scanned no entry points: only what the test registers exists."""
    host = PluginHost(autoload=False, disabled=set())
    yield host
    host.close()


# -- Mooncake: real processes on free loopback ports, started once per session -----------------


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A real ``mooncake_master`` (HTTP metadata server, 500 ms leases) stopped by PID at the end."""
    master = MooncakeMaster(log_dir=tmp_path_factory.mktemp("mooncake-master"))
    master.start()
    yield master
    _stop_reporting_crash(master.process)


@pytest.fixture(scope="session")
def mooncake_standalone_client(
    mooncake_master: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MooncakeStandaloneClient]:
    """A real ``mooncake_client`` with a 256 MiB segment, for standalone-mode (setup_dummy) tests."""
    client = MooncakeStandaloneClient(
        mooncake_master, segment_bytes=256 << 20, log_dir=tmp_path_factory.mktemp("mooncake-client")
    )
    client.start()
    yield client
    _stop_reporting_crash(client.process)


def _stop_reporting_crash(process: ManagedProcess) -> None:
    crashed = process.popen is not None and not process.alive()
    process.stop()
    if crashed:
        warnings.warn(
            f"{process.name} (pid {process.pid}) died during the session; log tail:\n{process.log_tail()}",
            stacklevel=2,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach the Mooncake process logs to a failing test that used them."""
    report = yield
    if report.failed:
        funcargs = getattr(item, "funcargs", {})
        for fixture in ("mooncake_master", "mooncake_standalone_client"):
            server = funcargs.get(fixture)
            if server is not None:
                report.sections.append((f"{fixture} log tail", server.process.log_tail()))
    return report


@pytest.fixture
def mooncake_inprocess_config(mooncake_standalone_client: MooncakeStandaloneClient) -> MooncakeConfig:
    """Config of an in-process Mooncake client (``setup``) against the session master.

    It contributes no segment of its own: objects land in the session ``mooncake_client``'s
    256 MiB segment, which outlives every backend instance. (An in-process client's own segment
    leaves the pool with it on ``close()``, taking its objects along.)
    """
    return mooncake_standalone_client.master.backend_config(segment_bytes=0, local_buffer_bytes=0)


@pytest.fixture
def mooncake_standalone_config(mooncake_standalone_client: MooncakeStandaloneClient) -> MooncakeConfig:
    """Config of a standalone (setup_dummy) client talking to the session ``mooncake_client``."""
    master = mooncake_standalone_client.master
    return mooncake_standalone_client.backend_config(
        master=master.address, metadata_server=master.metadata_url, local_buffer_bytes=1 << 20
    )
