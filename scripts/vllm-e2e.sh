#!/usr/bin/env bash
# vLLM 0.32.0's real engine (LLM, CPU) on pagedkv.vllm, end to end: a tiny random-weight Llama and a word-level
# tokenizer made locally (nothing downloaded), prefix caching, greedy sampling, three phases of prompts sharing
# prefixes on a 48-block pool (32-token blocks) that evicts cached blocks and preempts running requests. Runs the same requests with
# vLLM's own KVCacheManager and with scheduler_cls="pagedkv.vllm.Scheduler" (each engine in its own spawned
# process, as a user runs it) and requires every request's generated tokens and num_cached_tokens and the engine's
# prefix-cache counters to be identical; then a planted wrong block table (python/vllm_compat/e2e_planted.py) must
# be caught. Then the same two runs of a sliding-window hybrid, and of a Qwen3-Next-shaped recurrent hybrid (a
# gated-delta-net layer and a full-attention one: vLLM's Mamba group in mode 'align'), each on a pool that never
# evicts (vLLM's default prefix_cache_retention_interval 0: sparse retention of window blocks and states; KV
# events on). Last
# line: `vllm-e2e: PASS requests=N identical=N ...`.
#   scripts/vllm-e2e.sh [BUILD_DIR]      BUILD_DIR holds the built _pagedkv (default build-python)
# Needs the venv scripts/install-deps.sh makes ($PAGEDKV_VLLM_VENV, default ~/.cache/pagedkv/vllm-0.32.0-venv).
set -euo pipefail
tool=vllm-e2e
source "$(dirname "$0")/vllm-env.sh"
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
e2e=python/vllm_compat/e2e.py
t0=$(date +%s)
"$py" $e2e make "$out/model" >"$out/make.log" 2>&1 || { tail -n 30 "$out/make.log"; exit 1; }
for m in vllm pagedkv planted; do
  t=$(date +%s)
  "$py" $e2e run "$out/model" $m "$out/$m.json" >"$out/$m.log" 2>&1 || { tail -n 40 "$out/$m.log"; echo "vllm-e2e: the $m run failed" >&2; exit 1; }
  echo "vllm-e2e: $m engine run in $(( $(date +%s) - t )) s"
done
"$py" $e2e compare "$out/vllm.json" "$out/planted.json" --expect-mismatch
# hybrid NAME KIND WHAT LABEL: make the model of kind KIND (e2e.py make), run it on vLLM's own manager and on
# pagedkv with vLLM's default engine arguments and KV events on (published nowhere: the adapter builds vLLM's event
# records in the engine, as for a KV-aware router's pods) on a 2,000-block pool that never evicts, and compare (a
# mismatch sets hybrid_rc). Under memory pressure pagedkv holds fewer blocks than vLLM (an admission's build deduplicates
# the full-attention blocks a shorter hit made a request recompute), so evictions and preemptions part from
# vLLM's (docs/python.md).
hybrid_rc=0
hybrid() {
  local name=$1 kind=$2 what=$3 label=$4 m t
  "$py" $e2e make "$out/model-$name" "$kind" >"$out/make-$name.log" 2>&1 || { tail -n 30 "$out/make-$name.log"; exit 1; }
  for m in vllm pagedkv; do
    t=$(date +%s)
    PAGEDKV_E2E_EVENTS=1 "$py" $e2e run "$out/model-$name" $m "$out/$name-$m.json" 2000 >"$out/$name-$m.log" 2>&1 ||
      { tail -n 40 "$out/$name-$m.log"; echo "vllm-e2e: the $what $m run failed" >&2; exit 1; }
    echo "vllm-e2e: $what $m engine run in $(( $(date +%s) - t )) s"
  done
  "$py" $e2e compare "$out/$name-vllm.json" "$out/$name-pagedkv.json" "--label=$label" || hybrid_rc=1
  if grep -q "KV event record was widened or trimmed" "$out/$name-pagedkv.log"; then
    echo "vllm-e2e: the $what pagedkv run mended a KV event record (pagedkv.vllm's warning)"; hybrid_rc=1
  fi
}
# A sliding-window hybrid (its first layer a 64-token window, the second full attention, as gpt-oss and Gemma 2/3
# alternate them): prefix_cache_retention_interval 0, sparse retention of the window blocks and shared-prefix
# junctions (docs/vllm-swa-retention.md).
hybrid swa 64 sliding-window "sliding-window hybrid, retention 0"
# A recurrent hybrid shaped as Qwen3-Next (its first layer a gated-delta-net one, then full attention; bfloat16, as
# vLLM's CPU kernel needs): vLLM runs its state layer as a Mamba group in mode 'align' (docs/vllm-mamba-align.md),
# on pagedkv a recurrent group with its states in its table.
hybrid gdn gdn recurrent-hybrid "recurrent hybrid (Mamba align), retention 0"
echo "vllm-e2e: $(( $(date +%s) - t0 )) s in all"
"$py" $e2e compare "$out/vllm.json" "$out/pagedkv.json"
exit $hybrid_rc
