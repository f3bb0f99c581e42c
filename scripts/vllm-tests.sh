#!/usr/bin/env bash
# vLLM's own scheduler, prefix-cache and KV-connector scheduler unit tests (vLLM 0.32.0, files unmodified,
# third_party/vllm-0.32.0-tests)
# with vLLM's KVCacheManager replaced by pagedkv.vllm.KVCacheManager (python/vllm_compat/pagedkv_vllm_plugin.py),
# classified test by test against a baseline run with vLLM's own manager (python/vllm_compat/summarize.py; the table
# is in docs/python.md). Fails when a test of python/vllm_compat/expected-results.tsv marked `pass` does not pass,
# or when the adapter's own tests (python/vllm_compat/test_adapter*.py: signatures equal vLLM's, the Mamba mapping,
# groups of different block sizes) fail.
#   scripts/vllm-tests.sh [BUILD_DIR]      BUILD_DIR holds the built _pagedkv (default build-python)
# Needs the venv scripts/install-deps.sh makes ($PAGEDKV_VLLM_VENV, default ~/.cache/pagedkv/vllm-0.32.0-venv).
# PAGEDKV_VLLM_UPDATE=1 rewrites the expected results instead of comparing.
set -euo pipefail
tool=vllm-tests
source "$(dirname "$0")/vllm-env.sh"

# vLLM's scheduler tests build a ModelConfig of facebook/opt-125m: its config.json (architecture facts only, no
# weights) is laid out as an offline Hugging Face cache; nothing is downloaded.
snap="$out/hf/hub/models--facebook--opt-125m/snapshots/0000000000000000000000000000000000000000"
mkdir -p "$snap" "$out/hf/hub/models--facebook--opt-125m/refs"
cp python/vllm_compat/hf/opt-125m/config.json "$snap/"
printf 0000000000000000000000000000000000000000 > "$out/hf/hub/models--facebook--opt-125m/refs/main"
export VLLM_LOGGING_LEVEL=ERROR

tests=(tests/v1/core/test_scheduler.py tests/v1/core/test_prefix_caching.py
       tests/v1/core/test_single_type_kv_cache_manager.py tests/v1/core/test_kv_sharing.py
       tests/v1/core/test_swa_inflight_window_free.py
       tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py
       tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py
       # KV-connector scheduler tests (vLLM's scheduler with a connector's scheduler side, on CPU; ~8 s a run)
       tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py
       tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py
       tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py
       tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py
       tests/v1/kv_connector/unit/test_cache_pollution_prevention.py
       tests/v1/kv_connector/unit/test_error_propagation.py
       tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py)

# The adapter's own tests (signatures, internals refused by name, a spec-decode round trip, the Mamba mapping).
rc=0
"$py" -m pytest -q -p no:cacheprovider "$root"/python/vllm_compat/test_adapter*.py >"$out/adapter.log" 2>&1 || rc=$?
echo "vllm-tests: adapter tests: $(tail -n 1 "$out/adapter.log") (exit status $rc)"
[ "$rc" -eq 0 ] || { tail -n 40 "$out/adapter.log"; exit 1; }

run() {  # run NAME SWAP: one pytest run over the vendored tests; its exit status is the failures', not checked
  # pytest's own summary stays in $out/NAME.log: the n/a tests fail there by design, summarize.py judges them.
  local name=$1 swap=$2 t0 prc=0; t0=$(date +%s)
  (cd third_party/vllm-0.32.0-tests &&
   PAGEDKV_VLLM_SWAP=$swap PAGEDKV_VLLM_RESULTS="$out/$name.jsonl" \
     "$py" -m pytest -q -p pagedkv_vllm_plugin -p no:cacheprovider --tb=line -W ignore "${tests[@]}" \
     >"$out/$name.log" 2>&1) || prc=$?
  echo "vllm-tests: $name run recorded $(wc -l < "$out/$name.jsonl" 2>/dev/null || echo 0) tests" \
       "(pytest exit status $prc, log $out/$name.log) in $(( $(date +%s) - t0 )) s"
  [ -s "$out/$name.jsonl" ] || { tail -n 40 "$out/$name.log"; echo "vllm-tests: $name recorded nothing" >&2; exit 1; }
}
run baseline 0
run pagedkv 1

expected=python/vllm_compat/expected-results.tsv
if [ "${PAGEDKV_VLLM_UPDATE:-0}" = 1 ]; then
  "$py" python/vllm_compat/summarize.py "$out/baseline.jsonl" "$out/pagedkv.jsonl" --tsv "$expected" \
    --markdown "$out/table.md"
else
  "$py" python/vllm_compat/summarize.py "$out/baseline.jsonl" "$out/pagedkv.jsonl" --tsv "$out/results.tsv" \
    --markdown "$out/table.md" --expected "$expected"
fi
