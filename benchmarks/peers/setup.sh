#!/usr/bin/env bash
# Install the peer environments the benchmarks in benchmarks/peers/ compare kvstrata against.
#
#   benchmarks/peers/setup.sh [sglang] [lmcache]     (no argument: both)
#
# PYTHON          interpreter of kvstrata's environment (default: python3). SGLang goes there:
#                 its mem_cache modules run inside the benchmark's peer worker, loaded on CPU by
#                 kvstrata.testing.sglang_cpu.
# KVSTRATA_PEERS  where LMCache's own virtual environment is made (default ~/.cache/kvstrata-peers);
#                 run its workers with $KVSTRATA_PEERS/lmcache/bin/python.
#
# torch stays pinned to 2.13.0 everywhere: a loose requirement pulls several GB of CUDA wheels.
set -euo pipefail

PYTHON=${PYTHON:-python3}
PEERS=${KVSTRATA_PEERS:-$HOME/.cache/kvstrata-peers}
TORCH='torch==2.13.0'
SGLANG='sglang==0.5.23'
LMCACHE='lmcache==0.5.6'

targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(sglang lmcache)
fi

setup_sglang() {
  # --no-deps: SGLang's metadata pins a CUDA torch and its whole serving stack. Its mem_cache
  # modules (HiCacheFile, the host pools, the storage backend factory) import one package beyond
  # kvstrata's own dependencies: msgspec. The GPU-only modules they import at module level are
  # served as stand-ins by kvstrata.testing.sglang_cpu.
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps "$SGLANG"
  "$PYTHON" -m pip install -q --disable-pip-version-check msgspec "$TORCH"
  PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c '
from kvstrata.testing.sglang_cpu import load_sglang_mem_cache
print("sglang: HiCacheFile importable:", load_sglang_mem_cache().HiCacheFile.__name__)'
}

setup_lmcache() {
  # A virtual environment of its own: LMCache 0.5.6 pins numpy<=2.2.6, transformers>=5.4,
  # setuptools<81 and more, which kvstrata's environment need not follow. It sees the system
  # site-packages so the pinned torch is reused, never replaced. Its CUDA-only dependencies
  # (cupy-cuda13x, cuda-python, cufile-python, nvtx; about 100 MB) install on a CPU-only machine
  # and stay unused: LMCache 0.5.6 imports there and picks its CPU device stub.
  "$PYTHON" -m venv --system-site-packages "$PEERS/lmcache"
  "$PEERS/lmcache/bin/python" -m pip install -q --disable-pip-version-check "$LMCACHE" "$TORCH"
  "$PEERS/lmcache/bin/python" -c '
import lmcache, torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: F401
print("lmcache:", lmcache.__name__, "importable with torch", torch.__version__)'
}

for target in "${targets[@]}"; do
  case "$target" in
    sglang) setup_sglang ;;
    lmcache) setup_lmcache ;;
    *) echo "unknown peer '$target' (choose: sglang lmcache)" >&2; exit 2 ;;
  esac
done
