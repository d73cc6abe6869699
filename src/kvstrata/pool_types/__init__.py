"""Built-in pool types, one module each, registered through kvstrata's own entry points."""
