#!/usr/bin/env bash
# scripts/gpu-check.sh: the one command to run on a GPU machine; a definitive answer in one call, inside a deadline.
#
#   scripts/gpu-check.sh [--seed N]
#   scripts/gpu-check.sh --source-hash | --probe-source   (used by scripts/stage-gpu-deps.sh --bundle)
#   environment: OUT, GPU_CHECK_DEADLINE_S (420), GPU_CHECK_SEED, CMAKE_CUDA_ARCHITECTURES, PAGEDKV_GPU_BUILD_DIR,
#                JOBS, GPU_CHECK_SANITIZER (1), GPU_CHECK_CONTINUE_WITHOUT_DEVICE (0), GPU_CHECK_USE_BUNDLE (0),
#                GPU_CHECK_BASELINE_BENCH (unset)
#
# Needs (checked first, in this order; the check refuses to start and names what is missing):
#   1. CMake >= 3.25 (cuda/CMakeLists.txt's minimum; `ctest --test-dir` needs 3.20, `--no-tests=error` 3.17);
#   2. nvcc >= 12.0 (C++20, cudaLaunchKernelEx) on PATH or at /usr/local/cuda/bin/nvcc, with CCCL (CUB) headers;
#   3. a host C++ compiler that accepts -std=c++20 (c++, or CXX);
#   4. .gpu-deps/catch2/catch.hpp: the Catch2 2.13 single header staged by scripts/stage-gpu-deps.sh on a machine
#      with Debian's catch2 (which also writes .gpu-deps/REVISION, the source revision: `.git` does not travel).
#      `.gpu-deps` is git-ignored: carry it explicitly with the work tree. Nothing else comes from outside the
#      repository: no Debian packages, no network, no Google Benchmark. ninja is used when present; python3 with
#      torch is used when present (the SDPA comparison rows), skipped with a note otherwise.
#   5. for the consumers stage only (else it is "not run" and the verdict INCOMPLETE): .gpu-deps/prefix (OpenSSL
#      headers + static libcrypto, xxhash.h, CLI11, nlohmann_json), staged by scripts/stage-gpu-deps.sh.
#
# One deadline for the whole script (GPU_CHECK_DEADLINE_S, default 420 s: a 15-minute device lease minus start-up,
# transfers and a margin). Every stage runs under `timeout` with a cap: its share of (deadline - 15 s) plus whatever
# the stages before it left unused, never past the deadline. Shares: build (configure + build) 25%, GPU tests 24%,
# benchmark 8%, torch SDPA 5%, consumers 15%, memcheck 8%, racecheck 8%, synccheck 3.5%, initcheck 3.5% (the caps
# at 420 s: 101/97/32/20/60/32/32/14/14 s, sum 402 s; the H100 / H200 runs of 2026-11-27 took 24-29 s to build, 15-17
# s of tests, 1 s of benchmark). A stage cut at its cap is reported as "timed out", a stage the deadline
# leaves no time for as "not run (deadline)"; neither is ever a pass.
#
# Steps: preflight -> device probe (a 20-line program compiled with nvcc; "no CUDA device" stops here, exit 3) ->
# configure `cmake -S cuda` standalone + build (ptxas reports) -> GPU tests (ctest -L gpu -j JOBS, per-test timeout,
# fresh random inputs from one seed: PAGEDKV_GPU_SEED) + the host-only launcher tests -> benchmark
# (bench_kernels --quick --seed: every row the GPU issue asks for, with the copy bandwidth of the same run, every
# repetition) -> torch scaled_dot_product_attention on the same shapes (benchmarks/cuda/bench_torch_sdpa.py, merged
# into bench.json) -> consumers: the top-level project (host library + kernels, against .gpu-deps/prefix), then
# `examples/decode_loop --device cuda` (two runs, every step checked against float64) and tests/package/cuda built
# against the installed package and run -> compute-sanitizer memcheck, racecheck, then synccheck, initcheck on the reduced "[sanitize]"
# grid (every kernel: write_kv, copy_blocks, swap_blocks, decode, prefill) -> verdict.
#
# Results in $OUT (default benchmarks/results/<date>-<device>/), at most 4 files (6 with GPU_CHECK_BASELINE_BENCH), no folder: summary.json (rewritten
# after every stage, so a run killed at its limit still returns what finished), summary.txt, bench.json (every
# repetition of every row), logs.tar.gz (env, probe, nvidia-smi, configure/build/ptxas logs, ctest and per-test
# output, sanitizer logs, bench.txt; also rewritten after every stage). The last line of stdout is the verdict:
#   gpu-check: PASS: N passed, 0 failed, 0 skipped (label gpu); sanitizer: ...; seed S; T s of D s
#   gpu-check: INCOMPLETE: <what did not finish>: N passed, 0 failed, 0 skipped (label gpu); ...
#   gpu-check: FAIL: <reason>: N passed, M failed, K skipped (label gpu); ...
#   gpu-check: REFUSED: missing: <what>: 0 passed, 0 failed, 0 skipped (label gpu)
# Before / after (optional, never part of the verdict): GPU_CHECK_BASELINE_BENCH=PATH names another build's
# bench_kernels (e.g. .gpu-deps/bundle/bench_kernels staged from the previous commit). After the sanitizers, with the
# time left before the deadline, it runs that binary and then this build's, both --quick with the check's seed, one
# right after the other (timings compare only within one call), writes ab-base.json and ab-new.json to $OUT (6 files
# then) and the scripts/bench-compare.py table into summary.txt and logs (ab.txt); summary.json's "ab" says what ran.
# Exit status: 0 PASS (build ok, every registered GPU test ran and passed, none skipped, host tests passed, the
# benchmark ran, decode_loop --device cuda and the installed CUDA consumer passed, all four sanitizer tools ran clean); 1 FAIL; 2 REFUSED (preflight); 3 no CUDA device; 4 INCOMPLETE
# (nothing failed, but a stage was cut by its cap or the deadline, or compute-sanitizer is missing or disabled).
#
# Dry run on a machine without a GPU: GPU_CHECK_CONTINUE_WITHOUT_DEVICE=1 goes on past the failed probe to build and
# run the tests (which skip), to show the counting and the stage budget; the verdict is still FAIL.
#
# Prebuilt bundle (fallback when the GPU machine's toolchain fails): `scripts/stage-gpu-deps.sh --bundle` builds here
# the test binary, bench_kernels and the probe for sm_90 with the static CUDA runtime and static libstdc++/libgcc
# into .gpu-deps/bundle/ (BUNDLE: revision, source hash, glibc needed; gpu_tests.tsv / host_tests.tsv: every CTest
# test's name and arguments, from the build's CTest files). It is run instead of building when the preflight refuses
# (cmake / nvcc / C++20 compiler / Catch2 header missing), the probe does not compile, or the build stage fails or
# is cut, and always with GPU_CHECK_USE_BUNDLE=1 (which refuses, exit 2, when the bundle is unusable). Usable means:
# its commit is .gpu-deps/REVISION's, its source hash (include/, cuda/, tests/cuda/, benchmarks/cuda/,
# src/error.cpp) is this tree's, this machine's glibc is at least the one its binaries need, and the binaries'
# sha256 match. Otherwise it is never run and the verdict says why. The bundle path runs the same stages under the
# same deadline (the build's share goes to the later stages), each GPU test family through the bundled binary with
# the same per-test timeout and JOBS in parallel (no CTest), and counts and reports the same way; summary.json adds
# "mode" ("build" or "bundle"), "mode_reason" and "bundle", and the verdict line ends with the bundle note.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="$PATH:/usr/local/cuda/bin"
start_all=$(date +%s)
cmake_min=3.25
nvcc_min=12.0

say() { echo "gpu-check: $*"; }
ver_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }  # ver_ge A B: A >= B
json_str() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr -d '\n\r\t'; }
now() { date +%s; }

seed=${GPU_CHECK_SEED:-}
print_source_hash=0
print_probe_source=0
while (( $# > 0 )); do
  case $1 in
    --seed) seed=${2:-}; shift 2 ;;
    --seed=*) seed=${1#--seed=}; shift ;;
    --source-hash) print_source_hash=1; shift ;;
    --probe-source) print_probe_source=1; shift ;;
    *) echo "usage: scripts/gpu-check.sh [--seed N] | --source-hash | --probe-source" >&2; exit 2 ;;
  esac
done
# The device probe's source (also compiled into the bundle by scripts/stage-gpu-deps.sh --bundle).
probe_source() {
  cat <<'EOF'
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
}
# source_hash: sha256 over the sources the GPU binaries are built from (paths and contents, C locale order); the
# bundle records it at staging, and the check compares it with the tree that travelled (`.git` does not travel).
source_hash() {
  (cd "$root" && find include cuda tests/cuda benchmarks/cuda src/error.cpp -type f ! -name '*.pyc' ! -name '*.swp' \
     ! -path '*/__pycache__/*' -print0 2>/dev/null | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64)
}
if (( print_probe_source )); then probe_source; exit 0; fi
if (( print_source_hash )); then source_hash; exit 0; fi
if [[ -z "$seed" ]]; then seed=$(( $(od -An -N6 -tu8 /dev/urandom | tr -d ' ') )); fi
if ! [[ "$seed" =~ ^[0-9]+$ ]]; then echo "gpu-check: --seed wants a non-negative integer, got '$seed'" >&2; exit 2; fi
export PAGEDKV_GPU_SEED=$seed

deadline_s=${GPU_CHECK_DEADLINE_S:-420}
if ! [[ "$deadline_s" =~ ^[0-9]+$ ]] || (( deadline_s < 10 )); then
  echo "gpu-check: GPU_CHECK_DEADLINE_S must be an integer >= 10, got '$deadline_s'" >&2
  exit 2
fi
deadline_at=$(( start_all + deadline_s ))
reserve_s=15  # preflight, probe and the summary (a quarter of a deadline under 60 s)
(( deadline_s < 60 )) && reserve_s=$(( deadline_s / 4 ))
remaining() { echo $(( deadline_at - $(now) )); }

# Stage table: name, share of (deadline - reserve) in tenths of a percent.
stage_order=(build tests bench torch consumers memcheck racecheck synccheck initcheck)
declare -A share=([build]=250 [tests]=240 [bench]=80 [torch]=50 [consumers]=150 [memcheck]=80 [racecheck]=80
                  [synccheck]=35 [initcheck]=35)
declare -A st_cap st_share st_secs st_status st_rc
for s in "${stage_order[@]}"; do
  st_share[$s]=$(( (deadline_s - reserve_s) * ${share[$s]} / 1000 ))  # fixed: the shares sum to <= deadline - reserve
  st_cap[$s]=${st_share[$s]}                                            # effective: share + time left unused before
  st_secs[$s]=0
  st_status[$s]="pending"
  st_rc[$s]=null
done
banked=0

out=${OUT:-}
work=""           # log directory (archived into $out/logs.tar.gz)
device=none
driver_smi=""
clocks_smi=""
probe_rc=1
status_now="RUNNING"
reason_now=""
verdict_line=""
registered=0 passed=0 failed=0 skipped=0 not_finished=0
host_passed=0 host_failed=0
failed_names="" skipped_names=""
bench_rows=0 bench_unsupported=0 bench_skipped=0
torch_note=""

revision() {  # key from .gpu-deps/REVISION, else git, else unknown
  local f="$root/.gpu-deps/REVISION" v=""
  [[ -f "$f" ]] && v=$(grep -m1 "^$1=" "$f" | cut -d= -f2-)
  if [[ -z "$v" && "$1" == commit ]]; then v=$(git -C "$root" rev-parse HEAD 2>/dev/null || true); fi
  echo "${v:-unknown}"
}

# ---- the prebuilt bundle (.gpu-deps/bundle, scripts/stage-gpu-deps.sh --bundle) ---------------------------------
bundle="$root/.gpu-deps/bundle"
bundle_state="none"   # none | ok | why it is unusable
mode=build            # build | bundle
mode_reason=""
bundle_note=""        # appended to the verdict line
bundle_get() { [[ -f "$bundle/BUNDLE" ]] && grep -m1 "^$1=" "$bundle/BUNDLE" | cut -d= -f2- ; true; }
bundle_check() {  # sets bundle_state
  [[ -e "$bundle" ]] || { bundle_state="none"; return; }
  local f want have glibc_need glibc_have sum
  for f in BUNDLE gpu_tests.tsv host_tests.tsv pagedkv_cuda_tests bench_kernels probe; do
    [[ -s "$bundle/$f" ]] || { bundle_state="incomplete (no $f)"; return; }
  done
  want=$(bundle_get commit); have=$(revision commit)
  if [[ "$want" != "$have" ]]; then
    bundle_state="built for another revision (bundle commit ${want:0:12}, tree ${have:0:12})"; return
  fi
  want=$(bundle_get source_hash); have=$(source_hash)
  if [[ "$want" != "$have" ]]; then
    bundle_state="built from other sources (bundle source hash ${want:0:12}, tree ${have:0:12})"; return
  fi
  for f in pagedkv_cuda_tests bench_kernels probe; do
    sum=$(sha256sum "$bundle/$f" 2>/dev/null | cut -c1-64)
    [[ "$sum" == "$(bundle_get "sha256_$f")" ]] || { bundle_state="damaged ($f sha256 differs from BUNDLE)"; return; }
    [[ -x "$bundle/$f" ]] || chmod +x "$bundle/$f" 2>/dev/null || { bundle_state="$f not executable"; return; }
  done
  glibc_need=$(bundle_get glibc_required); glibc_need=${glibc_need#GLIBC_}
  glibc_have=$(getconf GNU_LIBC_VERSION 2>/dev/null | grep -o '[0-9][0-9.]*' || true)
  if [[ -z "$glibc_have" ]]; then
    bundle_state="this machine's glibc version is unknown (needs >= ${glibc_need})"; return
  elif ! ver_ge "$glibc_have" "${glibc_need:-0}"; then
    bundle_state="needs glibc >= $glibc_need, this machine has $glibc_have"; return
  fi
  bundle_state="ok"
}
# use_bundle WHY: switch to the bundle path (caller checked bundle_state == ok).
use_bundle() {
  mode=bundle
  mode_reason=$1
  arch=$(bundle_get cuda_architectures)
  bundle_note="ran the prebuilt bundle (commit $(bundle_get commit | cut -c1-12), sm_$arch, CUDA runtime $(bundle_get cuda_runtime) static): $1"
  say "$bundle_note"
}
# no_bundle WHY: the bundle would have been used for WHY but is unusable (or absent): say so in the verdict.
no_bundle() {
  case $bundle_state in
    ok) ;;
    none) bundle_note="no prebuilt bundle to fall back on (scripts/stage-gpu-deps.sh --bundle)" ;;
    *) bundle_note="bundle not run: $bundle_state" ;;
  esac
}

write_summary() {
  [[ -n "$out" && -d "$out" ]] || return 0
  local tmp="$out/.summary.json.tmp" s first=1
  {
    printf '{\n  "status": "%s",\n  "reason": "%s",\n  "verdict": "%s",\n' "$status_now" "$(json_str "$reason_now")" \
      "$(json_str "$verdict_line")"
    printf '  "seed": %s,\n  "deadline_s": %d,\n  "elapsed_s": %d,\n' "$seed" "$deadline_s" $(( $(now) - start_all ))
    printf '  "revision": {"commit": "%s", "branch": "%s", "changed_paths": "%s", "staged_at": "%s"},\n' \
      "$(json_str "$(revision commit)")" "$(json_str "$(revision branch)")" "$(json_str "$(revision changed_paths)")" \
      "$(json_str "$(revision staged_at)")"
    printf '  "device": {"name": "%s", "compute_capability": "%s", "sms": "%s", "driver": "%s", "runtime": "%s",\n' \
      "$(json_str "$device")" "$(probe_get cc)" "$(probe_get sms)" "$(json_str "$driver_smi")" "$(probe_get runtime_version)"
    printf '             "clocks": "%s", "spec_bandwidth_gbps": "%s", "cuda_architectures": "%s"},\n' \
      "$(json_str "$clocks_smi")" "$(probe_get spec_bandwidth_gbps)" "${arch:-}"
    printf '  "tools": {"cmake": "%s", "nvcc": "%s", "cxx": "%s"},\n' "$(json_str "${cmake_version:-}")" \
      "$(json_str "${nvcc_version:-}")" "$(json_str "${cxx:-}")"
    printf '  "mode": "%s",\n  "mode_reason": "%s",\n' "$mode" "$(json_str "$mode_reason")"
    printf '  "bundle": {"state": "%s", "commit": "%s", "source_hash": "%s", "cuda_architectures": "%s", "cuda_runtime": "%s",\n' \
      "$(json_str "$bundle_state")" "$(json_str "$(bundle_get commit)")" "$(json_str "$(bundle_get source_hash)")" \
      "$(json_str "$(bundle_get cuda_architectures)")" "$(json_str "$(bundle_get cuda_runtime)")"
    printf '             "glibc_required": "%s", "built_at": "%s", "note": "%s"},\n' \
      "$(json_str "$(bundle_get glibc_required)")" "$(json_str "$(bundle_get built_at)")" "$(json_str "$bundle_note")"
    printf '  "gpu_tests": {"label": "gpu", "registered": %d, "passed": %d, "failed": %d, "skipped": %d, "not_finished": %d,\n' \
      "$registered" "$passed" "$failed" "$skipped" "$not_finished"
    printf '                "failed_names": "%s", "skipped_names": "%s"},\n' "$(json_str "$failed_names")" \
      "$(json_str "$skipped_names")"
    printf '  "host_tests": {"label": "cuda_host", "passed": %d, "failed": %d},\n' "$host_passed" "$host_failed"
    printf '  "bench": {"file": "bench.json", "rows": %d, "unsupported_rows": %d, "skipped_rows": %d, "torch": "%s"},\n' \
      "$bench_rows" "$bench_unsupported" "$bench_skipped" "$(json_str "$torch_note")"
    printf '  "ab": {"baseline": "%s", "status": "%s"},\n' "$(json_str "${GPU_CHECK_BASELINE_BENCH:-}")" \
      "$(json_str "${ab_note:-not asked (GPU_CHECK_BASELINE_BENCH unset)}")"
    printf '  "stages": [\n'
    for s in "${stage_order[@]}"; do
      (( first )) || printf ',\n'
      first=0
      printf '    {"name": "%s", "share_s": %d, "cap_s": %d, "seconds": %d, "status": "%s", "rc": %s}' "$s" \
        "${st_share[$s]}" "${st_cap[$s]}" \
        "${st_secs[$s]}" "$(json_str "${st_status[$s]}")" "${st_rc[$s]}"
    done
    printf '\n  ],\n  "reserve_s": %d,\n  "stage_seconds_total": %d,\n  "stage_shares_total": %d\n}\n' "$reserve_s" \
      "$(( ${st_secs[build]} + ${st_secs[tests]} + ${st_secs[bench]} + ${st_secs[torch]} + ${st_secs[memcheck]} + ${st_secs[racecheck]} + ${st_secs[synccheck]} + ${st_secs[initcheck]} ))" \
      "$(( ${st_share[build]} + ${st_share[tests]} + ${st_share[bench]} + ${st_share[torch]} + ${st_share[memcheck]} + ${st_share[racecheck]} + ${st_share[synccheck]} + ${st_share[initcheck]} ))"
  } > "$tmp" && mv -f "$tmp" "$out/summary.json"
  if [[ -n "$work" && -d "$work" ]]; then
    tar -czf "$out/.logs.tar.gz.tmp" -C "$work" . 2>/dev/null && mv -f "$out/.logs.tar.gz.tmp" "$out/logs.tar.gz"
  fi
}

# run_stage NAME CMD...: runs CMD under `timeout` with the stage's cap (share + banked, bounded by the deadline);
# records seconds, cap, status (ok | failed | timed out | not run (deadline)) and rc; returns CMD's rc (124 when cut,
# 125 when not run).
run_stage() {
  local name=$1; shift
  local cap=$(( ${st_cap[$name]} + banked )) left t0 rc
  left=$(( $(remaining) - 3 ))
  (( cap > left )) && cap=$left
  if (( cap < 3 )); then
    st_cap[$name]=0
    st_status[$name]="not run (deadline)"
    write_summary
    return 125
  fi
  st_cap[$name]=$cap
  st_status[$name]="running"
  write_summary
  t0=$(now)
  timeout -k 5 "$cap" "$@"
  rc=$?
  st_secs[$name]=$(( $(now) - t0 ))
  st_rc[$name]=$rc
  if (( rc == 124 || rc == 137 )); then
    st_status[$name]="timed out after ${cap}s"
    rc=124
  elif (( rc == 0 )); then
    st_status[$name]="ok"
  else
    st_status[$name]="failed (rc $rc)"
  fi
  banked=$(( cap - ${st_secs[$name]} ))
  (( banked < 0 )) && banked=0
  write_summary
  return $rc
}
skip_stage() { st_status[$1]=$2; st_cap[$1]=0; write_summary; }

finish() {  # STATUS REASON EXIT
  status_now=$1
  reason_now=$2
  local counts="$passed passed, $failed failed, $skipped skipped (label gpu)" san="" s
  for s in memcheck racecheck synccheck initcheck; do san+="$s ${st_status[$s]}, "; done
  san=${san%, }
  if [[ "$1" == REFUSED ]]; then
    verdict_line="gpu-check: REFUSED: $2: 0 passed, 0 failed, 0 skipped (label gpu)"
  elif [[ "$1" == PASS ]]; then
    verdict_line="gpu-check: PASS: $counts; sanitizer: $san; seed $seed; $(( $(now) - start_all )) s of $deadline_s s"
  else
    verdict_line="gpu-check: $1: $2: $counts; sanitizer: $san; seed $seed; $(( $(now) - start_all )) s of $deadline_s s"
  fi
  verdict_line+="${bundle_note:+; $bundle_note}"
  if [[ -n "$work" && -d "$work" && -n "$out" ]]; then
    {
      echo "device: $device | driver: $driver_smi | clocks: $clocks_smi | nvcc: ${nvcc_version:-} | cmake: ${cmake_version:-} | sm_${arch:-?}"
      echo "mode: $mode${mode_reason:+ ($mode_reason)} | bundle: $bundle_state"
      echo "revision: $(revision commit) ($(revision changed_paths) changed paths) | seed $seed (replay: --seed $seed) | deadline ${deadline_s}s"
      for s in "${stage_order[@]}"; do
        printf '  stage %-10s share %4ss  cap %4ss  took %4ss  %s\n' "$s" "${st_share[$s]}" "${st_cap[$s]}" "${st_secs[$s]}" \
          "${st_status[$s]}"
      done
      echo "GPU tests (label gpu): $counts of $registered registered, $not_finished not finished"
      [[ -n "$failed_names" ]] && echo "  failed: $failed_names"
      [[ -n "$skipped_names" ]] && echo "  skipped: $skipped_names"
      echo "host-only launcher tests: $host_passed passed, $host_failed failed"
      [[ -f "$work/bench.txt" ]] && { echo; tail -n 80 "$work/bench.txt"; }
      [[ -n "$torch_note" ]] && echo "torch SDPA: $torch_note"
      [[ -n "${consumers_note:-}" ]] && echo "consumers (decode_loop --device cuda, installed CUDA consumer): $consumers_note"
      [[ -n "${ab_note:-}" ]] && echo "before / after (GPU_CHECK_BASELINE_BENCH): $ab_note"
      [[ -s "$work/ab.txt" ]] && cat "$work/ab.txt"
      echo
      echo "$verdict_line"
    } > "$out/summary.txt"
    cp "$out/summary.txt" "$work/summary.txt"
    sed '$d' "$out/summary.txt"
  fi
  write_summary
  rm -f "$out/.summary.json.tmp" "$out/.logs.tar.gz.tmp" 2>/dev/null
  echo "$verdict_line"
  exit "$3"
}

probe_txt=""
probe_get() { [[ -n "$probe_txt" && -f "$probe_txt" ]] && grep -m1 "^$1=" "$probe_txt" | cut -d= -f2- ; true; }

# ---- 1. preflight: refuse to start without what must be there -------------------------------------------------
missing=()
cmake_version=$(cmake --version 2>/dev/null | head -n1 | grep -o '[0-9][0-9.]*' | head -n1 || true)
if [[ -z "$cmake_version" ]]; then
  missing+=("cmake (>= $cmake_min) not found on PATH")
elif ! ver_ge "$cmake_version" "$cmake_min"; then
  missing+=("cmake $cmake_version is older than $cmake_min")
fi
nvcc_version=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | grep -o '[0-9.]*' || true)
if [[ -z "$nvcc_version" ]] && command -v nvcc >/dev/null 2>&1; then
  missing+=("nvcc ($(command -v nvcc)) does not run or report a version")
elif [[ -z "$nvcc_version" ]]; then
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
missing_base=()   # needed by the bundle path too
for tool in timeout tar gzip sha256sum xargs; do
  command -v "$tool" >/dev/null 2>&1 || missing_base+=("$tool (coreutils / tar / gzip / findutils)")
done
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
refuse() {  # WHAT
  if [[ -n "$out" ]]; then mkdir -p "$out" 2>/dev/null || out=""; fi
  for s in "${stage_order[@]}"; do st_status[$s]="not run (refused)"; done
  finish REFUSED "$1" 2
}
if (( ${#missing_base[@]} > 0 )); then
  for m in "${missing_base[@]}"; do echo "gpu-check: missing: $m" >&2; done
  refuse "missing: $(IFS=';'; echo "${missing_base[*]}")"
fi
bundle_check
if [[ "${GPU_CHECK_USE_BUNDLE:-0}" == 1 ]]; then
  if [[ "$bundle_state" != ok ]]; then
    no_bundle
    [[ "$bundle_state" == none ]] && bundle_note="no prebuilt bundle at .gpu-deps/bundle (scripts/stage-gpu-deps.sh --bundle)"
    refuse "GPU_CHECK_USE_BUNDLE=1 but the bundle is unusable"
  fi
  for m in "${missing[@]}"; do say "note: the build path would miss: $m"; done
  use_bundle "GPU_CHECK_USE_BUNDLE=1"
elif (( ${#missing[@]} > 0 )); then
  for m in "${missing[@]}"; do echo "gpu-check: missing: $m" >&2; done
  what=$(IFS=';'; echo "${missing[*]}")
  if [[ "$bundle_state" == ok ]]; then
    use_bundle "the preflight refused the build: missing: $what"
  else
    no_bundle
    refuse "missing: $what"
  fi
fi

# ---- 2. device probe ---------------------------------------------------------------------------------------------
build=${PAGEDKV_GPU_BUILD_DIR:-$root/build-gpu}
mkdir -p "$build/probe"
work="$build/check-logs"
rm -rf "$work"
mkdir -p "$work"
probe_source > "$build/probe/probe.cu"
probe_txt="$work/probe.txt"
probe_bin="$build/probe/probe"
if [[ "$mode" == bundle ]]; then
  probe_bin="$bundle/probe"
elif ! timeout 60 nvcc -std=c++17 -o "$build/probe/probe" "$build/probe/probe.cu" > "$probe_txt" 2>&1; then
  cat "$probe_txt" >&2
  cp -f "$probe_txt" "$work/probe_nvcc.txt"
  if [[ "$bundle_state" == ok ]]; then
    use_bundle "the device probe did not compile with nvcc $nvcc_version"
    probe_bin="$bundle/probe"
  else
    no_bundle
    [[ -n "$out" ]] && mkdir -p "$out"
    for s in "${stage_order[@]}"; do st_status[$s]="not run (probe did not compile)"; done
    finish FAIL "the device probe did not compile with nvcc $nvcc_version" 1
  fi
fi
probe_rc=0
timeout 30 "$probe_bin" > "$probe_txt" 2>&1 || probe_rc=$?
device=$(probe_get name)
device=${device:-none}
cc=$(probe_get cc)
if [[ "$mode" == bundle ]]; then arch=$(bundle_get cuda_architectures); else arch=${CMAKE_CUDA_ARCHITECTURES:-${cc:-90}}; fi
if [[ -z "$out" ]]; then
  out="$root/benchmarks/results/$(date +%Y-%m-%d)-$(echo "$device" | tr -c 'A-Za-z0-9_.\n-' '-')"
fi
mkdir -p "$out"
rm -f "$out/summary.json" "$out/summary.txt" "$out/bench.json" "$out/logs.tar.gz" "$out/ab-base.json" "$out/ab-new.json"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi > "$work/nvidia-smi.txt" 2>&1 || true
  driver_smi=$(timeout 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)
  clocks_smi=$(timeout 20 nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu \
               --format=csv 2>/dev/null | tail -n1 | tr -d '\r' || true)
else
  echo "nvidia-smi not available" > "$work/nvidia-smi.txt"
fi
driver_smi=${driver_smi:-"unknown (nvidia-smi: none; CUDA driver API $(probe_get driver_version))"}
cp -f "$root/.gpu-deps/REVISION" "$work/REVISION" 2>/dev/null || echo "no .gpu-deps/REVISION" > "$work/REVISION"
say "mode $mode, cmake ${cmake_version:-none}, nvcc ${nvcc_version:-none}, device: $device${cc:+ (sm_$cc, $(probe_get sms) SMs)}, driver $driver_smi, seed $seed, deadline ${deadline_s}s -> $out"
if (( probe_rc != 0 )); then
  probe_error=$(probe_get error)
  [[ -z "$probe_error" ]] && probe_error="probe exited $probe_rc: $(tail -n1 "$probe_txt" 2>/dev/null)"
  reason="no CUDA device ($probe_error)"
  if [[ "${GPU_CHECK_CONTINUE_WITHOUT_DEVICE:-0}" != 1 ]]; then
    for s in "${stage_order[@]}"; do st_status[$s]="not run (no device)"; done
    finish FAIL "$reason" 3
  fi
  say "$reason; GPU_CHECK_CONTINUE_WITHOUT_DEVICE=1: $([[ $mode == bundle ]] && echo "running the bundle" || echo "building and running") anyway (dry run, the verdict stays FAIL)"
fi
write_summary

# ---- 3. configure + build (or the prebuilt bundle) ----------------------------------------------------------------
export GC_ROOT="$root" GC_BUILD="$build" GC_ARCH="$arch" GC_WORK="$work" GC_JOBS="${JOBS:-$(nproc)}"
export GC_GEN="${generator[*]}" GC_BUNDLE="$bundle"
if [[ "$mode" == build ]]; then
  run_stage build bash -c '
    cmake -S "$GC_ROOT/cuda" -B "$GC_BUILD" $GC_GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$GC_ARCH" \
      -DPAGEDKV_BUILD_TESTS=ON -DPAGEDKV_BUILD_BENCHMARKS=ON -DPAGEDKV_CUDA_PTXAS_VERBOSE=ON > "$GC_WORK/configure.log" 2>&1 \
      || { echo "configure failed" >> "$GC_WORK/configure.log"; exit 10; }
    cmake --build "$GC_BUILD" -j "$GC_JOBS" > "$GC_WORK/build.log" 2>&1'
  build_rc=$?
  grep -E "Compiling entry|registers|spill" "$work/build.log" > "$work/ptxas.txt" 2>/dev/null || true
  if (( build_rc != 0 )); then
    tail -n 30 "$work/configure.log" 2>/dev/null | grep -iE 'error|fail' | head -n 10
    grep -E 'error|Error' "$work/build.log" 2>/dev/null | head -n 30
    case $build_rc in
      10) why="configure failed (configure.log in logs.tar.gz)" ;;
      124) why="build cut at its cap (${st_cap[build]} s; deadline ${deadline_s} s)" ;;
      125) why="no time left to build (deadline ${deadline_s} s)" ;;
      *) why="build failed (build.log in logs.tar.gz)" ;;
    esac
    if [[ "$bundle_state" == ok ]] && (( build_rc != 125 )); then
      use_bundle "$why"
      GC_ARCH=$arch
    else
      no_bundle
      for s in tests bench torch consumers memcheck racecheck synccheck initcheck; do st_status[$s]="not run (no build)"; done
      finish FAIL "$why" 1
    fi
  else
    say "built in ${st_secs[build]}s (cap ${st_cap[build]}s)"
  fi
else
  skip_stage build "skipped (prebuilt bundle)"
  banked=${st_share[build]}   # the build's share goes to the later stages
  echo "prebuilt bundle: no ptxas report (see a build run's ptxas.txt)" > "$work/ptxas.txt"
fi
if [[ "$mode" == bundle ]]; then
  test_bin="$bundle/pagedkv_cuda_tests"
  bench_bin="$bundle/bench_kernels"
  cp -f "$bundle/BUNDLE" "$work/BUNDLE"
else
  test_bin="$build/tests/cuda/pagedkv_cuda_tests"
  bench_bin="$build/benchmarks/bench_kernels"
fi

# ---- 4. tests: every GPU test, counted, in parallel with a per-test timeout -----------------------------------------
tests_cap=$(( ${st_cap[tests]} + banked ))
per_test=$(( tests_cap - 10 ))
(( per_test > 90 )) && per_test=90
(( per_test < 5 )) && per_test=5
if [[ "$mode" == build ]]; then
  registered=$(ctest --test-dir "$build" -N -L '^gpu$' 2>/dev/null | grep -c 'Test *#' || true)
  run_stage tests bash -c '
    ctest --test-dir "$GC_BUILD" -L "^gpu\$" --no-tests=error --output-on-failure -j "$GC_JOBS" --timeout '"$per_test"' \
      > "$GC_WORK/tests.log" 2>&1
    rc=$?
    ctest --test-dir "$GC_BUILD" -L "^cuda_host\$" --no-tests=error --output-on-failure > "$GC_WORK/host_tests.log" 2>&1 \
      || exit 20
    exit $rc'
  tests_rc=$?
else
  # The bundle's CTest tests (name, then the test binary's arguments; tab-separated, one per line), run like
  # `ctest -j JOBS --timeout per_test`: each writes one CTest-style result line (Passed / ***Skipped (exit 77) /
  # ***Timeout / ***Failed) to tests/LIST.I.result and its output to tests/NAME.log; the lines are gathered into
  # tests.log / host_tests.log afterwards, so a stage cut at its cap still counts what finished.
  run_family() {  # LIST I N: returns 0 for passed or skipped, 1 otherwise
    local list=$1 i=$2 n=$3 line name t0 t1 rc res ms
    local -a f
    line=$(sed -n "${i}p" "$GC_BUNDLE/$list.tsv")
    IFS=$'\t' read -r -a f <<< "$line"
    name=${f[0]}
    t0=$(date +%s%N)
    timeout -k 5 "$GC_PER_TEST" "$GC_BUNDLE/pagedkv_cuda_tests" "${f[@]:1}" > "$GC_WORK/tests/$name.log" 2>&1
    rc=$?
    t1=$(date +%s%N)
    ms=$(( (t1 - t0) / 1000000 ))
    case $rc in
      0) res="   Passed" ;;
      77) res="***Skipped" ;;
      124|137) res="***Timeout" ;;
      *) res="***Failed (exit $rc)" ;;
    esac
    printf '%3d/%d Test #%d: %s .......... %s %d.%02d sec\n' "$i" "$n" "$i" "$name" "$res" $(( ms / 1000 )) \
      $(( ms % 1000 / 10 )) > "$GC_WORK/tests/$list.$i.result"
    [[ $rc == 0 || $rc == 77 ]]
  }
  run_list() {  # LIST JOBS
    local n
    n=$(grep -c . "$GC_BUNDLE/$1.tsv")
    seq 1 "$n" | xargs -P "$2" -I{} bash -c 'run_family "$1" "$2" "$3"' _ "$1" {} "$n"
  }
  gather() {  # LIST LOG: the result lines in registration order, then the output of each test that did not pass
    local n i name
    n=$(grep -c . "$bundle/$1.tsv")
    {
      echo "bundle: $(bundle_get commit) $test_bin, -j $GC_JOBS, per-test timeout ${per_test}s"
      for (( i = 1; i <= n; i++ )); do
        cat "$work/tests/$1.$i.result" 2>/dev/null
      done
      for (( i = 1; i <= n; i++ )); do
        if [[ -f "$work/tests/$1.$i.result" ]] && ! grep -qE ' Passed |\*\*\*Skipped' "$work/tests/$1.$i.result"; then
          name=$(sed -n "${i}p" "$bundle/$1.tsv" | cut -f1)
          echo "---- output of $name:"
          tail -n 60 "$work/tests/$name.log"
        fi
      done
    } > "$2"
  }
  export -f run_family run_list
  export GC_PER_TEST=$per_test PAGEDKV_GPU_SEED
  mkdir -p "$work/tests"
  registered=$(grep -c . "$bundle/gpu_tests.tsv" || true)
  run_stage tests bash -c 'run_list gpu_tests "$GC_JOBS"; rc=$?; run_list host_tests 1 || exit 20; exit $rc'
  tests_rc=$?
  gather gpu_tests "$work/tests.log"
  gather host_tests "$work/host_tests.log"
fi
count() { grep -E 'Test +#[0-9]+:' "$work/tests.log" 2>/dev/null | grep -cE "$1" || true; }
passed=$(count ' Passed +[0-9.]+ sec')
skipped=$(count '\*\*\*Skipped')
ran_lines=$(grep -cE 'Test +#[0-9]+:' "$work/tests.log" 2>/dev/null || true)
failed=$(( ran_lines - passed - skipped ))
not_finished=$(( registered - ran_lines ))
(( not_finished < 0 )) && not_finished=0
failed_names=$(grep -E 'Test +#[0-9]+:' "$work/tests.log" 2>/dev/null | grep -vE ' Passed +[0-9.]+ sec|\*\*\*Skipped' | \
               sed -E 's/.*Test +#[0-9]+: ([^ ]+).*/\1/' | tr '\n' ' ' | sed 's/ $//')
skipped_names=$(grep -E 'Test +#[0-9]+:' "$work/tests.log" 2>/dev/null | grep -E '\*\*\*Skipped' | \
                sed -E 's/.*Test +#[0-9]+: ([^ ]+).*/\1/' | tr '\n' ' ' | sed 's/ $//')
host_passed=$(grep -E 'Test +#[0-9]+:' "$work/host_tests.log" 2>/dev/null | grep -cE ' Passed +[0-9.]+ sec' || true)
host_failed=$(( $(grep -cE 'Test +#[0-9]+:' "$work/host_tests.log" 2>/dev/null || true) - host_passed ))
grep -hE '^(pagedkv GPU tests: seed|Randomness seeded)' "$work/tests.log" "$work"/tests/*.log 2>/dev/null | sort -u | head -n 3
write_summary
say "GPU tests ($mode): $passed passed, $failed failed, $skipped skipped, $not_finished not finished of $registered registered (${st_secs[tests]}s of ${st_cap[tests]}s, per-test timeout ${per_test}s); host-only launcher tests: $host_passed passed, $host_failed failed"

# ---- 5. benchmark (also when a test failed: the numbers are still informative) ------------------------------------
if [[ -x "$bench_bin" ]]; then
  run_stage bench "$bench_bin" --quick --seed "$seed" --json "$work/bench.json" > "$work/bench.txt" 2>&1
  bench_rc=$?
else
  echo "bench_kernels not built" > "$work/bench.txt"
  skip_stage bench "failed (not built)"
  bench_rc=1
fi
if [[ -s "$work/bench.json" ]]; then
  bench_rows=$(grep -c '"name":' "$work/bench.json" || true)
  bench_unsupported=$(grep -c '"unsupported":' "$work/bench.json" || true)
  bench_skipped=$(grep -c '"skipped":' "$work/bench.json" || true)
fi
say "benchmark: ${st_status[bench]} (${st_secs[bench]}s of ${st_cap[bench]}s): $bench_rows rows ($bench_unsupported unsupported, $bench_skipped skipped)"

# ---- 6. torch scaled_dot_product_attention on the same shapes (informative; skipped with a note without torch) -----
torch_py=$(command -v python3 || true)
if (( probe_rc != 0 )); then
  skip_stage torch "not run (no device)"
  torch_note="not run: no CUDA device"
elif [[ -z "$torch_py" ]]; then
  skip_stage torch "skipped (no python3)"
  torch_note="skipped: no python3 on this machine"
elif [[ ! -s "$work/bench.json" ]]; then
  skip_stage torch "not run (no bench.json)"
  torch_note="not run: the kernel benchmark wrote no bench.json"
else
  run_stage torch env PYTHONUNBUFFERED=1 "$torch_py" "$root/benchmarks/cuda/bench_torch_sdpa.py" \
    --bench-json "$work/bench.json" --seed "$seed" > "$work/torch.txt" 2>&1
  torch_note=$(grep -m1 '^torch_sdpa:' "$work/torch.txt" | cut -d: -f2- | sed 's/^ //')
  torch_note=${torch_note:-"${st_status[torch]} (see torch.txt)"}
fi
[[ -s "$work/bench.json" ]] && cp -f "$work/bench.json" "$out/bench.json"
write_summary

# ---- 6b. what the README claims runs: examples/decode_loop --device cuda and the installed CUDA consumer ------------
# The top-level project (host library + kernels), configured against .gpu-deps/prefix (OpenSSL, xxHash, CLI11,
# nlohmann_json, staged by scripts/stage-gpu-deps.sh): build decode_loop and run it on the device (every step
# checked against float64, exit 0), install, then configure / build / run tests/package/cuda against the install
# (find_package(pagedkv COMPONENTS cuda); exit 0 with a device). Logs: consumers.log.
consumers_note=""
deps_prefix="$root/.gpu-deps/prefix"
if [[ "$mode" == bundle ]]; then
  skip_stage consumers "not run (prebuilt bundle: no toolchain build)"
elif [[ ! -f "$deps_prefix/include/openssl/evp.h" || ! -f "$deps_prefix/lib/libcrypto.a" ]]; then
  skip_stage consumers "not run (missing .gpu-deps/prefix: re-run scripts/stage-gpu-deps.sh)"
else
  export GC_PREFIX="$deps_prefix" GC_TOP="$build-top" GC_NODEV=$(( probe_rc != 0 ))
  run_stage consumers bash -c '
    set -o pipefail
    log="$GC_WORK/consumers.log"
    step() { echo "== $*" >> "$log"; }
    step "configure the top-level project (tests and benchmarks off)"
    cmake -S "$GC_ROOT" -B "$GC_TOP" $GC_GEN -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$GC_ARCH" \
      -DCMAKE_PREFIX_PATH="$GC_PREFIX" -DOPENSSL_ROOT_DIR="$GC_PREFIX" -DOPENSSL_USE_STATIC_LIBS=TRUE \
      -DPAGEDKV_XXHASH_INCLUDE_DIR="$GC_PREFIX/include" -DPAGEDKV_BUILD_TESTS=OFF -DPAGEDKV_BUILD_BENCHMARKS=OFF \
      -DPAGEDKV_BUILD_EXAMPLES=ON -DPAGEDKV_ENABLE_EVENTS_ZMQ=OFF -DPAGEDKV_BUILD_PYTHON=OFF \
      -DCMAKE_INSTALL_PREFIX="$GC_TOP/install" >> "$log" 2>&1 || exit 11
    step "build decode_loop"
    cmake --build "$GC_TOP" -j "$GC_JOBS" --target decode_loop >> "$log" 2>&1 || exit 12
    if (( GC_NODEV )); then
      step "no CUDA device: decode_loop --device cuda not run"
    else
      step "decode_loop --device cuda"
      "$GC_TOP/examples/decode_loop" --device cuda >> "$log" 2>&1 || exit 13
      step "decode_loop --device cuda --dtype bf16 --block-size 1 --forks 3"
      "$GC_TOP/examples/decode_loop" --device cuda --dtype bf16 --block-size 1 --forks 3 >> "$log" 2>&1 || exit 13
    fi
    step "install, then tests/package/cuda against the install"
    cmake --build "$GC_TOP" -j "$GC_JOBS" >> "$log" 2>&1 || exit 14
    rm -rf "$GC_TOP/install" "$GC_TOP-consumer"
    cmake --install "$GC_TOP" >> "$log" 2>&1 || exit 14
    # The installed config calls find_dependency(OpenSSL): the same staged static libcrypto.
    cmake -S "$GC_ROOT/tests/package/cuda" -B "$GC_TOP-consumer" $GC_GEN -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$GC_TOP/install" -DCMAKE_CUDA_ARCHITECTURES="$GC_ARCH" \
      -DOPENSSL_ROOT_DIR="$GC_PREFIX" -DOPENSSL_USE_STATIC_LIBS=TRUE >> "$log" 2>&1 || exit 15
    cmake --build "$GC_TOP-consumer" >> "$log" 2>&1 || exit 15
    rc=0
    "$GC_TOP-consumer/pagedkv_cuda_consumer" >> "$log" 2>&1 || rc=$?
    echo "pagedkv_cuda_consumer exit $rc" >> "$log"
    if (( GC_NODEV )); then [[ $rc == 77 ]] || exit 16; else [[ $rc == 0 ]] || exit 16; fi'
  rc=$?
  case $rc in
    0) consumers_note="decode_loop --device cuda: passed (2 runs); installed CUDA consumer: passed"
       (( probe_rc != 0 )) && consumers_note="built (no device: decode_loop not run; the consumer exited 77)" ;;
    11) consumers_note="top-level configure failed (consumers.log)" ;;
    12) consumers_note="decode_loop did not build (consumers.log)" ;;
    13) consumers_note="decode_loop --device cuda failed (consumers.log)" ;;
    14) consumers_note="build or install of the top-level project failed (consumers.log)" ;;
    15) consumers_note="tests/package/cuda did not configure or build against the install (consumers.log)" ;;
    16) consumers_note="the installed CUDA consumer failed (consumers.log)" ;;
    124) consumers_note="cut at its cap (${st_cap[consumers]} s)" ;;
    125) consumers_note="not run (deadline)" ;;
    *) consumers_note="failed (rc $rc, consumers.log)" ;;
  esac
  (( rc != 0 && rc != 124 && rc != 125 )) && st_status[consumers]="failed: $consumers_note"
  write_summary
fi
say "consumers: ${st_status[consumers]}${consumers_note:+: $consumers_note}"

# ---- 7. compute-sanitizer on the reduced grid ("[sanitize]": every kernel), memcheck and racecheck first ----------
san=$(command -v compute-sanitizer || true)
[[ -z "$san" && -x /usr/local/cuda/bin/compute-sanitizer ]] && san=/usr/local/cuda/bin/compute-sanitizer
san_errors=""
for tool in memcheck racecheck synccheck initcheck; do
  if (( probe_rc != 0 )); then
    skip_stage "$tool" "not run (no device)"
  elif [[ "${GPU_CHECK_SANITIZER:-1}" != 1 ]]; then
    skip_stage "$tool" "not run (GPU_CHECK_SANITIZER=0)"
  elif [[ -z "$san" ]]; then
    skip_stage "$tool" "missing (no compute-sanitizer)"
  else
    run_stage "$tool" "$san" --tool "$tool" --error-exitcode 99 "$test_bin" "[sanitize]" \
      -w NoTests > "$work/sanitizer_$tool.log" 2>&1
    rc=$?
    line=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$work/sanitizer_$tool.log" | tail -n1 | sed 's/^=* *//')
    if (( rc == 0 )); then
      st_status[$tool]="clean (${line:-no summary})"
    elif (( rc != 124 && rc != 125 )); then
      st_status[$tool]="errors (${line:-rc $rc})"
      san_errors+="$tool "
    fi
    write_summary
  fi
done
say "compute-sanitizer: memcheck ${st_status[memcheck]}; racecheck ${st_status[racecheck]}; synccheck ${st_status[synccheck]}; initcheck ${st_status[initcheck]}"

# ---- 8. before / after (GPU_CHECK_BASELINE_BENCH; informative, never part of the verdict) --------------------------
ab_note=""
if [[ -n "${GPU_CHECK_BASELINE_BENCH:-}" ]]; then
  ab_left=$(( $(remaining) - 5 ))
  if (( probe_rc != 0 )); then
    ab_note="not run (no device)"
  elif [[ ! -x "$GPU_CHECK_BASELINE_BENCH" ]]; then
    ab_note="not run: '$GPU_CHECK_BASELINE_BENCH' is not an executable file"
  elif [[ ! -x "$bench_bin" ]]; then
    ab_note="not run: this build has no bench_kernels"
  elif (( ab_left < 20 )); then
    ab_note="not run (deadline: ${ab_left}s left)"
  else
    timeout -k 5 $(( ab_left / 2 )) "$GPU_CHECK_BASELINE_BENCH" --quick --seed "$seed" --json "$out/ab-base.json" \
      > "$work/ab-base.txt" 2>&1
    ab_rc_base=$?
    timeout -k 5 $(( ab_left / 2 )) "$bench_bin" --quick --seed "$seed" --json "$out/ab-new.json" > "$work/ab-new.txt" 2>&1
    ab_rc_new=$?
    if (( ab_rc_base == 0 && ab_rc_new == 0 )) && command -v python3 >/dev/null 2>&1 &&
       python3 "$root/scripts/bench-compare.py" "$out/ab-base.json" "$out/ab-new.json" > "$work/ab.txt" 2>&1; then
      ab_note="ran: baseline then this build, --quick, seed $seed (ab-base.json, ab-new.json)"
    else
      ab_note="failed: baseline rc $ab_rc_base, this build rc $ab_rc_new (ab-base.txt, ab-new.txt, ab.txt in logs)"
    fi
  fi
  say "before / after: $ab_note"
  write_summary
fi

# ---- 9. verdict ---------------------------------------------------------------------------------------------------
reason=""
if (( probe_rc != 0 )); then reason="no CUDA device ($probe_error)"
elif (( registered == 0 || passed + failed == 0 )); then reason="no GPU test ran (tests ${st_status[tests]})"
elif (( failed > 0 )); then reason="GPU tests failed: $failed_names"
elif (( not_finished > 0 )); then reason="$not_finished GPU tests did not finish (tests ${st_status[tests]})"
elif (( skipped > 0 )); then reason="GPU tests skipped: $skipped_names"
elif (( passed != registered )); then reason="$passed of $registered registered GPU tests passed"
elif (( tests_rc != 0 )); then reason="ctest exited $tests_rc (host-only tests: $host_failed failed)"
elif (( host_failed > 0 )); then reason="host-only launcher tests failed"
elif [[ -n "$san_errors" ]]; then reason="compute-sanitizer reported errors: $san_errors(sanitizer_*.log in logs.tar.gz)"
elif (( bench_rc != 0 && bench_rc != 124 && bench_rc != 125 )); then reason="bench_kernels exited $bench_rc"
elif [[ "${st_status[consumers]}" == failed* ]]; then reason="consumers stage: $consumers_note"
fi
if [[ -n "$reason" ]]; then finish FAIL "$reason" 1; fi
incomplete=""
[[ "${st_status[bench]}" == ok ]] || incomplete+="bench ${st_status[bench]}; "
[[ "${st_status[consumers]}" == ok ]] || incomplete+="consumers ${st_status[consumers]}; "
for tool in memcheck racecheck synccheck initcheck; do
  [[ "${st_status[$tool]}" == clean* ]] || incomplete+="$tool ${st_status[$tool]}; "
done
if [[ -n "$incomplete" ]]; then finish INCOMPLETE "${incomplete%; }" 4; fi
finish PASS "" 0
