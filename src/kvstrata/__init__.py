"""kvstrata: a hierarchical (device / host / storage) state cache for hybrid LLM inference.

Pool types and storage backends are plugins found through entry points; see
``kvstrata.plugins`` for the contracts and ``kvstrata.hookspecs`` for the hooks.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

#: Decorate hook implementations with this marker (``@kvstrata.hookimpl``).
hookimpl = pluggy.HookimplMarker("kvstrata")

__all__ = ["__version__", "hookimpl"]
