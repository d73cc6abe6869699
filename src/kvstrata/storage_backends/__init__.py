"""Built-in storage backends, one module each, registered through kvstrata's own entry points."""
