"""Sphinx configuration of kvstrata's API reference (built from the docstrings; warnings are
errors in the test command: ``python -m sphinx -W --keep-going -b html docs/api OUT``)."""

from __future__ import annotations

project = "kvstrata"
extensions = ["sphinx.ext.autodoc"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures as written; annotations are strings under `from __future__`
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "alabaster"
exclude_patterns: list[str] = []
