"""Adapters: kvstrata under other inference engines' cache interfaces.

Each adapter is a module that imports its engine (so importing this package imports nothing):

* :mod:`kvstrata.adapters.sglang` -- ``KvstrataHiCacheStorage``, SGLang's L3 storage backend
  (``--hicache-storage-backend dynamic``); see the README section "kvstrata as SGLang's L3".
* :mod:`kvstrata.adapters.hf` -- ``HFStateCache``, a restore / commit prefix cache for Hugging
  Face transformers models (the ``hf`` extra); see the README section "kvstrata under Hugging
  Face transformers".
"""
