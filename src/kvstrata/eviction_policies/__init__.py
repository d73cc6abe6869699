"""Built-in eviction policies, one file each, found through the ``kvstrata.eviction_policies``
entry points like any third-party policy. They import only :mod:`kvstrata.plugins`."""
