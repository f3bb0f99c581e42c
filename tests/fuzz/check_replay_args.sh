#!/usr/bin/env bash
# pagedkv-replay refuses bad arguments, flags that do not apply to the run, bad trace files and oversized inputs with
# a clear message and its documented exit status (--help, "Exit status"), before allocating anything; and still
# accepts the flag combinations the docs use.
# Usage: tests/fuzz/check_replay_args.sh <path to pagedkv-replay>   (run from the repository root)
set -euo pipefail
replay=$1
trace=data/traces/mooncake-fast25/synthetic_trace.jsonl
azure=data/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0
# Exit statuses (pagedkv-replay --help).
usage=2 bad_trace=3 too_large=4

# expect_refusal <exit status> <expected message fragment> <arguments...>: that exit status, the message on
# stderr/stdout, within 20 s.
expect_refusal() {
  local want_rc=$1 want=$2
  shift 2
  local out rc=0
  out=$(timeout 20 "$replay" "$@" 2>&1) || rc=$?
  if [ "$rc" -ne "$want_rc" ] || ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: pagedkv-replay $* (exit $rc, expected $want_rc): expected \"$want\", got:"
    sed 's/^/    /' <<<"$out" | head -20
    failed=1
  else
    echo "ok ($rc): pagedkv-replay $* -> $(grep -F -- "$want" <<<"$out" | head -1)"
  fi
}

# expect_ok <arguments...>: exit status 0 (a documented combination, on the first requests of a trace).
expect_ok() {
  local out rc=0
  out=$(timeout 60 "$replay" "$@" --no-progress 2>&1) || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAIL: pagedkv-replay $* (exit $rc, expected 0):"
    sed 's/^/    /' <<<"$out" | head -20
    failed=1
  else
    echo "ok (0): pagedkv-replay $*"
  fi
}

# ---- values
expect_refusal $usage "--limit: -1 is not a whole number >= 0" "$trace" --limit -1
expect_refusal $usage "--limit: 1e3 is not a whole number >= 0" "$trace" --limit 1e3
expect_refusal $usage "--step-ms: nan must be a finite number > 0" "$trace" --mode serve --step-ms nan
expect_refusal $usage "--step-ms: inf must be a finite number > 0" "$trace" --mode serve --step-ms inf
expect_refusal $usage "beyond 2^53 steps" "$trace" --mode serve --step-ms 1e-300 --limit 50
expect_refusal $usage "--capacity-tokens: nan must be a finite number > 0" "$trace" --capacity-tokens nan
expect_refusal $usage "--capacity-tokens: -5 must be a finite number > 0" "$trace" --capacity-tokens=-5
expect_refusal $usage "needs more than 2^32 - 1 blocks" "$trace" --capacity-tokens 1e30
expect_refusal $usage "--capacity-tokens 8 holds no block of 16 tokens" "$trace" --capacity-tokens 8
expect_refusal $usage "--capacity-tokens: 1e+09 gives 62500000 blocks per group x 36 groups" "$trace" \
  --model-layers full:1,swa4096:35 --capacity-tokens 1e9
expect_refusal $usage "--max-model-len: -1 is not a whole number >= 0" "$trace" --mode serve --max-model-len -1
expect_refusal $usage "--max-model-len: Value 4294967296 not in range" "$trace" --mode serve --max-model-len 4294967296
# CLI11's own errors (its codes 109, 114, 104, 105) all exit with status 2.
expect_refusal $usage "The following argument was not expected: --bogus" "$trace" --bogus
expect_refusal $usage "--block-size" "$trace" --block-size
expect_refusal $usage "--block-size" "$trace" --block-size abc
expect_refusal $usage "--mode: sideways not in {prefix,serve,fork}" "$trace" --mode sideways

# ---- sizes against this machine's memory: exit status 4
# 3.75e9 blocks: ~450 GiB of pool metadata, refused on any machine this runs on, before the pool is allocated.
expect_refusal $too_large "(3750000000 blocks of 16 tokens) needs about" "$trace" --capacity-tokens 6e10
# A CSV request of 2^32 - 1 prompt tokens (it died with std::bad_alloc): refused by the memory check with its size,
# or, in serve mode, because the default max model length would exceed the int32 seq_lens.
printf 'TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,4294967295,5\n' > "$tmp/big.csv"
expect_refusal $too_large "(4294967300 prompt + output tokens) needs about 128" "$tmp/big.csv" --mode prefix
expect_refusal $too_large "(4294967300 prompt + output tokens, 4 branches) needs about 512" "$tmp/big.csv" --mode fork
expect_refusal $usage "exceeds 2^31 - 1 tokens" "$tmp/big.csv" --mode serve

# ---- bad trace files: exit status 3, naming the file (and the line)
printf '{"timestamp": 1e400, "input_length": 6, "output_length": 3, "hash_ids": [5]}\n' > "$tmp/overflow.jsonl"
expect_refusal $bad_trace "overflow.jsonl:1: invalid JSON" "$tmp/overflow.jsonl"
expect_refusal $bad_trace "data/traces: is a directory, not a trace file" data/traces
expect_refusal $bad_trace "$tmp/missing.jsonl: cannot open the trace file: No such file or directory" \
  "$tmp/missing.jsonl"
# No line break at all: refused after reading the 4 MiB line cap, fast and in bounded memory (it used to read for
# 16 s and grow to 2 GB): under a 1 GB address-space limit and within 10 s.
out=$( (ulimit -v 1000000; timeout 10 "$replay" /dev/zero --capacity-tokens 1e5 2>&1) ) && rc=0 || rc=$?
if [ "$rc" -ne $bad_trace ] || ! grep -qF "/dev/zero:1: line longer than 4194304 bytes (4 MiB, the cap" <<<"$out"; then
  echo "FAIL: pagedkv-replay /dev/zero under ulimit -v 1000000 (exit $rc, expected $bad_trace):"
  sed 's/^/    /' <<<"$out" | head -5
  failed=1
else
  echo "ok ($rc): pagedkv-replay /dev/zero (1 GB address space, 10 s) -> $out"
fi
# An over-long line after a good one: its line number.
{ head -1 "$trace"; head -c 5000000 /dev/zero | tr '\0' ' '; echo; } > "$tmp/long.jsonl"
expect_refusal $bad_trace "long.jsonl:2: line longer than 4194304 bytes" "$tmp/long.jsonl"
# hash_ids beyond the prompt: refused (a trace hashed at another block size would replay the wrong sharing).
printf '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [5, 6, 7]}\n' > "$tmp/extra.jsonl"
expect_refusal $bad_trace "extra.jsonl:1: hash_ids has 3 entries, 1 more than input_length 600 covers" \
  "$tmp/extra.jsonl"

# ---- host tier, speculation, retention and hybrid-model flags: conflicts
expect_refusal $usage "--spec-accept: 1.5 must be a probability in [0, 1]" "$trace" --mode serve --spec-accept 1.5
expect_refusal $usage "--host-capacity-tokens: nan must be a finite number >= 0" "$trace" --host-capacity-tokens nan
expect_refusal $usage "--host-capacity-tokens 1 holds no block of 16 tokens" "$trace" --host-capacity-tokens 1
expect_refusal $usage "--preempt: swap needs a host tier" "$trace" --mode serve --preempt swap
expect_refusal $usage "--preempt: swap applies to serve mode only" "$trace" --preempt swap --host-capacity-tokens 1e6
expect_refusal $usage "--head-priority: \"20:101\" is not TOKENS:PRIORITY" "$trace" --eviction priority \
  --head-priority 20:101
expect_refusal $usage "--decode-priority: retention priorities need --eviction priority" "$trace" --decode-priority 10
expect_refusal $usage "--host-eviction: slru differs from --eviction lru" "$trace" --host-capacity-tokens 1e6 \
  --host-eviction slru --hash xxh3
expect_refusal $usage "--mode: fork replays an LRU pool without a host tier" "$trace" --mode fork --eviction slru
expect_refusal $usage "--capacity-tokens: serve and fork modes take a single capacity" "$trace" --mode serve \
  --capacity-tokens 1e6,2e6
expect_refusal $usage "--model-layers: --model-layers \"full:12,bogus\": item \"bogus\" has no ':'" "$trace" \
  --model-layers full:12,bogus
expect_refusal $usage "--model-layers: takes --mode serve or prefix" "$trace" --mode fork --model-layers full:12
expect_refusal $usage "--host-eviction: the hybrid prefix replay's host tier takes --eviction's policy" "$trace" \
  --model-layers full:12,swa4096:24 --host-capacity-tokens 1e6 --host-eviction slru
expect_refusal $usage "--host-capacity-tokens: with mamba layers the replay compares checkpoint policies" "$trace" \
  --model-layers full:12,mamba:36 --host-capacity-tokens 1e6
expect_refusal $usage "--model-layers: a group with coarse pages does not yet work with the host tier" "$trace" \
  --model-layers full:12,full@64:12 --host-capacity-tokens 1e6
expect_refusal $usage "--model-layers: with mamba layers compares pools side by side on LRU" "$trace" \
  --model-layers full:12,mamba:36 --eviction slru
expect_refusal $usage "--model-layers: with coarse pages (full@P) replays --mode prefix" "$trace" --mode serve \
  --model-layers full:12,full@64:12

# ---- flags that do not apply to the run: refused, naming the flag and why (they used to be ignored)
expect_refusal $usage "--step-ms: applies only to --mode serve, but this is --mode prefix" "$trace" --step-ms 10
expect_refusal $usage "--max-num-seqs: applies only to --mode serve, but this is --mode fork" "$trace" --mode fork \
  --max-num-seqs 8
expect_refusal $usage "--max-num-batched-tokens: applies only to --mode serve, but this is --mode prefix" "$trace" \
  --max-num-batched-tokens 0
expect_refusal $usage "--max-model-len: applies only to --mode serve, but this is --mode prefix" \
  "$trace" --model-layers full:12,swa4096:24 --max-model-len 4096
expect_refusal $usage "--spec-tokens: applies only to --mode serve, but this is --mode prefix" \
  "$trace" --spec-tokens 3
expect_refusal $usage "--reserve: applies only to --mode serve, but this is --mode prefix" "$trace" --reserve chunk
expect_refusal $usage "--spec-accept: applies only to --mode serve with --spec-tokens > 0, but --spec-tokens is 0" \
  "$trace" --mode serve --spec-accept 0.7
expect_refusal $usage "--spec-accept: applies only to --mode serve with --spec-tokens > 0, but this is --mode fork" \
  "$trace" --mode fork --spec-accept 0.7
expect_refusal $usage "--preempt: applies only to --mode serve, but this is --mode prefix" \
  "$trace" --preempt recompute
expect_refusal $usage \
  "--decode-priority: applies only to --mode serve (blocks of generated tokens), but this is --mode prefix, whose" \
  "$trace" --eviction priority --decode-priority 10
expect_refusal $usage "--n: applies only to --mode fork, but this is --mode prefix" "$trace" --n 4
expect_refusal $usage "--offload: applies only to runs with a host tier (--host-capacity-tokens > 0), but there is no" \
  "$trace" --offload none
expect_refusal $usage "--offload: applies only to runs with a host tier" "$trace" --mode serve \
  --host-capacity-tokens 0 --offload write-through
expect_refusal $usage "--host-eviction: applies only to runs with a host tier" "$trace" --host-eviction slru
expect_refusal $usage "--kv-bytes-per-token: applies only to runs with a host tier" "$trace" --kv-bytes-per-token 65536
expect_refusal $usage "--publish-wait-ms: applies only to runs with --publish-events, but" "$trace" \
  --publish-wait-ms 100
expect_refusal $usage "--model-name: applies only to runs with --publish-events, but" "$trace" --model-name m
expect_refusal $usage "--pod-id: applies only to runs with --publish-events, but" "$trace" --pod-id p
expect_refusal $usage "--topic: applies only to runs with --publish-events, but" "$trace" --topic kv-events
expect_refusal $usage "--publish-connect: applies only to runs with --publish-events, but" "$trace" --publish-connect
expect_refusal $usage "contains '@'" "$trace" --publish-events tcp://127.0.0.1:0 --model-name a@b
expect_ok "$trace" --limit 20 --publish-events 'tcp://127.0.0.1:*' --publish-wait-ms 0 --model-name acme/m \
  --pod-id replay-0
expect_ok "$trace" --limit 20 --publish-events tcp://127.0.0.1:9 --publish-connect --publish-wait-ms 0 --topic kv@a@b
expect_refusal $usage "--check: applies only to runs without --model-layers, but the hybrid replay" "$trace" \
  --model-layers full:12,swa4096:24 --check
expect_refusal $usage "--progress: applies only to runs without --model-layers, but the hybrid replay" "$trace" \
  --model-layers full:12,swa4096:24 --progress

# ---- --help documents the exit statuses and which flags apply where
help=$("$replay" --help) || { echo "FAIL: --help exits non-zero"; failed=1; }
for want in "Exit status:" "2  bad command line" "3  bad trace file" "4  the replay would need more host memory" \
  "Flags that apply to some runs only" "--kv-bytes-per-token     runs with a host tier (the bytes copied"; do
  grep -qF -- "$want" <<<"$help" || { echo "FAIL: --help lacks \"$want\""; failed=1; }
done

# ---- the combinations the docs and scripts use are still accepted (first requests only)
expect_ok "$trace" --mode prefix --capacity-tokens 1e5,2e5 --limit 50 --hash xxh3 --json
expect_ok "$trace" --mode prefix --capacity-tokens 1e5 --host-capacity-tokens 5e5 --offload write-back --limit 50
expect_ok "$trace" --mode prefix --capacity-tokens 1e5 --host-capacity-tokens 5e5 --eviction priority \
  --head-priority 2048:80 --kv-bytes-per-token 65536 --limit 50
expect_ok "$trace" --mode prefix --capacity-tokens 1e5 --eviction slru --host-capacity-tokens 5e5 \
  --host-eviction lru --limit 50
expect_ok "$azure" --mode serve --capacity-tokens 5e4 --max-num-batched-tokens 0 --spec-tokens 3 --spec-accept 0.7 \
  --step-ms 25 --max-num-seqs 64 --max-model-len 20000 --limit 100
expect_ok "$azure" --mode serve --capacity-tokens 2e4 --host-capacity-tokens 1e6 --offload none --preempt swap \
  --limit 100
expect_ok "$azure" --mode serve --eviction priority --decode-priority 10 --preempt recompute --limit 100 --check
expect_ok "$azure" --mode fork --n 4 --limit 50 --eviction lru --check
expect_ok "$azure" --mode serve --model-layers full:12,swa4096:24 --step-ms 25 --max-num-seqs 64 \
  --max-num-batched-tokens 8192 --limit 100
expect_ok "$azure" --mode serve --model-layers full:12,swa4096:24 --host-capacity-tokens 1e6 --preempt swap \
  --spec-tokens 3 --limit 100
expect_ok "$azure" --mode serve --model-layers full:6,swa1024:30 --capacity-tokens 2e4 --eviction priority \
  --decode-priority 10 --host-capacity-tokens 1e5 --offload write-through --preempt swap --reserve prompt \
  --max-model-len 16384 --limit 100
expect_ok "$trace" --mode prefix --model-layers full:12,swa4096:24 --capacity-tokens 1e5 --eviction slru \
  --host-capacity-tokens 5e5 --offload write-through --limit 50

if [ "$failed" -ne 0 ]; then
  echo "check_replay_args: FAILED"
  exit 1
fi
echo "check_replay_args: all refusals and exit statuses as expected, documented combinations accepted"
