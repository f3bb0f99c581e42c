#!/usr/bin/env bash
# The instruction-count gate of the manager split (issue 32; docs/benchmarks.md "Manager split gate"): runs fixed,
# deterministic workloads under callgrind and prints one row per workload (instructions, Ir). Each move of the split
# reruns it identically and compares with the base table (at most +0.5% on every row).
#
#   scripts/callgrind-gate.sh BUILD [WORKLOAD...]
#
# BUILD: a Release build directory of this tree (cmake -DCMAKE_BUILD_TYPE=Release) with the targets `pagedkv` and
# `pagedkv-replay` built. The script compiles scripts/callgrind-gate.cpp (the decode / admit+free / groups
# workloads, see its header) into BUILD/callgrind-gate with the Release flags, against this tree's headers and
# BUILD/libpagedkv.a. Workloads (default all):
#   decode64 decode256 admitfree-xxh3 admitfree-sha256 groups0 groups1 groups2   Ir inside gate_measured() only
#   replay-xxh3   pagedkv-replay --mode prefix, Mooncake synthetic trace, first 1500 requests, 1e6 and 1e7
#                 tokens, XXH3: the whole process (trace parsing included: the same input every run); its
#                 checksum is its output less the timings
# Environment: PAGEDKV_GATE_OUT (default BUILD/gate): where the callgrind outputs go; PAGEDKV_GATE_DRIVER: a driver
# binary built already (skips the compile); PAGEDKV_GATE_REPLAY: the pagedkv-replay binary to run.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=${1:?usage: scripts/callgrind-gate.sh BUILD [WORKLOAD...]}
shift
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] ||
  workloads=(decode64 decode256 admitfree-xxh3 admitfree-sha256 groups0 groups1 groups2 replay-xxh3)
out=${PAGEDKV_GATE_OUT:-$build/gate}
mkdir -p "$out"

driver=${PAGEDKV_GATE_DRIVER:-}
if [ -z "$driver" ]; then
  driver=$build/callgrind-gate
  ${CXX:-c++} -std=c++20 -O3 -DNDEBUG -DPAGEDKV_STATIC_DEFINE -I "$root/include" \
    scripts/callgrind-gate.cpp "$build/libpagedkv.a" -lcrypto -o "$driver"
fi

# ir <callgrind.out file>: the total of its events line (Ir).
ir() { sed -n 's/^summary: //p; s/^totals: //p' "$1" | head -1 | awk '{print $1}'; }

printf '%-18s %16s  %s\n' workload Ir checksum
for w in "${workloads[@]}"; do
  f=$out/callgrind.$w.out
  case $w in
    replay-xxh3)
      valgrind --tool=callgrind --callgrind-out-file="$f" "${PAGEDKV_GATE_REPLAY:-$build/examples/pagedkv-replay}" \
        data/traces/mooncake-fast25/synthetic_trace.jsonl --mode prefix --block-size 16 --capacity-tokens 1e6,1e7 \
        --hash xxh3 --limit 1500 --json --no-progress >"$out/$w.stdout" 2>"$out/$w.stderr"
      check=$(sed -E 's/"(manager_seconds|ns_per_block_op)":[^,}]*//g' "$out/$w.stdout" | md5sum | cut -c1-12) ;;
    *)
      valgrind --tool=callgrind --callgrind-out-file="$f" --collect-atstart=no --toggle-collect=gate_measured \
        "$driver" "$w" >"$out/$w.stdout" 2>"$out/$w.stderr"
      check=$(awk '{print $3}' "$out/$w.stdout") ;;
  esac
  printf '%-18s %16s  %s\n' "$w" "$(ir "$f")" "$check"
done
