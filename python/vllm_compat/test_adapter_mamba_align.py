"""pagedkv.vllm with vLLM's Mamba groups in mamba_cache_mode 'align' (what vLLM's engine runs for a hybrid model with
prefix caching; docs/vllm-mamba-align.md), run by scripts/vllm-tests.sh in the vLLM venv.

A differential run against vLLM's own KVCacheManager (its MambaManager in align mode) on random workloads: prompts
sharing random prefixes of a few bases and of each other, chunked prefill cut as vLLM's scheduler cuts it for align
mode (Scheduler._mamba_block_aligned_split: a chunk that does not finish the prefill ends on a block boundary, and is
cut at floor(num_tokens - 1), unless it keeps an internal prefill checkpoint, and at the shared-prefix junction the
lookup returned), decode, frees, readmissions with
the outputs as prompt, `remove_skipped_blocks` before every growth and `new_step_starts` before every step, as vLLM's
scheduler calls them. Every lookup gives the same hit and junction; every allocation returns the same blocks per
group with the Mamba group's nulls at the same places; every request's rows (get_block_ids) have the same shape,
nulls included, as are estimate_cached_tokens and get_block_ids_for_computed_tokens; the Mamba group caches as many
states; a final probe of every block-aligned prefix gives the same
hits; every step's boundary-state offers (take_boundary_state_offloads: group and position per request) are equal.
Layouts: full attention + one or two Mamba groups (block sizes 4 and 16), with and without the prefill checkpoint
block of vLLM's Mamba-2 layers (alignment 1 and 2); retention None, 0 and 2 blocks; a pool that never evicts (pagedkv's deduplication holds fewer blocks under pressure, so eviction order differs).
"""

import random

import pytest
import torch

import pagedkv.vllm as pv
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from vllm.utils.math_utils import cdiv

from _pairs import EventCheck, make_config, make_request

init_none_hash(sha256)

MAX_LEN = 240


def _full(bs):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _align(bs, **kw):
    return MambaSpec(block_size=bs, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align", **kw)


_CKPT = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}  # vLLM's Mamba-2 layers

LAYOUTS = {
    "full4+mamba4": ([_full(4), _align(4)], 4),
    "full16+mamba16": ([_full(16), _align(16)], 16),
    "full4+mamba4+mamba4": ([_full(4), _align(4), _align(4)], 4),
    "full4+mamba4/ckpt": ([_full(4), _align(4, **_CKPT)], 4),
    "full16+mamba16/ckpt": ([_full(16), _align(16, **_CKPT)], 16),
    "mamba4+full4/ckpt": ([_align(4, **_CKPT), _full(4)], 4),  # Qwen3-Next's order: a linear-attention layer first
    "full4+mamba4/ckpt-align2": ([_full(4), _align(4, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=2)], 4),
}


def _manager(cls, specs, bs, retention, **kw):
    cfg = make_config(6000, specs)
    cfg.prefix_cache_retention_interval = retention
    return cls(cfg, max_model_len=MAX_LEN, scheduler_block_size=bs, hash_block_size=bs, enable_caching=True, **kw)


def _chunk(rng, req, bs: int, checkpointing: bool, align: int = 1) -> int:
    """The tokens vLLM's scheduler schedules next for `req` in align mode (a random token budget): a prefill chunk
    cut as Scheduler._mamba_block_aligned_split cuts it (hash block = block size, no EAGLE, no partial hits: a chunk
    that does not reach the prefill end ends on a block boundary or schedules nothing; then the first of the next
    block boundary when it starts inside one, floor(num_tokens - 1) unless the chunk keeps an internal prefill
    checkpoint, and the block-floored junction, strictly inside it), else one decode token (0: nothing)."""
    start = req.num_computed_tokens
    prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
    remaining = req.num_tokens - start
    if remaining == 0:
        return 0
    budget = rng.randrange(1, 3 * bs + 2) if rng.random() < 0.6 else rng.randrange(1, 100)
    end = start + min(budget, remaining)
    if start >= prefill_end:
        return end - start
    last_cache = (req.num_tokens - 1) // bs * bs
    pos = (prefill_end - 1) // bs * bs  # the internal checkpoint's position (vLLM's is_mamba_prefill_checkpoint_valid)
    internal = (checkpointing and end >= prefill_end and start % bs == 0 and cdiv(end, bs) - 2 > (start - 1) // bs
                and start + bs <= pos and start < pos < end and (pos - start) % align == 0)
    if internal:
        last_cache = 0
    if end < prefill_end:
        end = end // bs * bs  # whole blocks (the block size is within the token budget)
        if end <= start:
            return 0
    junction = getattr(req, "shared_prefix_boundary", 0) or 0
    stops = (
        (start // bs + 1) * bs if start % bs and not internal else 0,
        last_cache,
        start + (junction - start) // bs * bs if start < junction < end else 0,
    )
    end = min((x for x in stops if start < x < end), default=end)
    return end - start
def _shape(ids):
    """Per group: which entries are the null block."""
    return [[b == 0 for b in grp] for grp in ids]


def _cached(ours, theirs, g):
    from vllm.v1.core.kv_cache_utils import get_group_id

    vllm = sum(1 for k in theirs.block_pool.cached_block_hash_to_block._cache if get_group_id(k) == g)
    return ours._pk.num_cached_blocks(ours._pk_group[g]), vllm


def _lookup(ours, theirs, ra, rb):
    ca, ha, ja = ours.get_computed_blocks(ra)
    cb, hb, jb = theirs.get_computed_blocks(rb)
    ra.shared_prefix_boundary, rb.shared_prefix_boundary = ja, jb
    return ca, ha, ja, cb, hb, jb


@pytest.mark.parametrize("retention", [None, 0, 2])  # interval in blocks
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mamba_align_differential_against_vllms_own_manager(layout, seed, retention):
    specs, bs = LAYOUTS[layout]
    interval = None if retention is None else retention * bs
    rng = random.Random(seed * 100 + (retention if retention is not None else 9) + bs)
    ours = _manager(pv.KVCacheManager, specs, bs, interval, enable_kv_cache_events=True)
    theirs = _manager(VllmKVCacheManager, specs, bs, interval, enable_kv_cache_events=True)
    ev = EventCheck(ours, theirs, bs)
    mamba = [g for g, sp in enumerate(specs) if isinstance(sp, MambaSpec)]
    ckpt = any(sp.num_prefill_checkpoint_blocks for sp in specs if isinstance(sp, MambaSpec))
    align = next((sp.prefill_checkpoint_alignment for sp in specs
                  if isinstance(sp, MambaSpec) and sp.num_prefill_checkpoint_blocks), 1)
    bases = [[rng.randrange(40) for _ in range(rng.randrange(2 * bs, 10 * bs))] for _ in range(4)]
    live, waiting, seen = {}, {}, []
    next_id = hits = junctions = readmissions = refused_same_step = offers = 0

    def admit(rid, ra, rb, step):
        nonlocal hits, junctions, refused_same_step
        ca, ha, ja, cb, hb, jb = _lookup(ours, theirs, ra, rb)
        assert (ha, ja) == (hb, jb), f"step {step}: hit, junction {ha, ja} vs vLLM's {hb, jb} ({ra.num_tokens} tokens)"
        assert _shape(ca.get_block_ids()) == _shape(cb.get_block_ids()), f"step {step}: the hit's rows"
        ra.num_computed_tokens = ha  # the chunk after the hit
        n = _chunk(rng, ra, bs, ckpt, align)
        ra.num_computed_tokens = 0
        if n == 0:
            waiting[rid] = (ra, rb)
            return
        a = ours.allocate_slots(ra, n, ha, ca)
        b = theirs.allocate_slots(rb, n, hb, cb)
        assert (a is None) == (b is None), f"step {step}: admission {a} vs vLLM's {b}"
        if a is None:  # the hit ends on a state registered this step: vLLM waits a step
            refused_same_step += 1
            ra.num_computed_tokens = rb.num_computed_tokens = 0
            waiting[rid] = (ra, rb)
            return
        assert _shape(a.get_block_ids()) == _shape(b.get_block_ids()), f"step {step}: admission blocks"
        hits += ha > 0
        junctions += ja > 0
        ra.num_computed_tokens = rb.num_computed_tokens = ha + n
        live[rid] = (ra, rb)

    for step in range(500):
        if rng.random() < 0.4:  # a new scheduler step (else this operation is in the same step as the last)
            oa, ob = ours.take_boundary_state_offloads(), theirs.take_boundary_state_offloads()
            assert {r: [(g, t) for g, _, t in v] for r, v in oa.items()} == \
                {r: [(g, t) for g, _, t in v] for r, v in ob.items()}, f"step {step}: boundary-state offers"
            offers += sum(len(v) for v in oa.values())
            ours.new_step_starts()
            theirs.new_step_starts()
        op = rng.random()
        if waiting and rng.random() < 0.5:
            rid = rng.choice(sorted(waiting))
            ra, rb = waiting.pop(rid)
            admit(rid, ra, rb, step)
        elif op < 0.3 or not live:
            if live and rng.random() < 0.25:  # preemption and readmission, the outputs now part of the prompt
                rid = rng.choice(sorted(live))
                ra, rb = live.pop(rid)
                ours.free(ra)
                theirs.free(rb)
                ra.num_computed_tokens = rb.num_computed_tokens = 0
                readmissions += ra.num_tokens > ra.num_prompt_tokens
            else:
                base = rng.choice(bases + [list(r[0].all_token_ids) for r in live.values()])
                toks = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(40) for _ in range(rng.randrange(0, 2 * bs))]
                if len(toks) < 2 or len(toks) >= MAX_LEN - 8:
                    continue
                rid = str(next_id)
                next_id += 1
                ra, rb = make_request(rid, toks, bs), make_request(rid, toks, bs)
            seen.append(list(ra.all_token_ids))
            admit(rid, ra, rb, step)
        elif op < 0.85:
            rid = rng.choice(sorted(live))
            ra, rb = live[rid]
            if ra.num_computed_tokens == ra.num_tokens:
                if ra.num_tokens >= MAX_LEN - 1:
                    continue
                t = rng.randrange(40)
                ra.append_output_token_ids([t])
                rb.append_output_token_ids([t])
            n = _chunk(rng, ra, bs, ckpt, align)
            if n == 0:
                continue
            theirs.remove_skipped_blocks(rid, rb.num_computed_tokens)  # as vLLM's scheduler does each step
            a = ours.allocate_slots(ra, n)
            b = theirs.allocate_slots(rb, n)
            assert a is not None and b is not None, f"step {step}"
            assert _shape(a.get_block_ids()) == _shape(b.get_block_ids()), f"step {step}: growth blocks"
            ra.num_computed_tokens += n
            rb.num_computed_tokens += n
            for g in mamba:
                assert [x == 0 for x in ours.get_block_ids(rid)[g]] == [x == 0 for x in theirs.get_block_ids(rid)[g]], \
                    f"step {step}: request {rid}'s Mamba row"
            assert ours.estimate_cached_tokens(ra) == theirs.estimate_cached_tokens(rb), f"step {step}: estimate"
            k = rng.randrange(0, ra.num_computed_tokens + 1)
            assert [len(x) for x in ours.get_block_ids_for_computed_tokens(rid, k)] == \
                [len(x) for x in theirs.get_block_ids_for_computed_tokens(rid, k)], f"step {step}: rows for {k} tokens"
        else:
            rid = rng.choice(sorted(live))
            ra, rb = live.pop(rid)
            ours.free(ra)
            theirs.free(rb)
        ev.compare(list(live.values()) + list(waiting.values()), f"step {step}")
    for ra, rb in live.values():
        ours.free(ra)
        theirs.free(rb)
    for g in mamba:
        ours_n, vllm_n = _cached(ours, theirs, g)
        assert ours_n == vllm_n, f"group {g}: {ours_n} cached states, vLLM {vllm_n}"
    probes = 0
    for toks in seen:
        for n in range(bs + 1, len(toks) + 1, bs):
            ra, rb = make_request(f"probe{probes}", toks[:n], bs), make_request(f"probe{probes}", toks[:n], bs)
            _, ha, ja, _, hb, jb = _lookup(ours, theirs, ra, rb)
            assert (ha, ja) == (hb, jb), f"probe of {n} tokens: {ha, ja} vs vLLM's {hb, jb}"
            probes += 1
    assert next_id > 50 and hits > 10 and probes > 50 and readmissions >= 2 and junctions > 0 and offers > 20
    assert ev.records > 200 and ev.listed > 200 and (retention != 0 or ev.empty > 0)  # the events ran


def test_mamba_align_refusals_name_the_reason():
    """What is not mapped is refused by name: two prefill checkpoint blocks, EAGLE, a Mamba block size other than the
    attention groups'. (KV events are mapped: the differential compares them.)"""
    specs = [_full(4), _align(4, num_prefill_checkpoint_blocks=2, prefill_checkpoint_alignment=1)]
    with pytest.raises(pv.Unsupported, match="num_prefill_checkpoint_blocks = 2"):
        _manager(pv.KVCacheManager, specs, 4, None)
    with pytest.raises(pv.Unsupported, match="use_eagle"):
        pv.KVCacheManager(make_config(64, [_full(4), _align(4)]), max_model_len=64, scheduler_block_size=4,
                          hash_block_size=4, use_eagle=True)
    with pytest.raises(pv.Unsupported, match="block size 8 != the attention block size 4"):
        pv.KVCacheManager(make_config(64, [_full(4), _align(8)]), max_model_len=64, scheduler_block_size=8,
                          hash_block_size=4)
