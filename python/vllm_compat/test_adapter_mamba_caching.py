"""pagedkv.vllm's mapping of vLLM's Mamba groups in cache mode 'none' with prefix caching on (run by
scripts/vllm-tests.sh in the vLLM venv).

vLLM's MambaManager in that mode caches the state at every full Mamba block (its block size: a multiple of the
attention block size) and serves a hit only at such a boundary, the longest one every group holds, capped at
num_tokens - 1; vLLM's engine itself switches to 'align' when prefix caching is on, so this is the layout of vLLM's
manager tests. The adapter maps it onto a pagedkv recurrent group with a checkpoint every Mamba block:

- a differential run against vLLM's own KVCacheManager on random workloads (prompts sharing prefixes, chunked
  prefill, decode, frees) in a pool large enough never to evict gives the same hit for every lookup, the same
  number of hit blocks per group, the hit's Mamba blocks as vLLM lists them (the null block but the last, a
  checkpoint), and the same admission and growth decisions; the hits are not all 0 (the prefixes are shared);
- in a small pool (evictions, refusals, preemptions: pagedkv holds a state block and the pending checkpoints,
  vLLM every Mamba block of the step, so the pools fill differently by design) every hit stays on a Mamba block
  boundary, every admission with a hit resumes from a registered checkpoint, and every block comes back;
- KV events with the Mamba block at the attention block size have vLLM's shape;
- the layouts that cannot be mapped exactly (a sparse prefix_cache_retention_interval, EAGLE, attention groups of
  different block sizes, a Mamba block size the attention block size does not divide, KV events with a larger
  Mamba block) raise Unsupported by name.
"""

import random
from dataclasses import replace
from math import lcm

import pytest
import torch

import pagedkv.vllm as pv
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from _pairs import EventCheck, free_pair, free_random, lookup_pair, next_tokens, make_config, make_request

init_none_hash(sha256)

BS = 4  # attention block size (tokens): vLLM's hash block size, pagedkv's block size
MAX_LEN = 96


def _mamba(block_size):
    return MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,))


def _full(bs=BS):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _swa(window):
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window)


_config = make_config


def _sbs(specs):
    # vLLM's resolve_kv_cache_block_sizes: the LCM of the groups' block sizes, hashing at the attention block size.
    out = 1
    for s in specs:
        out = lcm(out, s.block_size)
    return out


def _manager(cls, num_blocks, specs, **kw):
    return cls(_config(num_blocks, specs), max_model_len=MAX_LEN, scheduler_block_size=_sbs(specs),
               hash_block_size=BS, enable_caching=True, **kw)


def _request(rid, tokens):
    return make_request(rid, tokens, BS)


LAYOUTS = {
    "full+mamba": [_full(), _mamba(BS)],
    "full+mamba8": [_full(), _mamba(2 * BS)],
    "full+mamba+mamba8": [_full(), _mamba(BS), _mamba(2 * BS)],
    "full+swa+mamba": [_full(), _swa(3 * BS), _mamba(BS)],
}


def _prompt(rng, prefixes):
    return rng.choice(prefixes)[:rng.randrange(0, 40)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 24))]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mamba_caching_differential_against_vllms_own_manager(seed, layout):
    rng = random.Random(seed)
    specs = LAYOUTS[layout]
    mamba = [g for g, s in enumerate(specs) if isinstance(s, MambaSpec)]
    # KV events compared where every group has the attention block size (a larger Mamba block refuses them)
    events = all(s.block_size == BS for s in specs)
    ours = _manager(pv.KVCacheManager, 4000, specs, enable_kv_cache_events=events)
    theirs = _manager(VllmKVCacheManager, 4000, specs, enable_kv_cache_events=events)
    ev = EventCheck(ours, theirs, BS) if events else None
    prefixes = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    live, next_id, hits = {}, 0, 0
    for step in range(300):
        op = rng.random()
        if op < 0.35 or not live:
            toks = _prompt(rng, prefixes)
            rid = str(next_id)
            next_id += 1
            ra, rb, ca, ha, cb, hb = lookup_pair(ours, theirs, rid, toks, BS)
            assert ha == hb, f"step {step}: hit {ha} vs vLLM's {hb} ({len(toks)} tokens)"
            ids_a, ids_b = ca.get_block_ids(), cb.get_block_ids()
            assert [len(x) for x in ids_a] == [len(x) for x in ids_b], f"step {step}: {ids_a} vs vLLM's {ids_b}"
            for g in mamba:
                assert [b == 0 for b in ids_a[g]] == [b == 0 for b in ids_b[g]], f"step {step}: {ids_a[g]}"
            hits += ha > 0
            chunk = rng.randrange(1, len(toks) - ha + 1)
            a = ours.allocate_slots(ra, chunk, ha, ca)
            b = theirs.allocate_slots(rb, chunk, hb, cb)
            assert (a is None) == (b is None), f"step {step}: admission {a} vs vLLM's {b}"
            if a is None:
                continue
            ra.num_computed_tokens = rb.num_computed_tokens = ha + chunk
            live[rid] = (ra, rb)
        elif op < 0.85:
            rid = rng.choice(sorted(live))
            ra, rb = live[rid]
            n = next_tokens(rng, ra, rb, MAX_LEN, 1000)
            if n is None:
                continue
            a, b = ours.allocate_slots(ra, n), theirs.allocate_slots(rb, n)
            assert (a is None) == (b is None), f"step {step}: growth {a} vs vLLM's {b}"
            ra.num_computed_tokens += n
            rb.num_computed_tokens += n
        else:
            free_random(rng, ours, theirs, live)
        ours.new_step_starts()
        theirs.new_step_starts()  # vLLM defers a Mamba hit on a state cached in the same step
        if ev is not None:
            ev.compare(list(live.values()), f"step {step}")
    assert hits > 10 and next_id > 50
    assert ev is None or (ev.records > 100 and ev.listed > 100)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("layout", ["full+mamba8", "full+swa+mamba"])
def test_mamba_caching_small_pool(seed, layout):
    rng = random.Random(seed)
    specs = LAYOUTS[layout]
    step_tokens = _sbs(specs)
    m = _manager(pv.KVCacheManager, 40, specs)
    free0 = m.block_pool.get_num_free_blocks()
    prefixes = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    live, next_id, refused, hits = {}, 0, 0, 0
    for step in range(500):
        op = rng.random()
        if op < 0.35 or not live:
            toks = _prompt(rng, prefixes)
            r = _request(str(next_id), toks)
            next_id += 1
            blocks, hit, _ = m.get_computed_blocks(r)
            assert hit % step_tokens == 0 and hit < len(toks), f"step {step}: hit {hit}"
            if hit:
                hits += 1
                for g, s in enumerate(specs):
                    if isinstance(s, MambaSpec):
                        ids = blocks.get_block_ids()[g]
                        assert len(ids) == hit // s.block_size and ids[-1] != 0 and not any(ids[:-1])
            chunk = rng.randrange(1, len(toks) - hit + 1)
            if m.allocate_slots(r, chunk, hit, blocks) is None:
                refused += 1
                continue
            r.num_computed_tokens = hit + chunk
            live[r.request_id] = r
        elif op < 0.85:
            r = live[rng.choice(sorted(live))]
            if r.num_computed_tokens == r.num_tokens:
                if r.num_tokens >= MAX_LEN:
                    continue
                r.append_output_token_ids([rng.randrange(1000)])
            n = rng.randrange(1, r.num_tokens - r.num_computed_tokens + 1)
            if m.allocate_slots(r, n) is None:
                m.free(live.pop(r.request_id))  # preempt, as the scheduler does
                refused += 1
                continue
            r.num_computed_tokens += n
        else:
            m.free(live.pop(rng.choice(sorted(live))))
    for r in live.values():
        m.free(r)
    assert m.block_pool.get_num_free_blocks() == free0
    assert refused > 0 and hits > 0


def test_hit_resumes_from_the_checkpoint_and_lists_it():
    """Two requests sharing 3 Mamba blocks (24 tokens at 8 per block): the second hits 24 tokens, its Mamba hit is
    [null, null, checkpoint] as vLLM lists it, its state block is its own, and the first's checkpoint block is the
    one pagedkv registered at 24 (state_in of the admission's build)."""
    specs = [_full(), _mamba(2 * BS)]
    m = _manager(pv.KVCacheManager, 64, specs)
    shared = list(range(100, 124))
    a = _request("a", shared + [1, 2, 3])
    assert m.allocate_slots(a, a.num_tokens) is not None
    state_a = m.get_block_ids("a")[1]
    b = _request("b", shared + [7, 8])
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 24
    ids = blocks.get_block_ids()
    assert len(ids[0]) == 6 and ids[1][:2] == [0, 0] and ids[1][2] not in (0, *state_a)
    assert m.allocate_slots(b, 2, hit, blocks) is not None
    state_b = m.get_block_ids("b")[1]
    assert len(state_b) == 1 and state_b != state_a and ids[0] == m.get_block_ids("b")[0][:6]
    # A prompt sharing 23 tokens hits the checkpoint at 16 (the last Mamba block boundary it holds), not 20.
    c = _request("c", shared[:23] + [9, 9])
    assert m.get_computed_blocks(c)[1] == 16


@pytest.mark.parametrize("specs,kw,words", [
    ([_full(), _mamba(BS)], {"use_eagle": True}, ["use_eagle"]),
    ([_full(), _full(2 * BS), _mamba(2 * BS)], {}, ["different block sizes"]),
    ([_full(2 * BS), _mamba(3 * BS)], {}, ["block size 12", "not a multiple"]),
    ([_full(), _mamba(2 * BS)], {"enable_kv_cache_events": True}, ["enable_kv_cache_events", "block size 8"]),
])
def test_mamba_caching_layouts_refused_by_name(specs, kw, words):
    with pytest.raises(pv.Unsupported) as e:
        pv.KVCacheManager(_config(32, specs), max_model_len=MAX_LEN, scheduler_block_size=_sbs(specs),
                          hash_block_size=min(s.block_size for s in specs if not isinstance(s, MambaSpec)),
                          enable_caching=True, **kw)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("retention", [0, 8, 64])
def test_sparse_retention_with_mamba_caching_refused(retention):
    """vLLM with a retention interval keeps only some Mamba checkpoints (0: the replay boundary and pinned
    junctions); pagedkv keeps every one, so its hits would be longer: refused, naming the Mamba group. None (dense)
    is served."""
    specs = [_full(), _mamba(2 * BS)]
    cfg = replace(_config(32, specs), prefix_cache_retention_interval=retention)
    with pytest.raises(pv.Unsupported, match="with a Mamba group"):
        pv.KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=8, hash_block_size=BS,
                          enable_caching=True)
    cfg = replace(_config(32, specs), prefix_cache_retention_interval=None)
    pv.KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=8, hash_block_size=BS, enable_caching=True)


def test_events_with_mamba_blocks_at_the_attention_block_size():
    """Mamba block = attention block: pagedkv's stores are vLLM's in shape (one BlockStored per group and chain, the
    group's kind, block size and token count), as vLLM's own manager emits them."""
    specs = [_full(), _mamba(BS)]
    shapes = []
    for cls in (pv.KVCacheManager, VllmKVCacheManager):
        m = _manager(cls, 64, specs, enable_kv_cache_events=True)
        r = _request("a", range(100, 121))
        assert m.allocate_slots(r, 21) is not None
        shapes.append(sorted((e.group_idx, e.kv_cache_spec_kind, e.block_size, len(e.block_hashes), len(e.token_ids))
                             for e in m.take_events()))
    assert shapes[0] == shapes[1] == [(0, "full_attention", 4, 5, 20), (1, "mamba", 4, 5, 20)]


def test_wrong_scheduler_block_size_refused():
    specs = [_full(), _mamba(2 * BS)]
    with pytest.raises(pv.Unsupported, match="scheduler block size 4"):
        pv.KVCacheManager(_config(32, specs), max_model_len=MAX_LEN, scheduler_block_size=4, hash_block_size=BS,
                          enable_caching=True)
