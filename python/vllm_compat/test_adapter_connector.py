"""KV-connector loads on pagedkv.vllm with sliding-window and chunked-local groups, groups of different block sizes
(pagedkv's coarse pages), and a Mamba group in mode 'none' without prefix caching (run by scripts/vllm-tests.sh in
the vLLM venv; issue 33 item 7).

vLLM's scheduler drives a connector's load through its KVCacheManager: ``allocate_slots`` with
``num_external_computed_tokens`` (and ``delay_cache_blocks`` for an async load: the request waits in
WAITING_FOR_REMOTE_KVS), ``get_blocks`` (what the connector writes: update_state_after_alloc), then ``cache_blocks``
when the load finished, or ``free`` when it failed (with several KV-cache groups vLLM has no block-level failures:
a failed receive recomputes from 0 or fails the request). Here the adapter and vLLM's own KVCacheManager are driven
with the same random requests (prompts sharing prefixes, local hits, external token counts up to the whole prompt,
async and sync loads, failed and aborted loads, chunked prefill, decode, frees) on a pool that never runs out:

- every lookup gives the same hit (a fill's blocks are no hit before its completion, its valid blocks are after),
  but where a whole-prompt load's request has not computed its last token yet (pagedkv recomputes it, so its last
  block is not registered, where vLLM caches it): there pagedkv may hit less, and both admit at pagedkv's hit;
  every admission and growth the same decision;
- a waiting request's blocks per group have vLLM's lengths, and its window groups list the null block exactly where
  vLLM's do (the blocks before the window of the first query the load leaves to compute; pagedkv's query is at the
  prompt's last token when the load covers the whole prompt, vLLM's one past it, so vLLM may null one block more);
  no two open fills share a block;
- a running request's tables have vLLM's lengths, and the null block only where vLLM's have it (pagedkv drops a
  request's skipped blocks at its next growth crossing, vLLM at each step: never earlier than vLLM);
- an open fill's window blocks that the load leaves out are not taken: pagedkv's own table has the null block
  exactly where vLLM pads one (but after a whole-prompt load);
- every block either manager holds is in one of its requests' tables, and where both list a block pagedkv holds no
  more than vLLM (fewer by the blocks a completion deduplicated); pagedkv holds more only where vLLM lists the null
  block (a running request's skipped blocks until its next growth crossing, a whole-prompt load's last window
  step); at the end, with every request freed, every block is free on both;
- with a Mamba group (prefix caching off), the request's one state block is listed (the fill's ticket ends in it:
  checked by the adapter at admission), and as many attention blocks are to be zeroed as vLLM's (beside a window
  group too, but after a whole-prompt load).

Directed tests: a single sliding-window group's partial load failure (block-level, what vLLM allows with one group)
keeps only what the window rule allows and lowers the request's computed count to pagedkv's; a Mamba group with
prefix caching is refused with the reason, nothing changed.
"""

import math
import random

import pytest
import torch

import pagedkv.vllm as pv
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from _pairs import kept_duplicates, lookup_pair, make_config, make_request, next_tokens

init_none_hash(sha256)

BS = 4  # block size (tokens)
MAX_LEN = 120


def _full():
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _swa(window):
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window)


def _local(chunk):
    return ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                     attention_chunk_size=chunk)


def _mamba():
    return MambaSpec(block_size=MAX_LEN, shapes=((1, 1),), dtypes=(torch.float32,))


LAYOUTS = {
    "full+swa5": [_full(), _swa(5)],
    "full+swa12": [_full(), _swa(12)],
    "full+local8": [_full(), _local(8)],
    "full+swa7+local12": [_full(), _swa(7), _local(12)],
    "full": [_full()],
    # Mamba mode 'none' without prefix caching (vLLM's hybrid models with caching off): the load's state goes into
    # the request's one state block
    "full+mamba": [_full(), _mamba()],
    "full+swa5+mamba": [_full(), _swa(5), _mamba()],
    # groups of different block sizes (pagedkv's coarse pages: a load moves whole pages, from a page boundary; vLLM
    # aligns every hit to the groups' common block size)
    "full+full8": [_full(), FullAttentionSpec(block_size=2 * BS, num_kv_heads=1, head_size=1, dtype=torch.float32)],
    "full+swa5+full12": [_full(), _swa(5),
                         FullAttentionSpec(block_size=3 * BS, num_kv_heads=1, head_size=1, dtype=torch.float32)],
}


def _manager(cls, num_blocks, specs, retention=None, events=False):
    cfg = make_config(num_blocks, specs)
    cfg.prefix_cache_retention_interval = retention  # 0: vLLM's engine default (sparse window retention)
    if any(isinstance(s, MambaSpec) for s in specs):  # vLLM's block sizes with a mode-'none' Mamba group
        return cls(cfg, max_model_len=MAX_LEN, scheduler_block_size=MAX_LEN, hash_block_size=MAX_LEN,
                   enable_caching=False)
    lcm = math.lcm(*(s.block_size for s in specs))  # vLLM's hit alignment with groups of different block sizes
    return cls(cfg, max_model_len=MAX_LEN, scheduler_block_size=lcm, hash_block_size=BS, enable_caching=True,
               enable_kv_cache_events=events)


def _request(rid, tokens):
    return make_request(rid, tokens, BS)


def _skipped_blocks(spec, num_computed: int) -> int:
    """vLLM's get_num_skipped_tokens(num_computed) // block size of a window group (0 for full attention)."""
    if isinstance(spec, SlidingWindowSpec):
        return max(num_computed - spec.sliding_window + 1, 0) // BS
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size // BS
    return 0


def _nulls(ids):
    return [j for j, b in enumerate(ids) if b == 0]


@pytest.mark.parametrize("retention", [None, 0])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_connector_loads_differential_against_vllms_own_manager(layout, seed, retention, request):
    rng = random.Random(seed * 7919 + len(layout))
    specs = LAYOUTS[layout]
    if retention is not None and not any(isinstance(sp, SlidingWindowSpec) for sp in specs):
        pytest.skip("prefix_cache_retention_interval 0 changes nothing without a sliding-window group")
    if (layout, seed, retention) == ("full+swa7+local12", 1, 0):
        # At step 340 pagedkv hits 20 tokens where vLLM hits 12 (docs/vllm-swa-retention.md section 7): request 79's
        # whole-prompt load (P = 22) leaves pagedkv's first query at token 21, whose window reads block 3, which
        # vLLM pads null (its first query at 22); block 3 is in the replay tail, so only pagedkv registers it.
        # strict: the run fails once this passes, so the note goes with it.
        request.applymarker(pytest.mark.xfail(strict=True, reason="a whole-prompt load's window block pagedkv "
                                                                   "keeps and vLLM pads, retained"))
    mamba = [g for g, sp in enumerate(specs) if isinstance(sp, MambaSpec)]
    nblocks = 4000
    # KV events on where the groups share one block size (coarse pages refuse them): a request a load admitted keeps
    # pagedkv's own stores (docs/python.md "KV events"), so the streams are not compared here; no record of the
    # others may need mending.
    events = not mamba and len({sp.block_size for sp in specs}) == 1
    ours = _manager(pv.KVCacheManager, nblocks, specs, retention, events)
    theirs = _manager(VllmKVCacheManager, nblocks, specs, retention, events)
    bases = [[rng.randrange(40) for _ in range(rng.randrange(8, 60))] for _ in range(4)]
    live = {}  # rid -> [request for ours, request for theirs, waiting for its async load]
    whole = set()  # requests whose async load covered the whole prompt
    next_id = 0
    seen = {"async": 0, "sync": 0, "loaded": 0, "failed": 0, "aborted": 0, "clamped": 0, "hidden": 0, "fill_hit": 0,
            "clamped_nulls": 0, "later_nulls": 0, "same_held": 0, "kept_duplicates": 0, "zeroed": 0, "whole_hit_short": 0, "left_out": 0}

    def check_tables(step):
        fills = []
        held_a, held_b, paired = set(), set(), set()  # paired: pagedkv's blocks where vLLM lists one too
        for rid, (ra, rb, waiting) in live.items():
            ids_a, ids_b = ours.get_block_ids(rid), theirs.get_block_ids(rid)
            assert [len(x) for x in ids_a] == [len(x) for x in ids_b], f"step {step}: {rid}: {ids_a} vs {ids_b}"
            for g, spec in enumerate(specs):
                na, nb = _nulls(ids_a[g]), _nulls(ids_b[g])
                # pagedkv never lists the null block where vLLM's worker reads a real one; it may list a real block
                # where vLLM lists the null one: its skipped blocks go at the request's next growth crossing
                # (release_skipped_blocks), not at every step as vLLM's do (a decode token that fills no block does
                # not cross), and after a whole-prompt load pagedkv's first query is at the last prompt token
                # (recomputed for its logits), vLLM's one past it.
                assert na == list(range(len(na))) and set(na) <= set(nb), f"step {step}: {rid} g{g}: {na} {nb}"
                seen["clamped_nulls" if rid in whole else "later_nulls"] += len(nb) - len(na)
                if not isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                    assert not na, f"step {step}: {rid}: a null block in full-attention group {g}"
            s = ours._seqs[rid]
            real = list(ours._table(s.seq))
            for g in mamba:  # the request's one state block (pagedkv's working state), as vLLM lists it
                assert len(ids_a[g]) == 1 and ids_a[g][0] != 0, f"step {step}: {rid}: Mamba group {g}: {ids_a[g]}"
                real[g] = ids_a[g]
            for g in range(len(specs)):
                held_a.update(b for b in real[g] if b)
                held_b.update(b for b in ids_b[g] if b)
                paired.update(b for j, b in enumerate(real[g]) if b and ids_b[g][j])
            if waiting:
                fills.append([b for b in ours._fill_blocks.get(s.seq, ()) if b])  # none: nothing left to load
                # An open fill's window blocks that the load leaves out are not taken: after the local hit, the
                # null block in pagedkv's own table exactly where vLLM pads (but after a whole-prompt load, whose
                # first query vLLM puts one past pagedkv's); the hit's blocks there stay held (listed null).
                fill = ours._fill_of_seq.get(s.seq)
                hit_blocks = fill[1] // BS if fill else 0
                for g, spec in enumerate(specs):
                    if fill and isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                        left_out = [j for j in _nulls(real[g]) if j >= hit_blocks]
                        assert rid in whole or left_out == [j for j in _nulls(ids_b[g]) if j >= hit_blocks], \
                            f"step {step}: waiting {rid} g{g}: pagedkv's table {real[g]}, vLLM's {ids_b[g]}"
                        seen["left_out"] += len(left_out)
        flat = [b for f in fills for b in f]
        assert len(flat) == len(set(flat)), f"step {step}: two open fills share a block"
        # Every block pagedkv holds is in a request's table (nothing leaked), and so for vLLM.
        free_a, free_b = ours.block_pool.get_num_free_blocks(), theirs.block_pool.get_num_free_blocks()
        assert free_a == nblocks - 1 - len(held_a) and free_b == nblocks - 1 - len(held_b), f"step {step}"
        # pagedkv holds more only where vLLM lists the null block (a running request's skipped blocks until its
        # next growth crossing and a whole-prompt load's last window step) and by the duplicates it keeps
        # unregistered (vLLM registers both copies, and a later hit may take either); an admission's build that
        # deduplicated a block holds fewer.
        seen["hidden"] += len(held_a - paired)
        seen["same_held"] += len(paired) == len(held_b)
        dups = kept_duplicates(ours, list(live))
        seen["kept_duplicates"] += dups
        assert len(paired) <= len(held_b) + dups, \
            f"step {step}: {len(paired)} blocks where vLLM holds {len(held_b)} ({dups} kept duplicates)"

    def complete(rid, step):
        ra, rb, _ = live[rid]
        if rng.random() < 0.2 and len(specs) > 1:  # a failed receive: vLLM recomputes from 0 (frees the blocks)
            seen["failed"] += 1
            del live[rid]
            ours.free(ra)
            theirs.free(rb)
            return
        for r, m in ((ra, ours), (rb, theirs)):
            m.cache_blocks(r, r.num_computed_tokens)
            if r.num_computed_tokens == r.num_tokens:  # the scheduler recomputes the last token for its logits
                r.num_computed_tokens = r.num_tokens - 1
        assert ra.num_computed_tokens == rb.num_computed_tokens
        live[rid][2] = False
        seen["loaded"] += 1

    for step in range(400):
        op = rng.random()
        whole_now = False
        if op < 0.3 or not live:
            base = rng.choice(bases)
            toks = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(40) for _ in range(rng.randrange(0, 10))]
            if len(toks) < 2:
                continue
            rid = str(next_id)
            next_id += 1
            ra, rb, ca, ha, cb, hb = lookup_pair(ours, theirs, rid, toks, BS)
            # One difference: a whole-prompt load leaves pagedkv's last prompt token to compute (for its logits), so
            # until that request's next step its last block is not registered where vLLM has cached it: pagedkv may
            # hit less there (by a block, or by the common block size with groups of different block sizes).
            from_whole = any(w in live and hb <= len(live[w][0].prompt_token_ids)
                             and live[w][0].prompt_token_ids[:hb] == toks[:hb] for w in whole)
            assert ha == hb or (ha < hb and from_whole), f"step {step}: hit {ha} != vLLM's {hb} ({len(toks)} tokens)"
            seen["whole_hit_short"] += ha < hb
            if ha < hb:  # both admit at pagedkv's hit (vLLM's scheduler takes the hit its manager gives)
                cb = type(cb)(tuple(list(b)[:ha // specs[g].block_size] for g, b in enumerate(cb.blocks)))
                hb = ha
            seen["fill_hit"] += ha > 0
            load_async = rng.random() < 0.6
            if load_async:  # the connector's match may cover the whole prompt
                ext = rng.randrange(1, len(toks) - ha + 1)
                n = 0
            else:  # a sync load: the worker loads in this step's forward pass, then the rest is computed
                if len(toks) - ha < 2:
                    continue
                ext = rng.randrange(1, len(toks) - ha)
                n = rng.randrange(1, len(toks) - ha - ext + 1)
            a = ours.allocate_slots(ra, n, ha, ca, num_external_computed_tokens=ext, delay_cache_blocks=load_async)
            b = theirs.allocate_slots(rb, n, hb, cb, num_external_computed_tokens=ext, delay_cache_blocks=load_async)
            assert (a is None) == (b is None), f"step {step}: admission {a} vs vLLM's {b}"
            ra.num_computed_tokens = rb.num_computed_tokens = ha + ext + n
            live[rid] = [ra, rb, load_async]
            seen["async" if load_async else "sync"] += 1
            if load_async and ha + ext == len(toks):
                seen["clamped"] += 1
                whole.add(rid)
                whole_now = True
            # Nothing of an open fill is a hit; a sync load's blocks are (registered at allocation, as vLLM's).
            probe = toks + [99]  # (a fresh request id: the adapter keeps a looked-up prompt by id until admitted)
            pa, pb = _request(f"probe{step}", probe), _request(f"probe{step}", probe)
            assert ours.get_computed_blocks(pa)[1] == theirs.get_computed_blocks(pb)[1], f"step {step}: probe"
        elif op < 0.5 and any(w for _, _, w in live.values()):
            rid = rng.choice(sorted(r for r, v in live.items() if v[2]))
            if rng.random() < 0.15:  # aborted while its load is in flight (freed after the worker's report)
                seen["aborted"] += 1
                ra, rb, _ = live.pop(rid)
                ours.free(ra)
                theirs.free(rb)
            else:
                complete(rid, step)
        elif op < 0.9:
            running = sorted(r for r, v in live.items() if not v[2])
            if not running:
                continue
            rid = rng.choice(running)
            ra, rb, _ = live[rid]
            n = next_tokens(rng, ra, rb, MAX_LEN - 1, 40)
            if n is None:
                continue
            a = ours.allocate_slots(ra, n)
            b = theirs.allocate_slots(rb, n)
            assert (a is None) == (b is None), f"step {step}: growth {a} vs vLLM's {b}"
            # What vLLM's worker reads for this step (get_blocks right after allocate_slots): a real block wherever
            # vLLM's own manager lists one (a window block this chunk's queries read is not dropped by the build).
            for g, (xa, xb) in enumerate(zip(ours.get_block_ids(rid), theirs.get_block_ids(rid))):
                assert set(_nulls(xa)) <= set(_nulls(xb)), f"step {step}: {rid} g{g}: {xa} vs vLLM's {xb}"
            ids = ours.get_block_ids(rid)
            want = [1 if g in mamba else cdiv(ra.num_computed_tokens + n, specs[g].block_size)
                    for g in range(len(specs))]
            assert [len(x) for x in ids] == want, f"step {step}: tables {ids} for {ra.num_computed_tokens + n}"
            ra.num_computed_tokens += n
            rb.num_computed_tokens += n
        else:
            rid = rng.choice(sorted(live))
            ra, rb, _ = live.pop(rid)
            ours.free(ra)
            theirs.free(rb)
        for rid, (_, rb, waiting) in live.items():  # vLLM's release of the skipped blocks, before its next allocation
            if not waiting:
                theirs.remove_skipped_blocks(rid, rb.num_computed_tokens)
        check_tables(step)
        if events:
            ours.take_events()
        if mamba:  # vLLM zeroes new attention blocks with Mamba layers: as many listed (the window blocks a build
            # computed past stay listed until the next allocation, as vLLM's do)
            zero_a, zero_b = ours.take_new_block_ids(), theirs.take_new_block_ids()
            assert 0 not in zero_a and len(set(zero_a)) == len(zero_a), f"step {step}: {zero_a}"
            if len(specs) == 2:
                assert len(zero_a) == len(zero_b), f"step {step}: {zero_a} vs vLLM's {zero_b}"
            elif not whole_now:  # (a whole-prompt load: vLLM's window nulls one step more, see check_tables)
                assert len(zero_a) == len(zero_b), f"step {step}: {zero_a} vs vLLM's {zero_b}"
            seen["zeroed"] += len(zero_a)
    for ra, rb, _ in live.values():
        ours.free(ra)
        theirs.free(rb)
    assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks() == nblocks - 1
    assert sum(b.ref_cnt for b in ours.block_pool.blocks) == 0
    assert not events or ours.event_records_mended == 0
    assert seen["async"] > 30 and seen["sync"] > 15 and seen["loaded"] > 15, seen
    assert seen["fill_hit"] > 10 or mamba, seen  # (no prefix caching with a Mamba group)
    assert seen["zeroed"] > 0 or not mamba, seen
    assert seen["clamped"] > 0, seen
    if len(specs) > 1:
        assert seen["failed"] > 0, seen
    if layout in ("full+swa5", "full+local8", "full+swa7+local12", "full+swa5+mamba"):
        assert seen["left_out"] > 0, seen  # open fills did leave window blocks out (not taken)


def test_single_window_group_partial_failure_recomputes_from_the_hit():
    """One sliding-window group (vLLM reports block-level failures then): blocks 0..k-1 valid of a load whose next
    query's window reaches a left-out block keeps no block (the positions after the hit are recomputed), and the
    request's computed count comes back to pagedkv's; a failure whose window stays inside the valid blocks keeps
    them."""
    toks = list(range(100, 140))  # 40 tokens, 10 blocks
    # Window 6: the query at token 36 sees [31, 36]; blocks 0..6 are left out of the load.
    m = _manager(pv.KVCacheManager, 64, [_swa(6)])
    r = _request("a", toks)
    assert m.allocate_slots(r, 0, num_external_computed_tokens=36, delay_cache_blocks=True) is not None
    r.num_computed_tokens = 36
    ids = m.get_block_ids("a")[0]
    assert ids[:7] == [0] * 7 and 0 not in ids[7:] and len(ids) == 9  # slots for the 36 loaded tokens
    r.num_computed_tokens = 24  # block 6 invalid: vLLM truncates there; the query at 24 needs blocks 4..5
    m.cache_blocks(r, 24)
    assert r.num_computed_tokens == 0  # left out of the load: everything after the (empty) hit is recomputed
    assert m.get_computed_blocks(_request("probe", toks))[1] == 0
    assert m.allocate_slots(r, 40) is not None
    m.free(r)
    # Window 20: the query at 36 sees [17, 36], blocks 4..8 transferred; block 8 invalid: the query at 32 sees
    # [13, 32], block 3 was left out: nothing kept. Block 9 invalid instead (truncated at 36: all valid).
    m = _manager(pv.KVCacheManager, 64, [_swa(20)])
    r = _request("b", toks)
    m.allocate_slots(r, 0, num_external_computed_tokens=36, delay_cache_blocks=True)
    r.num_computed_tokens = 32
    m.cache_blocks(r, 32)
    assert r.num_computed_tokens == 0
    m.free(r)
    r = _request("c", toks)
    m.allocate_slots(r, 0, num_external_computed_tokens=36, delay_cache_blocks=True)
    r.num_computed_tokens = 36
    m.cache_blocks(r, 36)
    assert r.num_computed_tokens == 36
    assert m.get_block_ids("c")[0][:4] == [0] * 4  # the completion's release rule: null outside the window
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 63


@pytest.mark.parametrize(("specs", "words"), [
    ([_full(), MambaSpec(block_size=2 * BS, shapes=((1, 1),), dtypes=(torch.float32,))],
     "group 1 a MambaSpec and prefix caching"),
])
def test_connector_loads_refused_by_name(specs, words):
    m = pv.KVCacheManager(make_config(32, specs), max_model_len=MAX_LEN, scheduler_block_size=2 * BS,
                          hash_block_size=BS, enable_caching=True)
    r = _request("a", range(20))
    free = m.block_pool.get_num_free_blocks()
    with pytest.raises(pv.Unsupported, match=words):
        m.allocate_slots(r, 0, num_external_computed_tokens=16, delay_cache_blocks=True)
    assert m.block_pool.get_num_free_blocks() == free and m.get_block_ids("a") == m.empty_kv_cache_blocks.get_block_ids()


@pytest.mark.parametrize("layout", ["full+swa5", "full+local8", "full+swa7+local12"])
def test_a_chunk_longer_than_the_window_keeps_the_blocks_its_queries_read(layout):
    """vLLM's scheduler hands the worker get_blocks(request) right after allocate_slots; pagedkv's build must not
    have dropped the window blocks this chunk's own queries read (they go at the request's next allocation, as
    vLLM's remove_skipped_blocks: CacheConfig.release_at_build False). Before, a 20-token chunk beside a 5-token
    window listed [0, 0, 0, 0, b] where vLLM lists five blocks."""
    specs = LAYOUTS[layout]
    ours, theirs = _manager(pv.KVCacheManager, 64, specs), _manager(VllmKVCacheManager, 64, specs)
    tokens = list(range(1, 41))
    ra, rb = _request("r", tokens), _request("r", tokens)
    for n in (20, 12, 7):  # a chunked prefill: each chunk longer than the window
        assert ours.allocate_slots(ra, n) is not None and theirs.allocate_slots(rb, n) is not None
        xa, xb = ours.get_block_ids("r"), theirs.get_block_ids("r")
        for g in range(len(specs)):
            assert _nulls(xa[g]) == _nulls(xb[g]), f"after {ra.num_computed_tokens + n} tokens: {xa} vs {xb}"
        ra.num_computed_tokens += n
        rb.num_computed_tokens += n
    ours.free(ra)
    theirs.free(rb)
    assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks() == 63


@pytest.mark.parametrize("layout", ["full+swa5", "full+local8", "full+swa7+local12", "full+swa12"])
def test_load_admissions_on_tight_pools_decide_and_take_as_vllm(layout):
    """An async load's admission on a pool that may not hold it, with vLLM's scheduler defaults
    (full_sequence_must_fit: the whole known sequence must fit, every group), the watermark and reserved blocks:
    pagedkv's adapter admits exactly when vLLM's manager does, and then holds as many blocks (a window group's
    blocks the load leaves out are neither taken nor counted, as in vLLM), on fresh managers with random prompt
    lengths, chunks and external token counts."""
    rng = random.Random(len(layout) * 31)
    specs = LAYOUTS[layout]
    decided = {True: 0, False: 0}
    for trial in range(150):
        nblocks = rng.randrange(4, 40)
        ours, theirs = _manager(pv.KVCacheManager, nblocks, specs), _manager(VllmKVCacheManager, nblocks, specs)
        toks = [rng.randrange(40) for _ in range(rng.randrange(2, 60))]
        ext = rng.randrange(1, len(toks) + 1)
        n = rng.randrange(0, len(toks) - ext + 1) if ext < len(toks) else 0
        kwargs = dict(num_external_computed_tokens=ext, delay_cache_blocks=n == 0, full_sequence_must_fit=True,
                      reserved_blocks=rng.choice([0, 0, 1, 3]), has_scheduled_reqs=rng.random() < 0.5)
        ra, rb = _request("r", toks), _request("r", toks)
        ca, ha, _ = ours.get_computed_blocks(ra)
        cb, hb, _ = theirs.get_computed_blocks(rb)
        assert ha == hb == 0
        a = ours.allocate_slots(ra, n, 0, ca, **kwargs)
        b = theirs.allocate_slots(rb, n, 0, cb, **kwargs)
        assert (a is None) == (b is None), f"trial {trial}: {nblocks} blocks, {len(toks)} tokens, ext {ext}, " \
                                           f"n {n}, {kwargs}: pagedkv {a is not None}, vLLM {b is not None}"
        decided[a is not None] += 1
        # A whole-prompt load leaves pagedkv's last prompt token to compute (for its logits), vLLM's first query one
        # past it: vLLM may skip one more window step (a whole chunk of a chunked-local group) per window group.
        extra = ours.block_pool.get_num_free_blocks() - theirs.block_pool.get_num_free_blocks()
        whole = ext == len(toks)
        assert extra == 0 or (whole and extra < 0), \
            f"trial {trial}: {len(toks)} tokens, ext {ext}, n {n}: pagedkv holds {-extra} blocks more"
        decided["whole_extra"] = decided.get("whole_extra", 0) + (extra != 0)
        if a is not None:
            ours.free(ra)
            theirs.free(rb)
    assert decided[True] > 20 and decided[False] > 20, decided
