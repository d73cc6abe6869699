#!/usr/bin/env bash
# The GPU checks, in one call on a machine with a CUDA device (run from the repository root):
# the pool, controller and vLLM-worker tests with KVSTRATA_TEST_DEVICE=cuda, then the
# device <-> host benchmarks (kvstrata's pools, the vLLM connector's staging path, the bus).
#
# The machine's own python3 and torch are used. Where kvstrata's dependencies are missing there,
# bring them as wheels in .whl/ (pydantic, pydantic-settings, stevedore, platformdirs, transformers
# 5.23 for the HF adapter's tests, and a wheel of kvstrata itself for its entry points:
# `pip wheel --no-deps --no-build-isolation -w .whl .`); they are installed into that python's
# environment (the machine is a scratch one; child processes of the tests see them too). Logs and
# JSON results go to $OUT (default: gpu-out/).
set -u
OUT=$(realpath -m "${OUT:-gpu-out}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD/src"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max \
  --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"

workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 4)
set -o pipefail
KVSTRATA_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not mooncake" "${workers[@]}" \
  tests/test_pools_*.py tests/test_transfer*.py tests/test_controller*.py tests/test_adapter_vllm_worker.py \
  tests/test_write_through_batches.py 2>&1 | tee "$OUT/tests.log" | tail -60
echo "tests rc=$?"
# the HF adapter with the model on the GPU (needs transformers 5.23: bring its wheel in .whl/)
KVSTRATA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider "${workers[@]}" tests/test_adapter_hf.py \
  -k "round_trips_in_process or 37_of_50 or private_copies or multi_page_chunks or generate_runs or prefill_restores" \
  2>&1 | tee "$OUT/tests_hf.log" | tail -30
echo "hf tests rc=$?"

cd benchmarks || exit 1
timeout 120 python3 pools.py --device cuda --repeats 9 --json "$OUT/pools.json" 2>&1 | tee "$OUT/pools.txt"
timeout 120 python3 pools.py --device cuda --repeats 9 --pages 512 --batch 128 2>&1 | tee "$OUT/pools_large.txt"
timeout 120 python3 vllm_staging.py --device cuda --json "$OUT/vllm_staging.json" 2>&1 | tee "$OUT/vllm_staging.txt"
