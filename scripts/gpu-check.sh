#!/usr/bin/env bash
# scripts/gpu-check.sh: the one command to run on a GPU machine. Configures the CUDA part standalone (cmake -S cuda:
# kernels + CPU reference + GPU tests + benchmark, headers only: no OpenSSL, xxHash or Debian packages needed),
# builds it with ninja (Release, sm_90 unless CMAKE_CUDA_ARCHITECTURES is set), runs the GPU tests and the kernel
# benchmark, and writes everything to $OUT (or benchmarks/results/<date>-<device>/ when OUT is unset):
#   env.json (device, driver, nvcc), configure.log, build.log (with ptxas register/spill reports), tests.log,
#   bench.json + bench.txt, summary.json, summary.txt (table).
# Prerequisite on the GPU machine: Catch2 installed, or .gpu-deps/ staged by scripts/stage-gpu-deps.sh and carried.
# Exit status: 0 when the build and every GPU test pass; the benchmark runs even if a test fails.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="/usr/local/cuda/bin:$PATH"

device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)
nvcc_version=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*, V[0-9.]*' || true)
device=${device:-unknown}
out=${OUT:-}
if [[ -z "$out" ]]; then
  out="$root/benchmarks/results/$(date +%Y-%m-%d)-$(echo "$device" | tr -c 'A-Za-z0-9_.\n-' '-')"
fi
mkdir -p "$out"
build=${PAGEDKV_GPU_BUILD_DIR:-$root/build-gpu}
arch=${CMAKE_CUDA_ARCHITECTURES:-90}
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)

json_str() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g'; }
printf '{"device": "%s", "driver": "%s", "nvcc": "%s", "cuda_architectures": "%s", "date": "%s"}\n' \
  "$(json_str "$device")" "$(json_str "$driver")" "$(json_str "$nvcc_version")" "$arch" "$(date -u +%FT%TZ)" \
  > "$out/env.json"
echo "gpu-check: $device, driver $driver, nvcc $nvcc_version -> $out"

start=$(date +%s)
if ! cmake -S "$root/cuda" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
     -DPAGEDKV_BUILD_TESTS=ON -DPAGEDKV_BUILD_BENCHMARKS=ON -DPAGEDKV_CUDA_PTXAS_VERBOSE=ON \
     > "$out/configure.log" 2>&1; then
  tail -n 30 "$out/configure.log"
  echo "gpu-check: configure failed" >&2
  exit 1
fi
if ! cmake --build "$build" -j "$(nproc)" > "$out/build.log" 2>&1; then
  grep -E 'error|Error' "$out/build.log" | head -n 30
  echo "gpu-check: build failed" >&2
  exit 1
fi
build_s=$(( $(date +%s) - start ))
grep -E "Compiling entry|registers|spill" "$out/build.log" > "$out/ptxas.txt" || true

tests_rc=0
ctest --test-dir "$build" --output-on-failure -L 'gpu|cuda_host' > "$out/tests.log" 2>&1 || tests_rc=$?
tests_line=$(grep -E 'tests passed|tests failed' "$out/tests.log" | tail -n1)
tests_skipped=$(grep -c '(Skipped)' "$out/tests.log" || true)

bench_rc=0
bench_bin="$build/benchmarks/bench_kernels"
if [[ -x "$bench_bin" ]]; then
  "$bench_bin" --json "$out/bench.json" > "$out/bench.txt" 2>&1 || bench_rc=$?
else
  echo "bench_kernels not built" > "$out/bench.txt"
  bench_rc=1
fi

{
  printf '{\n  "env": %s,\n' "$(cat "$out/env.json")"
  printf '  "build_seconds": %d,\n  "tests_rc": %d,\n  "tests": "%s",\n  "tests_skipped": %d,\n  "bench_rc": %d,\n' \
    "$build_s" "$tests_rc" "$(json_str "$tests_line")" "$tests_skipped" "$bench_rc"
  if [[ -s "$out/bench.json" ]]; then printf '  "bench": %s\n' "$(cat "$out/bench.json")"; else printf '  "bench": null\n'; fi
  printf '}\n'
} > "$out/summary.json"

{
  echo "device: $device | driver: $driver | nvcc: $nvcc_version | sm_$arch | build ${build_s}s"
  echo "tests: $tests_line (rc $tests_rc, skipped $tests_skipped)"
  grep -E 'Failed|\*\*\*' "$out/tests.log" | head -n 20
  echo
  cat "$out/bench.txt"
} | tee "$out/summary.txt"

[[ $tests_rc -eq 0 && $tests_skipped -eq 0 ]]
