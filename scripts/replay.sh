#!/usr/bin/env bash
# The main job: build pagedkv-replay (Release) and replay the bundled Mooncake synthetic trace in prefix mode at
# the four capacities of Mooncake's Fig. 9. Extra arguments go to pagedkv-replay (e.g. --json, --hash xxh3).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDKV_ENABLE_CUDA=OFF \
      -DPAGEDKV_BUILD_TESTS=OFF -DPAGEDKV_BUILD_BENCHMARKS=OFF -DPAGEDKV_BUILD_EXAMPLES=ON >/dev/null
cmake --build build-release --target pagedkv-replay
./build-release/examples/pagedkv-replay data/traces/mooncake-fast25/synthetic_trace.jsonl \
  --mode prefix --block-size 16 --capacity-tokens 1e6,3e6,1e7,5e7 "$@"
