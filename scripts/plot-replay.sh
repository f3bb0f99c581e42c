#!/usr/bin/env bash
# Draws the replay's hit-ratio plots (PNG, gnuplot) from the JSON lines of pagedkv-replay kept in
# benchmarks/results/, into docs/img/:
#   replay-fig9.png      hit ratio vs GPU capacity on the Mooncake synthetic trace (LRU): GPU only, GPU + a 5e7-token
#                        host tier (total and the GPU tier's part), beside Mooncake's published Fig. 9 points
#   replay-policies.png  hit ratio vs GPU capacity per eviction policy, GPU only and GPU + a 1e7-token host tier, on
#                        the Mooncake synthetic and conversation traces
#   replay-recurrent.png a hybrid Mamba model (full:12,mamba:36, Qwen3-Next's shape): hit ratio vs pool size for
#                        all attention, vLLM's align mode (one checkpoint per request) and checkpoints every
#                        1024 / 2048 tokens with and without the last checkpoint, on both Mooncake traces
# Usage: scripts/plot-replay.sh [--run [REPLAY_BINARY]]
#   --run  first re-generates the JSON (benchmarks/results/replay-prefix-*.json) with the replay binary (default
#          build-release/examples/pagedkv-replay; scripts/replay.sh builds it): about 5 minutes on 2 cores.
# Needs gnuplot (Debian: gnuplot-nox) and python3 (standard library: JSON lines -> gnuplot data). Not run by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

results=benchmarks/results
out=docs/img
fig9_json=$results/replay-prefix-synthetic-tiered-lru.json
policies_json=$results/replay-prefix-policies.json
recurrent_json=$results/replay-recurrent.json

if ! command -v gnuplot >/dev/null 2>&1; then
  echo "plot-replay: gnuplot is not installed; install the Debian package gnuplot-nox (sudo apt-get install -y gnuplot-nox)" >&2
  exit 2
fi
if ! command -v python3 >/dev/null 2>&1; then
  echo "plot-replay: python3 is not installed (needed to read the replay's JSON lines)" >&2
  exit 2
fi

if [ "${1:-}" = "--run" ]; then
  replay=${2:-build-release/examples/pagedkv-replay}
  if [ ! -x "$replay" ]; then
    echo "plot-replay: $replay is not an executable; build it with scripts/replay.sh or pass its path" >&2
    exit 2
  fi
  syn=data/traces/mooncake-fast25/synthetic_trace.jsonl
  conv=data/traces/mooncake-fast25/conversation_trace.jsonl
  "$replay" "$syn" --mode prefix --capacity-tokens 1e6,3e6,1e7,5e7 --host-capacity-tokens 5e7 --offload write-back \
    --json --no-progress > "$fig9_json"
  : > "$policies_json"
  for t in "$syn" "$conv"; do
    for p in "--eviction lru" "--eviction slru" "--eviction priority" "--eviction priority --head-priority 2048:80"; do
      # shellcheck disable=SC2086  # $p is several arguments
      "$replay" "$t" --mode prefix --capacity-tokens 1e6,3e6,1e7 --host-capacity-tokens 1e7 $p --json --no-progress \
        >> "$policies_json"
    done
  done
  : > "$recurrent_json"
  for t in "$conv" "$syn"; do
    "$replay" "$t" --mode prefix --model-layers full:12,mamba:36 --capacity-tokens 1e6,3e6,1e7,3e7 --hash xxh3 \
      --json --no-progress >> "$recurrent_json"
  done
fi

for f in "$fig9_json" "$policies_json" "$recurrent_json"; do
  if [ ! -s "$f" ]; then
    echo "plot-replay: $f is missing or empty; run scripts/plot-replay.sh --run" >&2
    exit 2
  fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# JSON lines -> whitespace-separated data files, one per series.
python3 - "$fig9_json" "$policies_json" "$tmp" "$recurrent_json" <<'EOF'
import json, sys, os
fig9, policies, tmp, recurrent = sys.argv[1:5]
def rows(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]
def write(name, lines):
    with open(os.path.join(tmp, name), "w") as f:
        f.write("\n".join(lines) + "\n")
r = rows(fig9)
single = sorted((x for x in r if x.get("host_capacity_tokens", 0) == 0), key=lambda x: x["capacity_tokens"])
tiered = sorted((x for x in r if x.get("host_capacity_tokens", 0) > 0), key=lambda x: x["capacity_tokens"])
write("fig9_single.dat", [f'{x["capacity_tokens"]} {x["hit_ratio"]}' for x in single])
write("fig9_tiered.dat", [f'{x["capacity_tokens"]} {x["hit_ratio"]} {x["gpu_hit_ratio"]}' for x in tiered])
for x in r:
    if x.get("host_capacity_tokens", 0) > 0:
        write("fig9_host.txt", [f'{x["host_capacity_tokens"]:.0e}'.replace("+0", "")])
        break
# Mooncake FAST'25 Fig. 9, as read off the published plot (docs/replay.md)
write("fig9_mooncake.dat", ["1e6 0.148", "3e6 0.315", "1e7 0.586", "5e7 0.658"])
for x in rows(policies):
    label = x["eviction"] + ("" if x.get("retention", "-") == "-" else "-" + x["retention"].replace(":", "-").replace(",", "-"))
    tier = "tiered" if x.get("host_capacity_tokens", 0) > 0 else "single"
    name = f'pol_{x["trace"]}_{label}_{tier}.dat'
    with open(os.path.join(tmp, name), "a") as f:
        f.write(f'{x["capacity_tokens"]} {x["hit_ratio"]} {x.get("gpu_hit_ratio", x["hit_ratio"])}\n')
for x in rows(recurrent):
    with open(os.path.join(tmp, f'rec_{x["trace"]}_{x["manager"]}.dat'), "a") as f:
        f.write(f'{x["capacity_tokens"]} {x["hit_ratio"]} {x["peak_checkpoint_share"]}\n')
EOF

mkdir -p "$out"
host_label=$(cat "$tmp/fig9_host.txt" 2>/dev/null || echo "host")

gnuplot <<EOF
set terminal pngcairo size 900,600 font "sans,11"
set output "$out/replay-fig9.png"
set title "Mooncake synthetic trace, prefix caching, block size 16 (pagedkv-replay, LRU)"
set logscale x
set xrange [7e5:7e7]
set yrange [0:0.75]
set xlabel "GPU pool capacity (tokens)"
set ylabel "prefix-cache hit ratio (cached / prompt tokens)"
set key right bottom
set grid
set format x "%.0e"
plot "$tmp/fig9_mooncake.dat" using 1:2 with points pt 7 ps 2 lc rgb "#d62728" title "Mooncake FAST'25 Fig. 9 (published)", \
     "$tmp/fig9_single.dat" using 1:2 with linespoints pt 5 lw 2 lc rgb "#1f77b4" title "pagedkv, GPU only", \
     "$tmp/fig9_tiered.dat" using 1:2 with linespoints pt 9 lw 2 lc rgb "#2ca02c" title "pagedkv, GPU + ${host_label}-token host tier (total)", \
     "$tmp/fig9_tiered.dat" using 1:3 with linespoints pt 8 dt 2 lw 1 lc rgb "#2ca02c" title "  of which served by the GPU tier"
EOF

gnuplot <<EOF
set terminal pngcairo size 1200,520 font "sans,10"
set output "$out/replay-policies.png"
set multiplot layout 1,2 title "Hit ratio per eviction policy: GPU only (solid) and GPU + 1e7-token host tier, write-back (dashed)"
set logscale x
set xrange [7e5:1.4e7]
set xlabel "GPU pool capacity (tokens)"
set ylabel "hit ratio"
set grid
set format x "%.0e"
set key right bottom
do for [t in "synthetic_trace conversation_trace"] {
  set title t noenhanced
  set yrange [0:(t eq "synthetic_trace" ? 0.72 : 0.42)]
  plot "$tmp/pol_".t."_lru_single.dat" using 1:2 with linespoints lw 2 pt 5 lc rgb "#1f77b4" title "lru", \
       "$tmp/pol_".t."_slru_single.dat" using 1:2 with linespoints lw 2 pt 7 lc rgb "#ff7f0e" title "slru", \
       "$tmp/pol_".t."_priority-head-2048-80_single.dat" using 1:2 with linespoints lw 2 pt 9 lc rgb "#9467bd" title "priority, first 2048 tokens at 80", \
       "$tmp/pol_".t."_lru_tiered.dat" using 1:2 with linespoints dt 2 lw 2 pt 5 lc rgb "#1f77b4" notitle, \
       "$tmp/pol_".t."_slru_tiered.dat" using 1:2 with linespoints dt 2 lw 2 pt 7 lc rgb "#ff7f0e" notitle, \
       "$tmp/pol_".t."_priority-head-2048-80_tiered.dat" using 1:2 with linespoints dt 2 lw 2 pt 9 lc rgb "#9467bd" notitle
}
unset multiplot
EOF

gnuplot <<EOF
set terminal pngcairo size 1200,520 font "sans,10"
set output "$out/replay-recurrent.png"
set multiplot layout 1,2 title "full:12,mamba:36 (1 MiB state per recurrent layer, 2 KiB K+V per token per attention layer), pools of equal bytes"
set logscale x
set xrange [7e5:4e7]
set xlabel "pool size (tokens of the all-attention model's KV)"
set ylabel "hit ratio"
set grid
set format x "%.0e"
set key left top
do for [t in "conversation_trace synthetic_trace"] {
  set title t noenhanced
  set yrange [0:(t eq "synthetic_trace" ? 0.8 : 0.45)]
  plot "$tmp/rec_".t."_all-attention.dat" using 1:2 with linespoints lw 2 pt 5 lc rgb "#7f7f7f" title "all attention (block 16)", \
       "$tmp/rec_".t."_vllm-align.dat" using 1:2 with linespoints lw 2 pt 7 lc rgb "#d62728" title "vLLM align: one checkpoint per request", \
       "$tmp/rec_".t."_every-1024+last.dat" using 1:2 with linespoints lw 2 pt 9 lc rgb "#1f77b4" title "every 1024 + last", \
       "$tmp/rec_".t."_every-2048+last.dat" using 1:2 with linespoints lw 2 pt 11 lc rgb "#2ca02c" title "every 2048 + last", \
       "$tmp/rec_".t."_every-2048.dat" using 1:2 with linespoints dt 2 lw 1 pt 11 lc rgb "#2ca02c" title "every 2048 only"
}
unset multiplot
EOF

echo "plot-replay: wrote $out/replay-fig9.png, $out/replay-policies.png and $out/replay-recurrent.png"
