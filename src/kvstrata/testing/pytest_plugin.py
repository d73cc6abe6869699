"""pytest plugin (entry point ``pytest11``): fixtures to build isolated plugin hosts.

``kvstrata_host`` gives a :class:`~kvstrata.plugins.PluginHost` that scanned entry points as
usual; ``kvstrata_bare_host`` one that scanned none, so a test registers exactly what it needs.
Register classes in-process with ``host.pool_types.register(cls)`` or through a hook plugin
(``host.register_plugin(obj)`` with ``kvstrata_register_*`` hooks).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstrata.plugins.host import PluginHost


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
