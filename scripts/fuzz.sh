#!/usr/bin/env bash
# Builds the fuzz targets with clang (libFuzzer + ASan + UBSan, tests/fuzz) and fuzzes each for a bounded time.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS per target (default 60); TARGET: manager, manager_groups, manager_recurrent, trace, index (default all five). The targets run
# side by side, one per core. Each starts from its committed seed corpus (tests/fuzz/corpus/<target>) plus what earlier runs of this
# script found (build-fuzz/corpus/<target>, kept between runs, never committed). Before fuzzing, ctest replays the
# seed corpora and runs the replay input tests. A finding (a crash, an invariant violation, a leak, a timeout of
# 10 s on one input) is saved as build-fuzz/findings/<target>-crash-*; replay it with
#   build-fuzz/fuzz_<target> build-fuzz/findings/<file>      (PAGEDKV_FUZZ_VERBOSE=1 prints every call)
# Exit status: 0 when no target found anything. See docs/fuzzing.md.
#
# Environment: CXX (default clang++-14, else clang++), PAGEDKV_FUZZ_JOBS (parallel targets, default nproc),
# PAGEDKV_FUZZ_FLAGS (extra libFuzzer flags, e.g. "-max_len=1024").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

seconds=60
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
  seconds=$1
  shift
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(manager manager_groups manager_recurrent trace index)
for t in "${targets[@]}"; do
  case $t in manager | manager_groups | manager_recurrent | trace | index) ;;
    *) echo "fuzz.sh: unknown target '$t' (manager, manager_groups, manager_recurrent, trace, index)" >&2; exit 2 ;;
  esac
done

cxx=${CXX:-}
if [ -z "$cxx" ]; then
  if command -v clang++-14 >/dev/null; then cxx=clang++-14; elif command -v clang++ >/dev/null; then cxx=clang++; fi
fi
if [ -z "$cxx" ] || ! "$cxx" --version | grep -q clang; then
  echo "fuzz.sh: needs clang (Debian: clang-14 libclang-rt-14-dev; scripts/install-deps.sh installs them)" >&2
  exit 2
fi

build=build-fuzz
echo "fuzz.sh: building $build with $cxx"
cmake -S tests/fuzz -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DPAGEDKV_FUZZ_ENGINE=libfuzzer >/dev/null
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure

# Sanitizer settings: leaks are findings; UBSan reports abort (the build already makes them fatal).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

mkdir -p "$build/findings"
jobs=${PAGEDKV_FUZZ_JOBS:-$(nproc)}

declare -A logs
# -len_control=0: mutate up to -max_len from the start. libFuzzer's default length control grows the limit slowly
# from the corpus' shortest inputs, which kept the manager targets at ~72-byte inputs (about 25 of 160 calls) for a
# whole CI run (issue 32); long operation sequences are where the manager's states compound.
run_target() {  # run_target <target>: fuzz it for $seconds, log to $build/fuzz-<target>.log
  local t=$1 work="$build/corpus/$t"
  mkdir -p "$work"
  # shellcheck disable=SC2086  # PAGEDKV_FUZZ_FLAGS is a list of flags
  "$build/fuzz_$t" "$work" "tests/fuzz/corpus/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=$(case $t in manager*) echo 512 ;; *) echo 4096 ;; esac) -len_control=0 -print_final_stats=1 \
    -artifact_prefix="$build/findings/$t-" ${PAGEDKV_FUZZ_FLAGS:-} >"$build/fuzz-$t.log" 2>&1
}
echo "fuzz.sh: fuzzing ${targets[*]} for ${seconds}s each ($jobs at a time)"
status=0
for t in "${targets[@]}"; do logs[$t]="$build/fuzz-$t.log"; done
# At most $jobs targets at a time: start the next one whenever one finishes.
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || status=1
    running=$((running - 1))
  fi
  run_target "$t" &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
  wait -n || status=1
  running=$((running - 1))
done

# Summary: libFuzzer's final line (coverage counters cov / ft, corpus) and its run statistics, per target.
for t in "${targets[@]}"; do
  log=${logs[$t]}
  echo "--- fuzz_$t"
  grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' "$log" || true
  if grep -qE 'ERROR: (libFuzzer|AddressSanitizer|LeakSanitizer)|runtime error:|==== pagedkv' "$log"; then
    status=1
    echo "FINDING in fuzz_$t (full log: $log):"
    grep -E -A30 '==== pagedkv|ERROR: |runtime error:' "$log" | grep -v '^    #[0-9]' | head -60
    ls "$build/findings/$t-"* 2>/dev/null || true
  fi
done
if [ "$status" -ne 0 ]; then
  echo "fuzz.sh: FINDINGS (see above)"
  exit 1
fi
echo "fuzz.sh: no findings"
