"""Replay parity: a Python replay of the first 2000 requests of the bundled Mooncake synthetic trace in prefix mode
at 1e6 tokens gives exactly the C++ replay's (examples/replay, --mode prefix) counters and hit ratio.

Prompts are synthesized as examples/replay/trace.cpp does: token j of Mooncake block `hash_id` (512 tokens) is
splitmix64(hash_id * 512 + j) & 0x7fffffff, the prompt being its blocks' tokens truncated to input_length. Per
request (prefix_mode.cpp): try_admit, build the prefill step's metadata (which registers the full blocks), free.
The C++ numbers come from build*/examples/pagedkv-replay (or $PAGEDKV_REPLAY) when present, else from the constants
below, recorded from `pagedkv-replay data/traces/mooncake-fast25/synthetic_trace.jsonl --mode prefix
--capacity-tokens 1e6 --limit 2000 --json` at commit 0bc4776 (sha256 and xxh3 give the same counters).
"""
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

import pagedkv

REPO = pathlib.Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"
LIMIT = 2000
CAPACITY = 1e6
BLOCK_SIZE = 16
MOONCAKE_BLOCK = 512
RECORDED = {"prompt_tokens": 24732716, "cached_tokens": 989552, "hit_ratio": 0.04000983959869187,
            "evictions": 1420507, "block_ops": 3093446, "rejected": 0}

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(z):
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def load_requests(limit):
    out = []
    with open(TRACE) as f:
        for line in f:
            if len(out) == limit:
                break
            r = json.loads(line)
            out.append((r["input_length"], np.array(r["hash_ids"], dtype=np.uint64)))
    return out


def synthesize(input_length, hash_ids):
    pos = np.arange(input_length, dtype=np.uint64)
    ids = hash_ids[pos // np.uint64(MOONCAKE_BLOCK)]
    with np.errstate(over="ignore"):
        z = ids * np.uint64(MOONCAKE_BLOCK) + pos % np.uint64(MOONCAKE_BLOCK)
    return (splitmix64(z) & np.uint64(0x7FFFFFFF)).astype(np.int32)


def python_replay(hasher):
    reqs = load_requests(LIMIT)
    max_prompt = max(n for n, _ in reqs)
    usable = int(CAPACITY // BLOCK_SIZE)
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=usable + 1, block_size=BLOCK_SIZE,
                                                   max_tokens_per_seq=max_prompt), hasher=hasher)
    slots = np.empty(max_prompt, np.int64)
    copies = np.empty((1, 2), np.int32)
    rejected = 0
    for i, (n, hash_ids) in enumerate(reqs):
        r = m.try_admit(i, synthesize(n, hash_ids))
        if not r.admitted:
            rejected += 1
            continue
        m.build_batch_metadata([i], slot_mapping=slots, copies=copies)
        m.free(i)
    s = m.stats()
    return {"prompt_tokens": s.prefix_query_tokens, "cached_tokens": s.prefix_hit_tokens,
            "hit_ratio": s.prefix_hit_tokens / s.prefix_query_tokens, "evictions": s.evictions,
            "block_ops": s.block_ops, "rejected": rejected}


def cpp_replay(hasher):
    candidates = [os.environ.get("PAGEDKV_REPLAY", "")] + \
        [str(p / "examples" / "pagedkv-replay") for p in sorted(REPO.glob("build*"))]
    for exe in candidates:
        if exe and os.access(exe, os.X_OK):
            out = subprocess.run([exe, str(TRACE), "--mode", "prefix", "--capacity-tokens", "1e6", "--limit",
                                  str(LIMIT), "--hash", hasher, "--json", "--no-progress"],
                                 check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[0])
            return {k: row[k] for k in RECORDED}, exe
    return dict(RECORDED), "recorded constants (commit 0bc4776)"


def test_synthesis_matches_the_cpp_formula():
    # splitmix64(0) and token 0 of block 0, computed independently in Python integers.
    def ref(z):
        z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)
    ids = np.array([3, 7], np.uint64)
    got = synthesize(600, ids)
    assert got[5] == ref(3 * 512 + 5) & 0x7FFFFFFF and got[513] == ref(7 * 512 + 1) & 0x7FFFFFFF


@pytest.mark.skipif(not TRACE.is_file(), reason="bundled trace missing")
@pytest.mark.parametrize("hasher", ["sha256", "xxh3"])
def test_prefix_replay_parity_with_cpp(hasher):
    expected, source = cpp_replay(hasher)
    got = python_replay(hasher)
    assert got == expected, f"C++ numbers from {source}"
    assert got["hit_ratio"] == pytest.approx(0.0400098, abs=1e-6)
