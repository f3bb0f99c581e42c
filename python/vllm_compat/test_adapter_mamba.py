"""pagedkv.vllm's mapping of vLLM's Mamba groups and its refusals (run by scripts/vllm-tests.sh in the vLLM venv).

- A MambaSpec in cache mode 'none' without prefix caching (vLLM's hybrid models with prefix caching off: the Mamba
  block is max_model_len tokens, one state block per request) runs on a pagedkv recurrent group: a differential run
  against vLLM's own KVCacheManager on random workloads (chunked prefill, decode, preemption, frees; a pool small
  enough to refuse) gives the same admission / growth decisions and the same free-block counts step by step, and
  the Mamba group's blocks are what vLLM lists: the request's one state block, held from admission to free, its own;
  the new attention blocks to zero (take_new_block_ids, which vLLM zeroes with Mamba layers) are as many.
- The Mamba configurations pagedkv's semantics differ on (mode 'align', speculative state blocks, a Mamba group 0,
  an attention-free model) raise Unsupported naming the field and value; a refused allocate_slots changes nothing.
  A request with no token yet allocates its slots as vLLM's own manager does. (Mode 'none' with prefix caching: test_adapter_mamba_caching.py.)
"""

import random

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

_SWA = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8)

from _pairs import free_pair, free_random, lookup_pair, next_tokens, make_config, make_request

init_none_hash(sha256)

BS = 4  # attention block size (tokens)
MAX_LEN = 64  # max_model_len: vLLM's Mamba block size in mode 'none'


def _mamba(block_size=MAX_LEN, **kw):
    return MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), **kw)


def _full():
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


_config = make_config


def _manager(cls, num_blocks, specs, enable_caching=False, scheduler_block_size=MAX_LEN):
    # vLLM's resolve_kv_cache_block_sizes with a mode-'none' Mamba group: the LCM of the groups' block sizes, and
    # hashing at that size (unused without prefix caching).
    return cls(_config(num_blocks, specs), max_model_len=MAX_LEN, scheduler_block_size=scheduler_block_size,
               hash_block_size=scheduler_block_size, enable_caching=enable_caching)


def _request(rid, tokens):
    return make_request(rid, tokens, BS)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("layout", ["full+mamba", "full+mamba+mamba"])
def test_mamba_none_mode_differential_against_vllms_own_manager(seed, layout):
    rng = random.Random(seed)
    # (With a sliding-window group pagedkv releases window blocks at the build, vLLM at the next allocate_slots:
    # the free counts differ by design, docs/python.md, so the layouts compared exactly have none.)
    specs = {"full+mamba": [_full(), _mamba()], "full+mamba+mamba": [_full(), _mamba(), _mamba()]}[layout]
    mamba_groups = [g for g, s in enumerate(specs) if isinstance(s, MambaSpec)]
    ours, theirs = _manager(pv.KVCacheManager, 30, specs), _manager(VllmKVCacheManager, 30, specs)
    live = {}  # rid -> (request for ours, request for theirs, the state block of each Mamba group)
    next_id = refused = zeroed = 0
    for step in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            toks = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            rid = str(next_id)
            next_id += 1
            ra, rb, _, ha, _, hb = lookup_pair(ours, theirs, rid, toks, BS)
            assert ha == hb == 0  # no prefix caching
            chunk = rng.randrange(1, len(toks) + 1)
            a = ours.allocate_slots(ra, chunk)
            b = theirs.allocate_slots(rb, chunk)
            assert (a is None) == (b is None), f"step {step}: admission {a} vs vLLM's {b}"
            if a is None:
                refused += 1
                continue
            ids_a, ids_b = a.get_block_ids(), b.get_block_ids()
            assert [len(x) for x in ids_a] == [len(x) for x in ids_b], f"step {step}: {ids_a} vs vLLM's {ids_b}"
            states = {g: ids_a[g][0] for g in mamba_groups}
            assert all(b != 0 for b in states.values())
            for other in live.values():  # a state block is the request's own
                assert not set(states.values()) & set(other[2].values())
            ra.num_computed_tokens = rb.num_computed_tokens = chunk
            live[rid] = (ra, rb, states)
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            ra, rb, states = live[rid]
            n = next_tokens(rng, ra, rb, MAX_LEN, 1000)
            if n is None:
                continue
            a = ours.allocate_slots(ra, n)
            b = theirs.allocate_slots(rb, n)
            assert (a is None) == (b is None), f"step {step}: growth {a} vs vLLM's {b}"
            if a is not None:
                ids_a, ids_b = a.get_block_ids(), b.get_block_ids()
                assert [len(x) for x in ids_a] == [len(x) for x in ids_b], f"step {step}: {ids_a} vs {ids_b}"
                for g in mamba_groups:
                    assert ids_a[g] == [] and ours.get_block_ids(rid)[g] == [states[g]]
                ra.num_computed_tokens += n
                rb.num_computed_tokens += n
            else:  # preempt, as the scheduler does
                free_pair(ours, theirs, live, rid)
        else:
            free_random(rng, ours, theirs, live)
        assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks(), f"step {step}"
        # With Mamba layers vLLM zeroes the new attention blocks (take_new_block_ids): as many here, all held.
        zero_a, zero_b = ours.take_new_block_ids(), theirs.take_new_block_ids()
        assert len(zero_a) == len(zero_b) and 0 not in zero_a, f"step {step}: {zero_a} vs vLLM's {zero_b}"
        zeroed += len(zero_a)
    assert refused > 0 and zeroed > 0 and next_id > 20  # the pool ran out on the way (the refusals were compared too)


def test_mamba_beside_a_sliding_window_group():
    """full + sliding window + Mamba: the state block stays the request's one Mamba block while the window group
    releases the blocks behind its window (block 0, vLLM's null block, in their place)."""
    m = _manager(pv.KVCacheManager, 30, [_full(), _SWA, _mamba()])
    r = _request("a", range(20))
    state = m.allocate_slots(r, 20).get_block_ids()[2]
    assert len(state) == 1 and state[0] != 0
    r.num_computed_tokens = 20
    for t in range(20):
        r.append_output_token_ids([t])
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    ids = m.get_block_ids("a")
    assert ids[2] == state and len(ids[0]) == 10 and ids[1][:7] == [0] * 7 and 0 not in ids[1][8:]
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 29


def test_popped_blocks_include_the_state_block():
    m = _manager(pv.KVCacheManager, 16, [_full(), _mamba()])
    r = _request("a", range(10))
    blocks = m.allocate_slots(r, 10)
    state = blocks.get_block_ids()[1][0]
    free_before = m.block_pool.get_num_free_blocks()
    popped = m.pop_blocks_for_free(r)
    assert state in [b.block_id for b in popped]
    assert m.block_pool.get_num_free_blocks() == free_before  # held until block_pool.free_blocks
    m.block_pool.free_blocks(popped)
    assert m.block_pool.get_num_free_blocks() == 15


@pytest.mark.parametrize("specs,caching,words", [
    ([_full(), _mamba(BS, mamba_cache_mode="align", num_prefill_checkpoint_blocks=2, prefill_checkpoint_alignment=1)],
     True, ["mode 'align'", "num_prefill_checkpoint_blocks = 2"]),
    ([_full(), _mamba(2 * BS, mamba_cache_mode="align")], False, ["mode 'align'", "!= the attention block size"]),
    ([_full(), _mamba(BS, num_speculative_blocks=1)], True, ["num_speculative_blocks = 1"]),
    ([_full(), _mamba(num_speculative_blocks=2)], False, ["num_speculative_blocks = 2"]),
    ([_mamba()], False, ["every group is MambaSpec"]),
])
def test_mamba_configurations_refused_by_name(specs, caching, words):
    sbs = BS if caching else MAX_LEN
    with pytest.raises(pv.Unsupported) as e:
        _manager(pv.KVCacheManager, 16, specs, enable_caching=caching, scheduler_block_size=sbs)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_retention_interval_with_mamba_and_no_caching():
    """vLLM's default prefix_cache_retention_interval 0 is accepted (nothing is cached); vLLM's ValueErrors stay."""
    specs = [_full(), _mamba()]
    from dataclasses import replace

    for value in (None, 0, 128):
        cfg = replace(_config(16, specs), prefix_cache_retention_interval=value)
        pv.KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=MAX_LEN, hash_block_size=MAX_LEN,
                          enable_caching=False)
    with pytest.raises(ValueError, match="multiple of"):
        pv.KVCacheManager(replace(_config(16, specs), prefix_cache_retention_interval=3), max_model_len=MAX_LEN,
                          scheduler_block_size=MAX_LEN, hash_block_size=MAX_LEN, enable_caching=False)


@pytest.mark.parametrize("caching", [False, True])
def test_empty_prompt_allocates_as_vllms_own_manager(caching):
    """A request with no token yet (vLLM's test_allocate_with_lookahead): vLLM allocates the slots asked, ceil((3 +
    2) / 4) blocks; pagedkv admits the sequence empty and takes them as lookahead slots. Side by side with vLLM's own
    manager: the same blocks, the same free count, all of them back at the free. (vLLM's own lookup of such a request
    fails with prefix caching on: it is not asked.)"""
    specs = [_full()]
    kw = dict(enable_caching=caching, scheduler_block_size=BS)
    ours, theirs = _manager(pv.KVCacheManager, 16, specs, **kw), _manager(VllmKVCacheManager, 16, specs, **kw)
    free = ours.block_pool.get_num_free_blocks()
    assert free == theirs.block_pool.get_num_free_blocks()
    for i, (new, lookahead) in enumerate([(3, 2), (3, 4), (1, 3), (5, 0)]):
        ra, rb = _request(f"empty{i}", []), _request(f"empty{i}", [])
        assert ours.get_computed_blocks(ra)[1] == 0
        a = ours.allocate_slots(ra, new, num_lookahead_tokens=lookahead)
        b = theirs.allocate_slots(rb, new, num_lookahead_tokens=lookahead)
        assert [len(x) for x in a.get_block_ids()] == [len(x) for x in b.get_block_ids()]
        assert len(a.get_block_ids()[0]) == -(-(new + lookahead) // BS)
        assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks() < free
        assert ours.get_blocks(f"empty{i}").get_block_ids() == a.get_block_ids()
        ours.free(ra)
        theirs.free(rb)
        assert ours.block_pool.get_num_free_blocks() == free
    ok = _request("next", range(5))
    assert ours.allocate_slots(ok, 5) is not None  # the manager still serves


def test_empty_prompt_beside_a_mamba_group_refused_and_nothing_changes():
    specs = [_full(), _mamba()]
    m = _manager(pv.KVCacheManager, 16, specs)
    free = m.block_pool.get_num_free_blocks()
    r = _request("empty", [])
    assert m.get_computed_blocks(r)[1] == 0
    with pytest.raises(pv.Unsupported, match=r"no token yet \(4 slots asked\) beside a Mamba group"):
        m.allocate_slots(r, 1, num_lookahead_tokens=3)
    assert m.block_pool.get_num_free_blocks() == free
    assert m.get_blocks("empty").get_block_ids() == tuple([] for _ in specs)
    ok = _request("next", range(5))
    assert m.allocate_slots(ok, 5) is not None  # the manager still serves
