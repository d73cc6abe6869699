"""The engine-agnostic core. It reads pool specs and backend capabilities; it never names a plugin."""
