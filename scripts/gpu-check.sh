#!/usr/bin/env bash
# scripts/gpu-check.sh: the one command to run on a GPU machine; a definitive answer in one call.
#
#   scripts/gpu-check.sh            (environment: OUT, CMAKE_CUDA_ARCHITECTURES, PAGEDKV_GPU_BUILD_DIR, JOBS)
#
# Needs (checked first, in this order; the check refuses to start and names what is missing):
#   1. CMake >= 3.25 (cuda/CMakeLists.txt's minimum; `ctest --test-dir` needs 3.20, `--no-tests=error` 3.17);
#   2. nvcc >= 12.0 (C++20, cudaLaunchKernelEx) on PATH or at /usr/local/cuda/bin/nvcc, with CCCL (CUB) headers;
#   3. a host C++ compiler that accepts -std=c++20 (c++, or CXX);
#   4. .gpu-deps/catch2/catch.hpp: the Catch2 2.13 single header staged by scripts/stage-gpu-deps.sh on a machine
#      with Debian's catch2. `.gpu-deps` is git-ignored: carry it explicitly with the work tree. Nothing else is
#      needed from outside the repository: no Debian packages, no network, no Google Benchmark.
#   ninja is used when present (make otherwise).
#
# Steps: preflight -> device probe (a 20-line program compiled with nvcc: device, SMs, compute capability, driver,
# memory clock and bus width; "no CUDA device" stops here with a non-zero exit) -> configure `cmake -S cuda`
# standalone (kernels + CPU reference + GPU tests + benchmark; headers only) -> build with ptxas reports -> every
# GPU test (ctest -L gpu --no-tests=error, one at a time), then the host-only launcher tests -> count ->
# the kernel benchmark (runs even when a test failed) -> compute-sanitizer memcheck / racecheck / synccheck /
# initcheck on the reduced "[sanitize]" grid (when the toolkit has it; GPU_CHECK_SANITIZER=0 skips; each tool is cut
# at GPU_CHECK_SANITIZER_TIMEOUT=150 s, which does not gate; reported errors fail the check) -> summary. Meant to
# finish within 10 minutes on an H100 machine (16 cores): each stage's seconds are in summary.json.
#
# Results in $OUT (default benchmarks/results/<date>-<device>/): env.json, probe.txt, configure.log, build.log,
# ptxas.txt, tests.log, host_tests.log, sanitizer_<tool>.log, bench.json, bench.txt, summary.json, summary.txt.
# The last line of stdout is the verdict: "gpu-check: PASS: N passed, 0 failed, 0 skipped (label gpu) ..." or
# "gpu-check: FAIL: <reason>: N passed, M failed, K skipped (label gpu)" or "gpu-check: REFUSED: missing: <what>: 0
# passed, 0 failed, 0 skipped (label gpu)"; summary.json carries the same counts.
# Exit status: 0 only when the build succeeded, at least one GPU test ran, every registered GPU test passed and none
# was skipped, compute-sanitizer (if present) reported nothing, and the benchmark ran; 1 FAIL; 2 REFUSED
# (preflight); 3 no CUDA device.
#
# Dry run on a machine without a GPU: GPU_CHECK_CONTINUE_WITHOUT_DEVICE=1 goes on past the failed probe to build and
# run the tests (which skip), to show the counting; the verdict is still FAIL.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="$PATH:/usr/local/cuda/bin"
start_all=$(date +%s)
cmake_min=3.25
nvcc_min=12.0

say() { echo "gpu-check: $*"; }
ver_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }  # ver_ge A B: A >= B
json_str() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr -d '\n'; }

out=${OUT:-}
verdict_written=0
write_verdict() {  # status reason passed failed skipped registered
  local status=$1 reason=$2 p=${3:-0} f=${4:-0} s=${5:-0} reg=${6:-0}
  if [[ -n "$out" && -d "$out" ]]; then
    {
      printf '{\n  "status": "%s",\n  "reason": "%s",\n' "$status" "$(json_str "$reason")"
      printf '  "gpu_tests": {"label": "gpu", "registered": %d, "passed": %d, "failed": %d, "skipped": %d,\n' \
        "$reg" "$p" "$f" "$s"
      printf '                "failed_names": "%s", "skipped_names": "%s"},\n' "$(json_str "${failed_names:-}")" \
        "$(json_str "${skipped_names:-}")"
      printf '  "host_tests": {"label": "cuda_host", "passed": %d, "failed": %d},\n' "${host_passed:-0}" \
        "${host_failed:-0}"
      printf '  "sanitizer": "%s",\n' "$(json_str "${san_summary:-not run}")"
      printf '  "build_seconds": %d,\n  "tests_seconds": %d,\n  "bench_seconds": %d,\n  "sanitizer_seconds": %d,\n' \
        "${build_s:-0}" "${tests_s:-0}" "${bench_s:-0}" "${san_s:-0}"
      printf '  "bench_rc": %s,\n  "total_seconds": %d,\n' "${bench_rc:-null}" "$(( $(date +%s) - start_all ))"
      if [[ -s "$out/env.json" ]]; then printf '  "env": %s,\n' "$(cat "$out/env.json")"; else printf '  "env": null,\n'; fi
      if [[ -s "$out/bench.json" ]]; then printf '  "bench": %s\n' "$(cat "$out/bench.json")"; else printf '  "bench": null\n'; fi
      printf '}\n'
    } > "$out/summary.json"
  fi
  verdict_written=1
}

# ---- 1. preflight: refuse to start without what must be there -------------------------------------------------
missing=()
cmake_version=$(cmake --version 2>/dev/null | head -n1 | grep -o '[0-9][0-9.]*' | head -n1 || true)
if [[ -z "$cmake_version" ]]; then
  missing+=("cmake (>= $cmake_min) not found on PATH")
elif ! ver_ge "$cmake_version" "$cmake_min"; then
  missing+=("cmake $cmake_version is older than $cmake_min")
fi
nvcc_version=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | grep -o '[0-9.]*' || true)
if [[ -z "$nvcc_version" ]]; then
  missing+=("nvcc (>= $nvcc_min) not found on PATH or in /usr/local/cuda/bin")
elif ! ver_ge "$nvcc_version" "$nvcc_min"; then
  missing+=("nvcc $nvcc_version is older than $nvcc_min")
fi
cxx=${CXX:-c++}
if ! echo 'int main() { return __cplusplus >= 202002L ? 0 : 1; }' | "$cxx" -std=c++20 -x c++ - -o /dev/null >/dev/null 2>&1; then
  missing+=("a host C++ compiler accepting -std=c++20 ($cxx)")
fi
catch2_header="$root/.gpu-deps/catch2/catch.hpp"
if [[ ! -f "$catch2_header" ]]; then
  missing+=(".gpu-deps/catch2/catch.hpp (the Catch2 2.13 single header): run scripts/stage-gpu-deps.sh on a machine with Debian's catch2 and carry .gpu-deps with the work tree")
elif ! grep -q 'Catch v2\.' "$catch2_header"; then
  missing+=(".gpu-deps/catch2/catch.hpp is not a Catch2 2.x single header")
fi
for d in include/pagedkv cuda tests/cuda benchmarks/cuda; do
  [[ -d "$root/$d" ]] || missing+=("$d/ (incomplete work tree)")
done
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if (( ${#missing[@]} > 0 )); then
  for m in "${missing[@]}"; do echo "gpu-check: missing: $m" >&2; done
  what=$(IFS=';'; echo "${missing[*]}")
  if [[ -n "$out" ]] && mkdir -p "$out" 2>/dev/null; then write_verdict REFUSED "missing: $what"; fi
  say "REFUSED: missing: $what: 0 passed, 0 failed, 0 skipped (label gpu)"
  exit 2
fi

# ---- 2. device probe ---------------------------------------------------------------------------------------------
build=${PAGEDKV_GPU_BUILD_DIR:-$root/build-gpu}
mkdir -p "$build/probe"
cat > "$build/probe/probe.cu" <<'EOF'
// Written by scripts/gpu-check.sh: what the device is, before anything else is built.
#include <cstdio>
#include <cuda_runtime.h>
int main() {
  int n = 0, driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  const cudaError_t e = cudaGetDeviceCount(&n);
  std::printf("driver_version=%d\nruntime_version=%d\n", driver, runtime);
  if (e != cudaSuccess || n == 0) {
    std::printf("error=%s\n", e != cudaSuccess ? cudaGetErrorString(e) : "device count 0");
    return 3;
  }
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  int sms = 0, mclk = 0, bus = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&mclk, cudaDevAttrMemoryClockRate, 0);
  cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, 0);
  std::printf("devices=%d\nname=%s\ncc=%d%d\nsms=%d\nmemory_gib=%.1f\nmemory_clock_mhz=%d\nbus_bits=%d\n", n,
              p.name, p.major, p.minor, sms, p.totalGlobalMem / 1073741824.0, mclk / 1000, bus);
  std::printf("spec_bandwidth_gbps=%.1f\n", 2.0 * mclk * 1e3 * bus / 8 / 1e9);
  return 0;
}
EOF
probe_txt=$(mktemp)
probe_rc=0
if ! nvcc -std=c++17 -o "$build/probe/probe" "$build/probe/probe.cu" > "$probe_txt" 2>&1; then
  cat "$probe_txt" >&2
  say "FAIL: the device probe did not compile with nvcc $nvcc_version: 0 passed, 0 failed, 0 skipped (label gpu)"
  exit 1
fi
"$build/probe/probe" > "$probe_txt" 2>&1 || probe_rc=$?
probe_get() { grep -m1 "^$1=" "$probe_txt" | cut -d= -f2- ; }
device=$(probe_get name)
device=${device:-none}
cc=$(probe_get cc)
arch=${CMAKE_CUDA_ARCHITECTURES:-${cc:-90}}
if [[ -z "$out" ]]; then
  out="$root/benchmarks/results/$(date +%Y-%m-%d)-$(echo "$device" | tr -c 'A-Za-z0-9_.\n-' '-')"
fi
mkdir -p "$out"
cp "$probe_txt" "$out/probe.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi not available" > "$out/nvidia-smi.txt"
printf '{"device": "%s", "compute_capability": "%s", "sms": "%s", "driver": "%s", "runtime": "%s", "nvcc": "%s", "cmake": "%s", "cuda_architectures": "%s", "spec_bandwidth_gbps": "%s", "date": "%s", "git": "%s"}\n' \
  "$(json_str "$device")" "$cc" "$(probe_get sms)" "$(probe_get driver_version)" "$(probe_get runtime_version)" \
  "$nvcc_version" "$cmake_version" "$arch" "$(probe_get spec_bandwidth_gbps)" "$(date -u +%FT%TZ)" \
  "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)" > "$out/env.json"
if (( probe_rc == 0 )); then
  say "cmake $cmake_version, nvcc $nvcc_version, device: $device (sm_$cc, $(probe_get sms) SMs), driver $(probe_get driver_version) -> $out"
else
  say "cmake $cmake_version, nvcc $nvcc_version, device: none, driver $(probe_get driver_version) -> $out"
fi
if (( probe_rc != 0 )); then
  reason="no CUDA device ($(probe_get error))"
  if [[ "${GPU_CHECK_CONTINUE_WITHOUT_DEVICE:-0}" != 1 ]]; then
    write_verdict FAIL "$reason"
    say "FAIL: $reason: 0 passed, 0 failed, 0 skipped (label gpu)"
    exit 3
  fi
  say "$reason; GPU_CHECK_CONTINUE_WITHOUT_DEVICE=1: building and running anyway (dry run, the verdict stays FAIL)"
fi

# ---- 3. configure + build ----------------------------------------------------------------------------------------
start=$(date +%s)
if ! cmake -S "$root/cuda" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
     -DPAGEDKV_BUILD_TESTS=ON -DPAGEDKV_BUILD_BENCHMARKS=ON -DPAGEDKV_CUDA_PTXAS_VERBOSE=ON > "$out/configure.log" 2>&1; then
  tail -n 30 "$out/configure.log"
  write_verdict FAIL "configure failed (configure.log)"
  say "FAIL: configure failed (see $out/configure.log): 0 passed, 0 failed, 0 skipped (label gpu)"
  exit 1
fi
if ! cmake --build "$build" -j "${JOBS:-$(nproc)}" > "$out/build.log" 2>&1; then
  grep -E 'error|Error' "$out/build.log" | head -n 30
  build_s=$(( $(date +%s) - start ))
  write_verdict FAIL "build failed (build.log)"
  say "FAIL: build failed (see $out/build.log): 0 passed, 0 failed, 0 skipped (label gpu)"
  exit 1
fi
build_s=$(( $(date +%s) - start ))
grep -E "Compiling entry|registers|spill" "$out/build.log" > "$out/ptxas.txt" || true
say "built in ${build_s}s"

# ---- 4. tests: every GPU test, counted -------------------------------------------------------------------------
start=$(date +%s)
registered=$(ctest --test-dir "$build" -N -L '^gpu$' 2>/dev/null | grep -c 'Test *#' || true)
ctest --test-dir "$build" -L '^gpu$' --no-tests=error --output-on-failure > "$out/tests.log" 2>&1
tests_rc=$?
tests_s=$(( $(date +%s) - start ))
count() { grep -E 'Test +#[0-9]+:' "$out/tests.log" | grep -cE "$1" || true; }
passed=$(count ' Passed +[0-9.]+ sec')
skipped=$(count '\*\*\*Skipped')
ran_lines=$(grep -cE 'Test +#[0-9]+:' "$out/tests.log" || true)
failed=$(( ran_lines - passed - skipped ))
failed_names=$(grep -E 'Test +#[0-9]+:' "$out/tests.log" | grep -vE ' Passed +[0-9.]+ sec|\*\*\*Skipped' | \
               sed -E 's/.*Test +#[0-9]+: ([^ ]+).*/\1/' | tr '\n' ' ' | sed 's/ $//')
skipped_names=$(grep -E 'Test +#[0-9]+:' "$out/tests.log" | grep -E '\*\*\*Skipped' | \
                sed -E 's/.*Test +#[0-9]+: ([^ ]+).*/\1/' | tr '\n' ' ' | sed 's/ $//')
ctest --test-dir "$build" -L '^cuda_host$' --no-tests=error --output-on-failure > "$out/host_tests.log" 2>&1
host_rc=$?
host_passed=$(grep -E 'Test +#[0-9]+:' "$out/host_tests.log" | grep -cE ' Passed +[0-9.]+ sec' || true)
host_failed=$(( $(grep -cE 'Test +#[0-9]+:' "$out/host_tests.log" || true) - host_passed ))
say "GPU tests: $passed passed, $failed failed, $skipped skipped of $registered registered (ctest rc $tests_rc, ${tests_s}s); host-only launcher tests: $host_passed passed, $host_failed failed"

# ---- 5. benchmark (also when a test failed: the numbers are still informative) ------------------------------------
bench_rc=0
start=$(date +%s)
bench_bin="$build/benchmarks/bench_kernels"
if [[ -x "$bench_bin" ]]; then
  "$bench_bin" --json "$out/bench.json" > "$out/bench.txt" 2>&1 || bench_rc=$?
else
  echo "bench_kernels not built" > "$out/bench.txt"
  bench_rc=1
fi
[[ $bench_rc -eq 0 ]] || rm -f "$out/bench.json"
bench_s=$(( $(date +%s) - start ))
say "benchmark: rc $bench_rc, ${bench_s}s"

# ---- 6. compute-sanitizer on the reduced grid ("[sanitize]"), last: it is the slowest and least decisive stage ----
# A provisional verdict first, so a run cut short here still leaves the counts and the benchmark in summary.json.
write_verdict INCOMPLETE "compute-sanitizer stage running" "$passed" "$failed" "$skipped" "$registered"
san_summary="not run"
san_failed=""
start=$(date +%s)
if [[ "${GPU_CHECK_SANITIZER:-1}" == 1 && $probe_rc -eq 0 ]]; then
  san=$(command -v compute-sanitizer || true)
  if [[ -z "$san" ]]; then
    san_summary="compute-sanitizer not found (not gating)"
  else
    san_summary=""
    for tool in memcheck racecheck synccheck initcheck; do
      rc=0
      timeout "${GPU_CHECK_SANITIZER_TIMEOUT:-150}" "$san" --tool "$tool" --error-exitcode 99 \
        "$build/tests/cuda/pagedkv_cuda_tests" "[sanitize]" -w NoTests > "$out/sanitizer_$tool.log" 2>&1 || rc=$?
      line=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer_$tool.log" | tail -n1 | sed 's/^=* *//')
      if (( rc == 124 )); then
        san_summary+="$tool: timed out after ${GPU_CHECK_SANITIZER_TIMEOUT:-150}s (not gating); "
      else
        san_summary+="$tool: ${line:-no summary} (rc $rc); "
        (( rc == 0 )) || san_failed+="$tool "
      fi
    done
  fi
  say "compute-sanitizer: $san_summary"
fi
san_s=$(( $(date +%s) - start ))

# ---- 7. verdict ---------------------------------------------------------------------------------------------------
counts="$passed passed, $failed failed, $skipped skipped (label gpu)"
reason=""
if (( probe_rc != 0 )); then reason="no CUDA device ($(probe_get error))"
elif (( ran_lines == 0 || passed + failed == 0 )); then reason="no GPU test ran"
elif (( failed > 0 )); then reason="GPU tests failed: $failed_names"
elif (( skipped > 0 )); then reason="GPU tests skipped: $skipped_names"
elif (( passed != registered )); then reason="$passed of $registered registered GPU tests passed"
elif (( tests_rc != 0 )); then reason="ctest exited $tests_rc"
elif (( host_rc != 0 )); then reason="host-only launcher tests failed"
elif [[ -n "$san_failed" ]]; then reason="compute-sanitizer reported errors: $san_failed(sanitizer_*.log)"
elif (( bench_rc != 0 )); then reason="bench_kernels exited $bench_rc"
fi
{
  echo "device: $device | driver: $(probe_get driver_version) | nvcc: $nvcc_version | cmake: $cmake_version | sm_$arch | build ${build_s}s | tests ${tests_s}s | bench ${bench_s}s | sanitizer ${san_s}s"
  echo "GPU tests (label gpu): $counts of $registered registered"
  echo "compute-sanitizer on [sanitize]: $san_summary"
  grep -E '\*\*\*|Failed' "$out/tests.log" | head -n 20
  echo
  cat "$out/bench.txt"
} > "$out/summary.txt"
cat "$out/summary.txt"
if [[ -n "$reason" ]]; then
  write_verdict FAIL "$reason" "$passed" "$failed" "$skipped" "$registered"
  say "FAIL: $reason: $counts"
  exit 1
fi
write_verdict PASS "" "$passed" "$failed" "$skipped" "$registered"
say "PASS: $counts; benchmark in $out/bench.txt"
exit 0
