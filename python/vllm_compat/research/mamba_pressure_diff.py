"""Where pagedkv.vllm and vLLM's own KVCacheManager first part on a small pool with a Mamba group in mode 'align'.

Research tool (session 46), not run by the tests. Full attention + a Mamba 'align' group at block size 4 (with the
prefill checkpoint block of vLLM's Mamba-2 layers when CKPT is 1) on a 40-block pool (evictions, refusals,
preemptions), random prompts sharing prefixes, chunks cut as vLLM's scheduler cuts them in align mode
(test_adapter_mamba_align._chunk), decode, frees; both managers driven with the same requests (the lookup's junction
stored in request.shared_prefix_boundary, remove_skipped_blocks before every growth, a new scheduler step before
every operation). Stops at the first divergence and prints it: a lookup (hit or junction), an admission or growth
decision, or the free-block count after an operation, with the blocks pagedkv's build deduplicated in that
operation (KVCacheManager stats dedup_blocks).

Run (the venv scripts/install-deps.sh makes, a built _pagedkv):
  PYTHONPATH=build-python/python:python/vllm_compat ~/.cache/pagedkv/vllm-0.32.0-venv/bin/python \\
      python/vllm_compat/research/mamba_pressure_diff.py RETENTION SEED CKPT   # RETENTION: none or an int (tokens)
"""
import random
import sys

import torch

import pagedkv.vllm as pv
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from _pairs import make_config, make_request
from test_adapter_mamba_align import _chunk

init_none_hash(sha256)
BS = 4


def main(retention, seed: int, ckpt: bool) -> str:
    kw = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1} if ckpt else {}
    specs = [FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32),
             MambaSpec(block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align", **kw)]

    def make(cls):
        cfg = make_config(40, specs)
        cfg.prefix_cache_retention_interval = retention
        return cls(cfg, max_model_len=200, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True)

    ours, theirs = make(pv.KVCacheManager), make(VllmKVCacheManager)
    free = lambda: (ours.block_pool.get_num_free_blocks(), theirs.block_pool.get_num_free_blocks())  # noqa: E731
    rng = random.Random(seed)
    bases = [[rng.randrange(40) for _ in range(rng.randrange(10, 60))] for _ in range(4)]
    live, next_id = {}, 0
    for step in range(400):
        ours.new_step_starts()
        theirs.new_step_starts()
        op = rng.random()
        dedup = ours._pk.stats().dedup_blocks
        if op < 0.3 or not live:
            base = rng.choice(bases)
            toks = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(40) for _ in range(rng.randrange(0, 8))]
            if len(toks) < 2:
                continue
            rid = str(next_id)
            next_id += 1
            ra, rb = make_request(rid, toks, BS), make_request(rid, toks, BS)
            ca, ha, ja = ours.get_computed_blocks(ra)
            cb, hb, jb = theirs.get_computed_blocks(rb)
            ra.shared_prefix_boundary, rb.shared_prefix_boundary = ja, jb
            if (ha, ja) != (hb, jb):
                return f"step {step}: lookup (hit, junction) {ha, ja} vs vLLM's {hb, jb}, free {free()}"
            ra.num_computed_tokens = ha
            n = _chunk(rng, ra, BS, ckpt, 1)
            ra.num_computed_tokens = 0
            if n == 0:
                continue
            a = ours.allocate_slots(ra, n, ha, ca)
            b = theirs.allocate_slots(rb, n, hb, cb)
            if (a is None) != (b is None):
                return f"step {step}: admission {a is not None} vs vLLM's {b is not None}, free {free()}"
            if a is None:
                continue
            ra.num_computed_tokens = rb.num_computed_tokens = ha + n
            live[rid] = (ra, rb)
        elif op < 0.85:
            rid = rng.choice(sorted(live))
            ra, rb = live[rid]
            if ra.num_computed_tokens == ra.num_tokens:
                if ra.num_tokens >= 199:
                    continue
                t = rng.randrange(40)
                ra.append_output_token_ids([t])
                rb.append_output_token_ids([t])
            n = _chunk(rng, ra, BS, ckpt, 1)
            if n == 0:
                continue
            theirs.remove_skipped_blocks(rid, rb.num_computed_tokens)
            a, b = ours.allocate_slots(ra, n), theirs.allocate_slots(rb, n)
            if (a is None) != (b is None):
                return f"step {step}: growth {a is not None} vs vLLM's {b is not None}, free {free()}"
            if a is None:
                live.pop(rid)
                ours.free(ra)
                theirs.free(rb)
                continue
            ra.num_computed_tokens += n
            rb.num_computed_tokens += n
        else:
            ra, rb = live.pop(rng.choice(sorted(live)))
            ours.free(ra)
            theirs.free(rb)
        if free()[0] != free()[1]:
            return (f"step {step}: free blocks {free()} (pagedkv, vLLM) after "
                    f"{'an admission' if op < 0.3 else 'a growth' if op < 0.85 else 'a free'}; "
                    f"pagedkv deduplicated {ours._pk.stats().dedup_blocks - dedup} blocks in it")
    return f"no divergence in 400 steps ({next_id} requests)"


if __name__ == "__main__":
    r = sys.argv[1] if len(sys.argv) > 1 else "0"
    print(main(None if r == "none" else int(r), int(sys.argv[2]) if len(sys.argv) > 2 else 1,
               len(sys.argv) > 3 and sys.argv[3] == "1"))
