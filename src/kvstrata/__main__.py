"""``python -m kvstrata`` runs the CLI (handy from a source checkout: ``PYTHONPATH=src``)."""

from kvstrata.cli import main

main()
