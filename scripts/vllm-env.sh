# Sourced by scripts/vllm-tests.sh and scripts/vllm-e2e.sh (not run on its own): the shared set-up of a run on the
# vLLM 0.32.0 venv. Reads $tool (the caller's name, for messages) and $1 (BUILD_DIR, holding the built _pagedkv;
# default build-python); sets root, build, venv, py and out (BUILD_DIR/$tool, emptied) and exports the offline
# Hugging Face and import-path settings. Needs the venv scripts/install-deps.sh makes ($PAGEDKV_VLLM_VENV, default
# ~/.cache/pagedkv/vllm-0.32.0-venv).
: "${tool:?vllm-env.sh: set tool to the calling script name before sourcing (its output folder BUILD_DIR/tool is emptied)}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
build=$(cd "${1:-build-python}" && pwd)
venv=${PAGEDKV_VLLM_VENV:-${HOME:-/root}/.cache/pagedkv/vllm-0.32.0-venv}
py="$venv/bin/python"
[ -x "$py" ] || { echo "$tool: no vLLM venv at $venv (run scripts/install-deps.sh)" >&2; exit 1; }
[ -f "$build/python/pagedkv/vllm.py" ] || { echo "$tool: $build/python/pagedkv has no vllm.py (build _pagedkv)" >&2; exit 1; }
out="$build/$tool"
rm -rf "$out" && mkdir -p "$out"
export HF_HOME="$out/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$build/python:$root/python/vllm_compat"
