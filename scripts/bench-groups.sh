#!/usr/bin/env bash
# Old vs new, side by side, for the one-manager change (issue 17; docs/benchmarks.md "One manager (issue 17): old vs
# new"): runs the same measurements from two Release builds in turn (new, old, new, old, ...), N rounds after one
# warm-up round, and prints medians, min-max spreads and the pairwise new/old ratios with a verdict per row.
#
#   scripts/bench-groups.sh run NEW_SRC NEW_BUILD OLD_SRC OLD_BUILD OUT_DIR [ROUNDS]   (ROUNDS default 5)
#   scripts/bench-groups.sh summarize OUT_DIR
#   scripts/bench-groups.sh command SUITE SIDE NEW_SRC NEW_BUILD OLD_SRC OLD_BUILD      (prints one shell command)
#
# NEW_BUILD / OLD_BUILD: Release build directories of NEW_SRC / OLD_SRC (cmake -DCMAKE_BUILD_TYPE=Release with
# benchmarks and examples) holding benchmarks/bench_prefix_cache, benchmarks/bench_decode_step and
# examples/pagedkv-replay; NEW_BUILD also benchmarks/bench_groups. The old tree has no bench_groups: `run` compiles
# NEW_SRC/benchmarks/bench_groups.cpp against OLD_SRC/include and OLD_BUILD/libpagedkv.a (its one-group benchmarks
# only) into OLD_BUILD/bench_groups_old.
# Suites (each run is one process; its stdout is appended to OUT_DIR/<suite>.<side>.json, stderr to .err):
#   replay-xxh3, replay-sha256  pagedkv-replay, Mooncake synthetic trace, prefix mode, 1e6 and 1e7 tokens
#   admit                       bench_prefix_cache BM_AdmitFree<*>/2048
#   hostmem                     bench_prefix_cache BM_HostMemoryPerBlock/1000000 (its own process: RSS growth)
#   decode                      bench_decode_step BM_DecodeStep/64/32768 and /256/131072
#   groups                      bench_groups (Azure admission + build, kNoCapacity retries, decode builds)
# The first run of each side in every file is the warm-up and is dropped by `summarize`.
set -euo pipefail

suites="replay-xxh3 replay-sha256 admit hostmem decode groups"

# command SUITE SIDE NEW_SRC NEW_BUILD OLD_SRC OLD_BUILD: the command line of one run (SIDE new or old).
command_of() {
  local suite=$1 side=$2 new_src=$3 new_build=$4 old_build=$6
  local b=$new_build
  [ "$side" = old ] && b=$old_build
  local gb="--benchmark_format=json --benchmark_min_time=0.3"
  local trace="$new_src/data/traces/mooncake-fast25/synthetic_trace.jsonl"
  case $suite in
    replay-xxh3|replay-sha256)
      echo "$b/examples/pagedkv-replay $trace --mode prefix --block-size 16 --capacity-tokens 1e6,1e7 --hash ${suite#replay-} --json" ;;
    admit) echo "$b/benchmarks/bench_prefix_cache $gb '--benchmark_filter=^BM_AdmitFree<.*>/prompt_tokens:2048\$'" ;;
    hostmem) echo "$b/benchmarks/bench_prefix_cache --benchmark_format=json '--benchmark_filter=^BM_HostMemoryPerBlock/pool_blocks:1000000'" ;;
    decode) echo "$b/benchmarks/bench_decode_step $gb '--benchmark_filter=^BM_DecodeStep/batch:(64/pool_blocks:32768|256/pool_blocks:131072)\$'" ;;
    groups)
      if [ "$side" = old ]; then echo "$b/bench_groups_old $gb"; else echo "$b/benchmarks/bench_groups $gb"; fi ;;
    *) echo "unknown suite $suite" >&2; return 2 ;;
  esac
}

build_old_groups() {  # NEW_SRC OLD_SRC OLD_BUILD
  local new_src=$1 old_src=$2 old_build=$3
  c++ -DPAGEDKV_STATIC_DEFINE -I"$old_src/include" -O3 -DNDEBUG -std=c++20 \
      -DPAGEDKV_BENCH_TRACE_DIR="\"$new_src/data/traces/azure-llm-2023\"" \
      -o "$old_build/bench_groups_old" "$new_src/benchmarks/bench_groups.cpp" "$new_src/benchmarks/main.cpp" \
      "$old_build/libpagedkv.a" \
      -lbenchmark -lcrypto -lpthread
}

summarize() {
  python3 - "$1" <<'EOF'
import json, os, statistics, sys

out = sys.argv[1]


def runs(suite, side):
    """The documents of OUT/<suite>.<side>.json in order (concatenated JSON values), warm-up dropped."""
    path = os.path.join(out, f"{suite}.{side}.json")
    if not os.path.exists(path):
        return []
    text, dec, pos, docs = open(path).read(), json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            doc, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:  # a run still writing, or killed: its partial output is not counted
            break
        docs.append(doc)
    return docs


def replay_series(suite, side):
    rows = runs(suite, side)  # JSON lines: one row per capacity per run
    series = {}
    for r in rows:
        series.setdefault(r["capacity_tokens"], []).append(r)
    return {c: v[1:] for c, v in series.items()}  # drop the warm-up run


def gb_series(suite, side):
    series = {}
    for doc in runs(suite, side)[1:]:  # drop the warm-up run
        for b in doc["benchmarks"]:
            series.setdefault(b["name"], []).append(b)
    return series


def fmt(xs, digits=1):
    if not xs:
        return "-"
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


rows = []


def row(label, new, old, target, digits=1, lower_is_better=True):
    pairs = [a / b for a, b in zip(new, old) if b]
    ratio = statistics.median(pairs) if pairs else float("nan")
    verdict = "-"
    if target is not None and pairs:
        verdict = "within" if ratio <= target else "MISSED"
        verdict += f" (<= {target:g})"
    rows.append(f"| {label} | {fmt(new, digits)} | {fmt(old, digits)} | "
                f"{fmt(pairs, 3) if pairs else '-'} | {len(pairs)} | {verdict} |")


print("| measure | new: median (min-max) | old: median (min-max) | new / old: median of pairs (min-max) | pairs |"
      " verdict |")
print("|---|---:|---:|---:|---:|---|")
for h in ("xxh3", "sha256"):
    n, o = replay_series(f"replay-{h}", "new"), replay_series(f"replay-{h}", "old")
    for cap in sorted(n):
        nv = [r["ns_per_block_op"] for r in n[cap]]
        ov = [r["ns_per_block_op"] for r in o.get(cap, [])]
        hits = {r["hit_ratio"] for r in n[cap]} | {r["hit_ratio"] for r in o.get(cap, [])}
        row(f"replay prefix, synthetic, {cap:.0e} tokens, {h} (ns / block op; hit ratio {sorted(hits)})", nv, ov, 1.03)
n, o = gb_series("admit", "new"), gb_series("admit", "old")
for name in sorted(n):
    row(f"`{name}` (ns / prompt block)", [b["ns_per_prompt_block"] for b in n[name]],
        [b["ns_per_prompt_block"] for b in o.get(name, [])], 1.03)
n, o = gb_series("decode", "new"), gb_series("decode", "old")
for name in sorted(n):
    row(f"`{name}` (ns / sequence / step)", [b["ns_per_item"] for b in n[name]],
        [b["ns_per_item"] for b in o.get(name, [])], 1.03)
n, o = gb_series("hostmem", "new"), gb_series("hostmem", "old")
for name in sorted(n):
    for k in ("rss_bytes_per_block", "index_bytes_per_block"):
        row(f"`{name}` {k}", [b[k] for b in n[name]], [b[k] for b in o.get(name, [])], 1.03, 2)
n, o = gb_series("groups", "new"), gb_series("groups", "old")
for name in sorted(n):
    if "config:0" not in name:
        continue
    for k in ("ns_per_prompt_block", "ns_per_item"):
        if k in n[name][0]:
            row(f"`{name}` {k} (one group, informational)", [b[k] for b in n[name]],
                [b[k] for b in o.get(name, [])], None)
print("\n".join(rows))

# Mixed groups vs one group, new build only, pairwise within each run (same process).
print()
print("| Azure admission + build (new build) | one group: ns / prompt block | mixed: ns / prompt block |"
      " mixed / one: per prompt block | mixed: ns / pool block | mixed / one: per pool block | verdict (<= 1.3) |")
print("|---|---:|---:|---:|---:|---:|---|")
for name in sorted(n):
    if "BM_AzureAdmitBuild" not in name or "config:1" not in name:
        continue
    one = n[name.replace("config:1", "config:0")]
    mix = n[name]
    r_prompt = [a["ns_per_prompt_block"] / b["ns_per_prompt_block"] for a, b in zip(mix, one)]
    r_pool = [a["ns_per_pool_block"] / b["ns_per_pool_block"] for a, b in zip(mix, one)]
    v = lambda r: ("within" if statistics.median(r) <= 1.3 else "MISSED")
    print(f"| `{name.replace('/config:1', '')}` | {fmt([b['ns_per_prompt_block'] for b in one])} | "
          f"{fmt([b['ns_per_prompt_block'] for b in mix])} | {fmt(r_prompt, 2)} | "
          f"{fmt([b['ns_per_pool_block'] for b in mix])} | {fmt(r_pool, 2)} | "
          f"per pool block: {v(r_pool)}; per prompt block: {v(r_prompt)} |")

# Heap allocations after warm-up (operator new calls per operation), every run.
print()
print("| allocations after warm-up | new: median (min-max) | old: median (min-max) | target | verdict |")
print("|---|---:|---:|---:|---|")
for name in sorted(n):
    for k in ("allocs_per_admit", "allocs_per_build", "allocs_per_free", "allocs_per_retry", "allocs_per_append"):
        if k not in n[name][0]:
            continue
        nv = [b[k] for b in n[name]]
        ov = [b[k] for b in o.get(name, [])]
        target = "0" if k in ("allocs_per_admit", "allocs_per_build", "allocs_per_retry") else "-"
        verdict = "-" if target == "-" else ("met" if max(nv) == 0 else "MISSED")
        print(f"| `{name}` {k} | {fmt(nv, 3)} | {fmt(ov, 3) if ov else '-'} | {target} | {verdict} |")
EOF
}

case ${1:-} in
  command) shift; command_of "$@" ;;
  summarize) summarize "$2" ;;
  run)
    [ $# -ge 6 ] || { sed -n 2,20p "$0"; exit 2; }
    new_src=$2 new_build=$3 old_src=$4 old_build=$5 out=$6 rounds=${7:-5}
    mkdir -p "$out"
    [ -x "$old_build/bench_groups_old" ] || build_old_groups "$new_src" "$old_src" "$old_build"
    for s in $suites; do rm -f "$out/$s.new.json" "$out/$s.old.json" "$out/$s.new.err" "$out/$s.old.err"; done
    for ((i = 0; i <= rounds; ++i)); do  # round 0 is the warm-up
      for s in $suites; do
        for side in new old; do
          eval "$(command_of "$s" "$side" "$new_src" "$new_build" "$old_src" "$old_build")" \
            >>"$out/$s.$side.json" 2>>"$out/$s.$side.err"
        done
      done
      echo "round $i of $rounds done (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    done
    summarize "$out" ;;
  *) sed -n 2,20p "$0"; exit 2 ;;
esac
