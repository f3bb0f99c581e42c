#!/usr/bin/env bash
# scripts/pd.sh: prefill/decode disaggregation over NIXL on 127.0.0.1 (examples/pd, docs/disaggregation.md).
# Builds the example (cmake target pagedkv-pd only, in $PD_BUILD, default build-pd), then launches a prefill
# process and a decode process that hand KV blocks to each other through NIXL, and checks every request's outputs
# bit for bit against one engine doing both. The last line of each run:
#   pd: PASS|FAIL requests=N identical=N bytes_moved=B leaked_blocks=PREFILL/DECODE ...
# Usage: scripts/pd.sh [normal|hybrid|faults|replay|all|kill|drop-notify|stale|layout] [extra pagedkv-pd options]
#   normal (default): the hand-offs (up to 4 READs in flight, --inflight), the side-by-side GB/s (pagedkv vs raw
#     NIXL: the same C API calls without pagedkv, alternated) and leak counts
#   hybrid: a hybrid model (--window 24: sliding-window layers beside full-attention ones, two KV-cache groups):
#     only the window group's in-window blocks move, outputs bit-identical to one engine doing both
#   faults: the four fault scenarios (kill -9 of prefill mid-transfer, dropped read-done, stale descriptor,
#           layout mismatch: each fingerprint field in turn, then a decode engine with another block size), each
#           with its own PASS line
#   replay: 300 requests of Mooncake's conversation trace through a prefill and a decode manager in one process
#           (in-process transport): bytes moved with and without decode's own prefix hits, leaks
#   all: normal + hybrid + faults + replay
# Settings: UCX_MODULES=^ib (Debian's rdma providers make NIXL segfault at exit), UCX_NET_DEVICES=lo, no NIXL
# progress thread (the example polls). Needs nixl-cu12 1.5.1 for python3; without it this FAILS with the command.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${PD_BUILD:-build-pd}
mode=${1:-normal}
[ $# -gt 0 ] && shift

if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))' 2>/dev/null)" != "1.5.1" ]; then
  echo "pd: FAIL NIXL 1.5.1 is not installed for python3; install it: python3 -m pip install --no-deps nixl-cu12==1.5.1"
  exit 1
fi
if [ ! -f "$build/build.ninja" ] && [ ! -f "$build/Makefile" ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDKV_ENABLE_CUDA=OFF -DPAGEDKV_BUILD_TESTS=OFF \
        -DPAGEDKV_BUILD_BENCHMARKS=OFF -DPAGEDKV_ENABLE_EVENTS_ZMQ=OFF "${launcher[@]}" >/dev/null
fi
cmake --build "$build" --target pagedkv-pd >/dev/null
bin="$build/examples/pagedkv-pd"
export UCX_MODULES='^ib' UCX_NET_DEVICES=lo

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# run NAME [options for both processes] -- [options for decode only]: one prefill process and one decode process.
run() {
  local name=$1; shift
  local common=() dec=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do common+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  dec=("$@")
  rm -f "$tmp/port"
  "$bin" --role prefill --port 0 --port-file "$tmp/port" "${common[@]}" >"$tmp/$name.prefill.log" 2>&1 &
  local ppid=$!
  for _ in $(seq 1200); do [ -s "$tmp/port" ] && break; sleep 0.05; done  # NIXL start-up: ~2 s, more under load
  if [ ! -s "$tmp/port" ]; then
    cat "$tmp/$name.prefill.log"; kill "$ppid" 2>/dev/null || true
    echo "pd: FAIL scenario=$name: the prefill process did not start"; return 1
  fi
  local rc=0
  timeout 120 "$bin" --role decode --port "$(cat "$tmp/port")" "${common[@]}" "${dec[@]}" >"$tmp/$name.decode.log" 2>&1 || rc=$?
  local prc=0
  wait "$ppid" || prc=$?
  sed 's/^/  prefill| /' "$tmp/$name.prefill.log" | grep -v '^  prefill| pd:' || true
  grep -v '^pd:' "$tmp/$name.decode.log" | sed 's/^/  decode | /' || true
  local last
  last=$(grep '^pd:' "$tmp/$name.decode.log" | tail -1)
  echo "${last:-pd: FAIL (no result line)} scenario=$name"
  # The prefill process must exit 0 (zero leaks), except where the scenario kills it (-9: 137).
  if [ "${name%%-*}" = kill ]; then [ "$prc" -eq 137 ] || { echo "pd: FAIL scenario=kill: prefill exit $prc, not 137"; return 1; }
  elif [ "$prc" -ne 0 ]; then echo "pd: FAIL scenario=$name: prefill exit $prc"; return 1; fi
  return "$rc"
}

status=0
if [ "$mode" = normal ] || [ "$mode" = all ]; then
  # The decode process compares each request with the code of --role both run in its own process; a separate
  # --role both process must also print the same digest of every request's outputs.
  want=$("$bin" --role both "$@" | sed -n 's/.*outputs_digest=\([0-9a-f]*\).*/\1/p')
  echo "one engine doing both (--role both, its own process): outputs_digest=$want"
  run normal "$@" || status=1
  got=$(grep '^pd:' "$tmp/normal.decode.log" | sed -n 's/.*outputs_digest=\([0-9a-f]*\).*/\1/p')
  if [ -z "$want" ] || [ "$want" != "$got" ]; then
    echo "pd: FAIL outputs_digest '$got' of the P/D run differs from --role both's '$want'"; status=1
  fi
fi
if [ "$mode" = hybrid ] || [ "$mode" = all ]; then
  # A hybrid model (--window 24: the odd layers sliding-window layers, KV-cache group 1): only the window group's
  # blocks inside the decode engine's first window move; outputs bit-identical to one engine doing both.
  want=$("$bin" --role both --window 24 --requests 8 "$@" | sed -n 's/.*outputs_digest=\([0-9a-f]*\).*/\1/p')
  echo "one hybrid engine doing both (--role both --window 24): outputs_digest=$want"
  run hybrid --window 24 --requests 8 --reps 0 "$@" || status=1
  got=$(grep '^pd:' "$tmp/hybrid.decode.log" | sed -n 's/.*outputs_digest=\([0-9a-f]*\).*/\1/p')
  if [ -z "$want" ] || [ "$want" != "$got" ]; then
    echo "pd: FAIL outputs_digest '$got' of the hybrid P/D run differs from --role both's '$want'"; status=1
  fi
  if grep -q '^pd:.* blocks_left_out=0 ' "$tmp/hybrid.decode.log"; then
    echo "pd: FAIL the hybrid run left no window block out of its READs"; status=1
  fi
fi
for f in kill drop-notify stale layout; do
  if [ "$mode" = faults ] || [ "$mode" = all ] || [ "$mode" = "$f" ]; then
    case $f in
      kill)        run kill --fault kill --requests 6 --reps 0 "$@" || status=1
                   run kill-fail --fault kill --on-failure fail --requests 6 --reps 0 "$@" || status=1 ;;
      # 1.5 s: the dropped lease expires within the run; the others' read-dones come well before (a 300 ms lease
      # expired a second one on a loaded 2-core machine, session 44).
      drop-notify) run drop-notify --fault drop-notify --lease-ms 1500 --requests 6 --reps 0 "$@" || status=1 ;;
      stale)       run stale --fault stale --requests 6 --reps 0 "$@" || status=1 ;;
      layout)      run layout --fault layout --requests 2 --reps 0 "$@" || status=1  # 8 fields, one process pair
                   run layout-engine --fault layout-engine --requests 6 --reps 0 "$@" -- --block-size 32 || status=1 ;;
    esac
  fi
done
if [ "$mode" = replay ] || [ "$mode" = all ]; then
  "$bin" --role replay --trace data/traces/mooncake-fast25/conversation_trace.jsonl --limit 300 "$@" || status=1
fi
exit $status
