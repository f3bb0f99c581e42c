#!/usr/bin/env bash
# Dynamo's own standalone KV indexer (PyPI ai-dynamo: `python -m dynamo.indexer`, docs/events-wire.md) against a
# pagedkv-replay run publishing its KV events on loopback. Prints what the indexer reports: its /dump (blocks per
# worker) and its /query overlap for every request of the slice (prompt, and prompt + generated tokens), next to
# pagedkv's own replay check (tests/events_zmq/replay_events_check.cpp) on the same run, which prints the engine's
# final cached set and the same queries' cached-block total.
# Usage: scripts/dynamo-indexer-check.sh PYTHON_WITH_AI_DYNAMO BUILD_DIR TRACE LIMIT [REPLAY FLAGS...]
# e.g. python3 -m venv .venv-dynamo && .venv-dynamo/bin/pip install ai-dynamo-runtime==1.6.1 \
#      && .venv-dynamo/bin/pip install --no-deps ai-dynamo==1.6.1   (ai-dynamo's own dependency aisimulate is a
#      stub that downloads from pypi.nvidia.com; the indexer does not need it)
#      scripts/dynamo-indexer-check.sh .venv-dynamo/bin/python build \
#        data/traces/mooncake-fast25/conversation_trace.jsonl 120 --mode serve --capacity-tokens 2e5
# Not part of scripts/test.sh: it needs the 75 MB ai-dynamo-runtime wheel. Bounded: every wait has a timeout.
set -euo pipefail
py=$1 build=$2 trace=$3 limit=$4
shift 4
model=acme/replay-7b
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
read -r http_port zmq_port < <(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])')

"$py" -m dynamo.indexer --port "$http_port" --threads 1 >"$tmp/indexer.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$http_port/workers" >/dev/null 2>&1 && break; sleep 0.1; done
"$build/examples/pagedkv-replay" "$trace" --limit "$limit" --no-progress --publish-events "tcp://127.0.0.1:$zmq_port" \
    --publish-wait-ms 3000 "$@" >"$tmp/replay.out" 2>"$tmp/replay.err" &
replay_pid=$!
pids+=($replay_pid)
sleep 0.5
curl -sf -X POST "http://127.0.0.1:$http_port/register" -H 'Content-Type: application/json' \
  -d "{\"instance_id\": 1, \"endpoint\": \"tcp://127.0.0.1:$zmq_port\", \"model_name\": \"$model\", \"block_size\": 16}"
echo
timeout 300 tail --pid="$replay_pid" -f /dev/null
wait "$replay_pid" || { echo "pagedkv-replay failed"; cat "$tmp/replay.err"; exit 1; }
sleep 2  # let the indexer apply the last batches
cat "$tmp/replay.err"

"$py" - "$http_port" "$trace" "$limit" "$model" <<'EOF'
import csv, json, sys, urllib.request
port, trace, limit, model = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
M = (1 << 64) - 1
def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)
reqs = []  # (prompt, output_tokens), as examples/replay/trace.cpp synthesizes them
with open(trace) as f:
    if trace.endswith(".jsonl"):
        for line in f:
            if len(reqs) == limit: break
            r = json.loads(line)
            reqs.append(([splitmix64(r["hash_ids"][p // 512] * 512 + p % 512) & 0x7FFFFFFF
                          for p in range(r["input_length"])], r["output_length"]))
    else:
        for i, r in enumerate(csv.DictReader(f)):
            if i == limit: break
            base = (1 << 63) | (i << 32)
            reqs.append(([splitmix64(base | p) & 0x7FFFFFFF for p in range(int(r["ContextTokens"]))],
                         int(r["GeneratedTokens"])))
def call(path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())
dump = call("/dump")
for key, body in dump.items():
    events = body["events"] if isinstance(body, dict) else body
    blocks, tiers = 0, {}
    for e in events:
        st = e["event"]["data"].get("stored") if isinstance(e["event"]["data"], dict) else None
        if st:
            blocks += len(st["blocks"])
            tiers[e.get("storage_tier")] = tiers.get(e.get("storage_tier"), 0) + len(st["blocks"])
    print(f"dynamo /dump {key}: {len(events)} stored events, {blocks} blocks, by tier {tiers}")
total = nonzero = queries = longest = 0
first = None
for i, (prompt, out) in enumerate(reqs):
    full = prompt + [splitmix64((1 << 62) | (i << 32) | s) & 0x7FFFFFFF for s in range(out)]
    for q in (prompt, full):
        res = call("/query", {"token_ids": q, "model_name": model})
        score = sum(v for w in res.get("scores", {}).values() for v in w.values())
        if first is None: first = res
        queries += 1
        nonzero += score > 0
        total += score // 16
        longest += sum(w.get("longest_matched", 0) for w in res.get("instances", {}).values()) // 16
print(f"dynamo /query: {queries} queries, {nonzero} with a device-tier prefix; cached blocks in all: {total} by "
      f"'scores' (device tier), {longest} by 'longest_matched' (any tier)")
print("first /query answer:", json.dumps(first)[:300])
EOF
echo "--- pagedkv's replay check on the same run:"
"$build/tests/events_zmq/pagedkv_replay_events_check" dynamo-compare "$build/examples/pagedkv-replay" "$trace" "$limit" \
    "$@" 2>/dev/null | grep -E "^(events|ok   queries|FAIL|==)"
echo "--- dynamo indexer log (tail):"
tail -n 15 "$tmp/indexer.log"
