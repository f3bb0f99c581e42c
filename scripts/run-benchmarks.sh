#!/usr/bin/env bash
# Builds the host benchmarks (Release, no CUDA) and runs every benchmarks/bench_* program with 5 repetitions,
# aggregates only (mean, median, stddev, cv), writing one JSON file per program.
#   scripts/run-benchmarks.sh [OUT_DIR] [extra Google Benchmark flags...]
#   OUT_DIR defaults to build-bench/results. Extra flags, e.g. --benchmark_filter=BM_CacheHit, go to every program.
#   Environment: BUILD_DIR (default build-bench), MIN_TIME seconds per repetition (default 0.5),
#                REPETITIONS (default 5).
# Quote the medians (`*_median` rows): on a shared machine they are the robust figure. Times are CPU times.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-build-bench/results}
[ $# -gt 0 ] && shift
build_dir=${BUILD_DIR:-build-bench}
min_time=${MIN_TIME:-0.5}
reps=${REPETITIONS:-5}

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDKV_ENABLE_CUDA=OFF \
      -DPAGEDKV_BUILD_TESTS=OFF -DPAGEDKV_BUILD_EXAMPLES=OFF -DPAGEDKV_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$build_dir"

mkdir -p "$out_dir"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p') x $(nproc)"
  echo "compiler: $(c++ --version | head -n1)"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out_dir/machine.txt"

shopt -s nullglob
for exe in "$build_dir"/benchmarks/bench_*; do
  [ -x "$exe" ] && [ -f "$exe" ] || continue
  name=$(basename "$exe")
  echo "== $name (load $(cut -d' ' -f1-3 /proc/loadavg))"
  "$exe" --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
         --benchmark_min_time="$min_time" \
         --benchmark_out="$out_dir/$name.json" --benchmark_out_format=json "$@"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out_dir/machine.txt"
echo "results in $out_dir"
