#!/usr/bin/env bash
# pagedkv-replay refuses bad arguments and oversized inputs with a clear message, before allocating anything.
# Usage: tests/fuzz/check_replay_args.sh <path to pagedkv-replay>   (run from the repository root)
set -euo pipefail
replay=$1
trace=data/traces/mooncake-fast25/synthetic_trace.jsonl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0

# expect_refusal <expected message fragment> <arguments...>: exit status non-zero, message on stderr/stdout, fast.
expect_refusal() {
  local want=$1
  shift
  local out rc=0
  out=$(timeout 20 "$replay" "$@" 2>&1) || rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: pagedkv-replay $* (exit $rc): expected \"$want\", got:"
    sed 's/^/    /' <<<"$out"
    failed=1
  else
    echo "ok: pagedkv-replay $* -> $(grep -F -- "$want" <<<"$out" | head -1)"
  fi
}

expect_refusal "--limit: -1 is not a whole number >= 0" "$trace" --limit -1
expect_refusal "--limit: 1e3 is not a whole number >= 0" "$trace" --limit 1e3
expect_refusal "--step-ms: nan must be a finite number > 0" "$trace" --mode serve --step-ms nan
expect_refusal "--step-ms: inf must be a finite number > 0" "$trace" --mode serve --step-ms inf
expect_refusal "beyond 2^53 steps" "$trace" --mode serve --step-ms 1e-300 --limit 50
expect_refusal "--capacity-tokens: nan must be a finite number > 0" "$trace" --capacity-tokens nan
expect_refusal "--capacity-tokens: -5 must be a finite number > 0" "$trace" --capacity-tokens=-5
expect_refusal "needs more than 2^32 - 1 blocks" "$trace" --capacity-tokens 1e30
# 3.75e9 blocks: ~450 GiB of pool metadata, refused on any machine this runs on, before the pool is allocated.
expect_refusal "(3750000000 blocks of 16 tokens) needs about" "$trace" --capacity-tokens 6e10
expect_refusal "--max-model-len: -1 is not a whole number >= 0" "$trace" --mode serve --max-model-len -1
expect_refusal "--max-model-len: Value 4294967296 not in range" "$trace" --mode serve --max-model-len 4294967296

# A CSV request of 2^32 - 1 prompt tokens (it died with std::bad_alloc): refused by the memory check with its size,
# or, in serve mode, because the default max model length would exceed the int32 seq_lens.
printf 'TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,4294967295,5\n' > "$tmp/big.csv"
expect_refusal "(4294967300 prompt + output tokens) needs about 128" "$tmp/big.csv" --mode prefix
expect_refusal "(4294967300 prompt + output tokens, 4 branches) needs about 512" "$tmp/big.csv" --mode fork
expect_refusal "exceeds 2^31 - 1 tokens" "$tmp/big.csv" --mode serve
# A malformed trace: file:line and the value.
printf '{"timestamp": 1e400, "input_length": 6, "output_length": 3, "hash_ids": [5]}\n' > "$tmp/overflow.jsonl"
expect_refusal "overflow.jsonl:1: invalid JSON" "$tmp/overflow.jsonl"

# Host tier, speculation, retention and hybrid-model flags.
expect_refusal "--spec-accept: 1.5 must be a probability in [0, 1]" "$trace" --mode serve --spec-accept 1.5
expect_refusal "--host-capacity-tokens: nan must be a finite number >= 0" "$trace" --host-capacity-tokens nan
expect_refusal "--preempt: swap needs a host tier" "$trace" --mode serve --preempt swap
expect_refusal "--head-priority: \"20:101\" is not TOKENS:PRIORITY" "$trace" --eviction priority --head-priority 20:101
expect_refusal "--decode-priority: retention priorities need --eviction priority" "$trace" --decode-priority 10
expect_refusal "--model-layers: --model-layers \"full:12,bogus\": item \"bogus\" has no ':'" "$trace" \
  --model-layers full:12,bogus
expect_refusal "--model-layers: takes --mode serve or prefix" "$trace" --mode fork --model-layers full:12
expect_refusal "--model-layers: replays an LRU pool without a host tier" "$trace" --model-layers full:12,swa4096:24 \
  --host-capacity-tokens 1e6

if [ "$failed" -ne 0 ]; then
  echo "check_replay_args: FAILED"
  exit 1
fi
echo "check_replay_args: all refusals as expected"
