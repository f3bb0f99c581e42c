"""Tests of pagedkv.vllm itself (run by scripts/vllm-tests.sh in the vLLM venv; need vllm 0.32.0 and pagedkv).

- every public member of vLLM's KVCacheManager exists on the adapter with the same inspect.signature (so a vLLM
  release whose interface moved fails here first);
- vLLM internals are refused by name (NotProvided), configurations pagedkv lacks by reason (Unsupported);
- a speculative-decoding round trip (lookahead slots, drafts accepted in part) keeps pagedkv's tokens equal to the
  request's and makes the committed blocks hits for the next request;
- a differential run against vLLM's own KVCacheManager on random workloads (shared prefixes, prompts copying a
  live request's generated tokens, chunked prefill, decode, speculative decoding with drafts accepted in part,
  frees): on a 40-block pool without drafts, the same hit lengths, the same admission / growth decisions and the
  same free-block counts, step by step; with drafts (a pool that never runs out), the same hits, and at least
  vLLM's free blocks (pagedkv releases the blocks that rejected drafts leave empty, vLLM keeps them).
"""

import inspect
import random

import pytest
import torch

import pagedkv.vllm as pv
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request

init_none_hash(sha256)


def _public(cls):
    return sorted(n for n in dir(cls) if not n.startswith("_") or n == "__init__")


def test_every_public_member_has_vllms_signature():
    names = [n for n in _public(VllmKVCacheManager) if n not in dir(object) or n == "__init__"]
    assert "allocate_slots" in names and "get_computed_blocks" in names and "take_events" in names
    for name in names:
        theirs = inspect.getattr_static(VllmKVCacheManager, name)
        ours = inspect.getattr_static(pv.KVCacheManager, name, None)
        assert ours is not None, f"pagedkv.vllm.KVCacheManager lacks {name}"
        if isinstance(theirs, property):
            assert isinstance(ours, property), name
            continue
        assert inspect.signature(ours) == inspect.signature(theirs), (
            f"{name}: {inspect.signature(ours)} != vLLM's {inspect.signature(theirs)}")


def _config(num_blocks, block_size=4):
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])


def _request(rid, tokens, block_size=4):
    sp = SamplingParams(max_tokens=1000)
    sp.update_from_generation_config({}, eos_token_id=None)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def _manager(cls, num_blocks, block_size=4, **kw):
    return cls(_config(num_blocks, block_size), max_model_len=4096, scheduler_block_size=block_size,
               hash_block_size=block_size, **kw)


def test_internals_are_refused_by_name():
    m = _manager(pv.KVCacheManager, 16)
    with pytest.raises(pv.NotProvided) as e:
        m.block_pool.free_block_queue  # noqa: B018
    assert e.value.object_name == "block_pool.free_block_queue"
    with pytest.raises(pv.NotProvided, match="KVCacheManager.req_to_blocks"):
        m.req_to_blocks  # noqa: B018
    r = _request("a", range(10))
    blocks = m.allocate_slots(r, 10)
    with pytest.raises(pv.NotProvided, match="KVCacheBlock.ref_cnt"):
        blocks.blocks[0][0].ref_cnt  # noqa: B018
    # What the scheduler reads is there.
    assert m.block_pool.get_num_free_blocks() == 15 - 3
    assert [g.block_size for g in m.coordinator.single_type_managers] == [4]


def test_mamba_is_refused_with_the_reason():
    spec = MambaSpec(block_size=4, shapes=((1,),), dtypes=(torch.float32,))
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)),
        KVCacheGroupSpec(["m"], spec)])
    with pytest.raises(pv.Unsupported, match="issue 20"):
        pv.KVCacheManager(cfg, max_model_len=64, scheduler_block_size=4, hash_block_size=4)


def test_speculative_decoding_round_trip():
    m = _manager(pv.KVCacheManager, 64, enable_kv_cache_events=True)
    r = _request("a", range(100, 110))  # 10 prompt tokens, block size 4
    blocks = m.allocate_slots(r, 10, num_lookahead_tokens=3)  # 13 slots: 4 blocks
    assert [len(g) for g in blocks.get_block_ids()] == [4]
    r.num_computed_tokens = 10
    # The first output token; then 1 + 2 drafts scheduled with 2 lookahead slots.
    r.append_output_token_ids([7])
    assert m.allocate_slots(r, 3, num_lookahead_tokens=2) is not None  # slots up to 10 + 3 + 2 = 15
    # One draft accepted plus the bonus token: 2 new known tokens, 11 + 2 = 13 computed... the rest rewound.
    r.num_computed_tokens = 11 + 1
    r.append_output_token_ids([8, 9])
    assert m.allocate_slots(r, 1) is not None
    seq = m._seqs["a"].seq
    assert m._pk.token_ids(seq) == list(range(100, 110)) + [7, 8, 9]
    assert m._pk.num_tokens(seq) == 13
    # Blocks full of known, built tokens are hits for a request with the same prefix: 12 tokens = 3 blocks.
    r2 = _request("b", list(range(100, 110)) + [7, 8, 9, 5])
    _, hit, _ = m.get_computed_blocks(r2)
    assert hit == 12
    stored = [h for e in m.take_events() if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert len(stored) == 3


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_differential_against_vllms_own_manager(seed, spec):
    rng = random.Random(seed)
    bs, nblocks = 4, (4000 if spec else 40)
    ours, theirs = _manager(pv.KVCacheManager, nblocks, bs), _manager(VllmKVCacheManager, nblocks, bs)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    live = {}  # rid -> (request for ours, request for theirs)
    next_id = 0
    for step in range(300):
        op = rng.random()
        if op < 0.35 or not live:
            if live and rng.random() < 0.4:  # a prompt sharing a live request's tokens, generated ones included
                src = live[rng.choice(sorted(live))][0].all_token_ids
                toks = list(src[:rng.randrange(1, len(src) + 1)])
            else:
                toks = list(rng.choice(prefixes))
            toks += [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
            rid = str(next_id)
            next_id += 1
            ra, rb = _request(rid, toks, bs), _request(rid, toks, bs)
            ca, ha, _ = ours.get_computed_blocks(ra)
            cb, hb, _ = theirs.get_computed_blocks(rb)
            assert ha == hb, f"step {step}: hit {ha} != vLLM's {hb}"
            chunk = rng.randrange(1, len(toks) - ha + 1)
            a = ours.allocate_slots(ra, chunk, ha, ca)
            b = theirs.allocate_slots(rb, chunk, hb, cb)
            assert (a is None) == (b is None), f"step {step}: admission {a} vs vLLM's {b}"
            if a is not None:
                ra.num_computed_tokens = rb.num_computed_tokens = ha + chunk
                live[rid] = (ra, rb)
        elif op < 0.75:
            rid = rng.choice(sorted(live))
            ra, rb = live[rid]
            remaining = ra.num_tokens - ra.num_computed_tokens
            drafts, accepted = 0, 0
            if remaining == 0:  # decode: a sampled token, then its slot (and k draft slots, speculative decoding)
                t = rng.randrange(1000)
                ra.append_output_token_ids([t])
                rb.append_output_token_ids([t])
                n = 1
                if spec and rng.random() < 0.5:
                    drafts = rng.randrange(1, 5)
                    accepted = rng.randrange(0, drafts + 1)
            else:  # the next prefill chunk
                n = rng.randrange(1, remaining + 1)
            a = ours.allocate_slots(ra, n + drafts)
            b = theirs.allocate_slots(rb, n + drafts)
            assert (a is None) == (b is None), f"step {step}: growth {a} vs vLLM's {b}"
            if a is not None:
                ra.num_computed_tokens += n
                rb.num_computed_tokens += n
                if drafts:  # the verification step: `accepted` drafts kept (their K/V computed), the rest rejected
                    acc = [rng.randrange(1000) for _ in range(accepted)]
                    ra.append_output_token_ids(acc)
                    rb.append_output_token_ids(acc)
                    ra.num_computed_tokens += accepted
                    rb.num_computed_tokens += accepted
            else:  # preempt, as the scheduler does
                ours.free(ra)
                theirs.free(rb)
                del live[rid]
        else:
            rid = rng.choice(sorted(live))
            ra, rb = live.pop(rid)
            ours.free(ra)
            theirs.free(rb)
        if spec:
            assert ours.block_pool.get_num_free_blocks() >= theirs.block_pool.get_num_free_blocks(), f"step {step}"
        else:
            assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks(), f"step {step}"
