"""External KV from Python (issue 33; bindings_external.cpp): fills at admission, completion with failed blocks and
both policies, aborts (quiescent, orphan holds, late / duplicate / unknown signals), producer leases, save pins,
hand-off descriptors and import plans between two managers, on random prompts (seeded per test)."""
import numpy as np
import pytest

import pagedkv

BS = 4


def make(num_blocks=48, seed=0):
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=num_blocks, block_size=BS, hash_seed=seed))


def rand_prompt(rng, n):
    return rng.integers(1, 30000, size=n, dtype=np.int32)


def build(m, *seqs):
    m.build_batch_metadata(list(seqs), slot_mapping=np.empty(4096, np.int64), copies=np.empty((64, 2), np.int32))


def cache_prefix(m, seq, tokens):
    """Compute `tokens` locally in `seq` and free it: its full blocks stay cached."""
    assert m.try_admit(seq, tokens).admitted
    build(m, seq)
    m.free(seq)


def used(m):
    return m.stats().blocks_used


@pytest.mark.parametrize("trial", range(6))
def test_fill_ticket_covers_the_external_tokens_after_the_local_hit(trial):
    rng = np.random.default_rng(100 + trial)
    m = make()
    p = rand_prompt(rng, int(rng.integers(9, 40)))
    local = int(rng.integers(0, len(p) // BS)) * BS  # a block-aligned local hit
    if local:
        cache_prefix(m, 90, p[:local + 1])
    ext = int(rng.integers(1, len(p) + 4))
    base = used(m)
    r = m.try_admit_external(1, p, ext)
    assert r.admit.admitted and r.admit.num_cached_tokens == local
    n = min(ext, len(p) - 1 - local)  # the last prompt token is always computed here
    assert pagedkv.importable_tokens(local + ext, len(p), local) == n
    if n == 0:
        assert r.ticket is None and m.external_fill_of(1) == 0
        return
    t = r.ticket
    assert (t.seq, t.first_token, t.end_token, t.first_block) == (1, local, local + n, local // BS)
    assert t.num_groups == 1 and t.num_blocks == -(-(local + n) // BS) - local // BS
    assert t.blocks == m.block_ids(1).tolist()[t.first_block:t.first_block + t.num_blocks]
    assert len(t.generations) == len(t.blocks)
    assert all(m.is_current_block(b, g) for b, g in zip(t.blocks, t.generations))
    assert m.external_fill_of(1) == t.fill_id and used(m) > base
    # Waiting for the fill: a build refuses the sequence, naming it.
    with pytest.raises(pagedkv.InvalidArgumentError, match="1"):
        build(m, 1)
    # Not matchable while filling: another admission of the same prompt hits only the local prefix.
    assert m.query_admit(p).num_cached_tokens == local
    c = m.external_counters()
    assert (c.fills_started, c.fills_in_flight, c.fill_blocks) == (1, 1, t.num_blocks)


@pytest.mark.parametrize("trial", range(6))
def test_completion_registers_only_the_valid_prefix(trial):
    rng = np.random.default_rng(200 + trial)
    m = make()
    p = rand_prompt(rng, int(rng.integers(13, 48)))
    t = m.try_admit_external(1, p, len(p)).ticket
    valid = int(rng.integers(0, t.num_blocks + 1))
    done = m.complete_external_fill(t.fill_id, valid)
    assert done.signal == pagedkv.ExternalSignal.APPLIED and done.seq == 1 and not done.sequence_failed
    expect = t.end_token if valid == t.num_blocks else t.first_token + valid * BS
    assert done.num_computed_tokens == expect and done.num_valid_blocks == valid
    assert m.external_fill_of(1) == 0
    # Exactly the valid full blocks are hit-able now (the sequence still holds them).
    assert m.query_admit(p).num_cached_tokens == min(expect // BS * BS, (len(p) - 1) // BS * BS)
    # The recompute policy kept the sequence: the rest is built locally, then the whole prompt is cached.
    build(m, 1)
    m.free(1)
    assert m.query_admit(p).num_cached_tokens == (len(p) - 1) // BS * BS
    assert used(m) == 0
    c = m.external_counters()
    assert c.fills_completed + c.fills_partial == 1 and c.fill_blocks_valid == valid and c.fills_in_flight == 0


def test_failed_blocks_with_the_fail_policy_free_the_sequence():
    rng = np.random.default_rng(3)
    m = make()
    p = rand_prompt(rng, 30)
    t = m.try_admit_external(1, p, 29).ticket
    bad = sorted(rng.choice(t.num_blocks, size=2, replace=False).tolist())
    done = m.complete_external_fill(t.fill_id, failed_blocks=bad[::-1], policy=pagedkv.ExternalFailurePolicy.FAIL)
    assert done.sequence_failed and done.num_valid_blocks == bad[0]
    assert 1 not in m and used(m) == 0
    assert m.query_admit(p).num_cached_tokens == 0  # nothing of a failed fill is ever served
    assert m.external_counters().fills_failed == 1


def test_bad_completion_raises_and_changes_nothing():
    m = make()
    p = np.arange(1, 21, dtype=np.int32)
    t = m.try_admit_external(1, p, 19).ticket
    before = (m.stats().as_dict(), m.external_fill_of(1))
    with pytest.raises(pagedkv.InvalidArgumentError, match=f"has {t.num_blocks} blocks per group"):
        m.complete_external_fill(t.fill_id, t.num_blocks + 1)
    with pytest.raises(pagedkv.InvalidArgumentError, match="failed block 99"):
        m.complete_external_fill(t.fill_id, failed_blocks=[99])
    with pytest.raises(pagedkv.InvalidArgumentError, match="not both"):
        m.complete_external_fill(t.fill_id, 1, failed_blocks=[1])
    assert (m.stats().as_dict(), m.external_fill_of(1)) == before
    assert m.complete_external_fill(t.fill_id).signal == pagedkv.ExternalSignal.APPLIED


def test_aborts_quiescent_orphan_late_duplicate_unknown_and_expiry():
    rng = np.random.default_rng(4)
    m = make()
    # Quiescent: the blocks return at once.
    t1 = m.try_admit_external(1, rand_prompt(rng, 21), 20).ticket
    m.abort_sequence(1, True)
    assert used(m) == 0 and m.external_counters().blocks_held == 0
    assert m.complete_external_fill(t1.fill_id).signal == pagedkv.ExternalSignal.LATE
    # Not quiescent: an orphan hold keeps the blocks out of every table and the pool until the late signal.
    t2 = m.try_admit_external(2, rand_prompt(rng, 21), 20).ticket
    m.abort_sequence(2, False)
    c = m.external_counters()
    assert 2 not in m and c.orphan_holds == 1 and c.blocks_held == t2.num_blocks and used(m) == t2.num_blocks
    assert m.complete_external_fill(t2.fill_id, 0).signal == pagedkv.ExternalSignal.LATE
    assert used(m) == 0 and m.external_counters().orphans_released == 1
    assert m.complete_external_fill(t2.fill_id).signal == pagedkv.ExternalSignal.LATE
    assert m.complete_external_fill(10**9).signal == pagedkv.ExternalSignal.UNKNOWN
    # A duplicate: the fill ended by its own signal.
    t3 = m.try_admit_external(3, rand_prompt(rng, 21), 20).ticket
    assert m.complete_external_fill(t3.fill_id).signal == pagedkv.ExternalSignal.APPLIED
    assert m.complete_external_fill(t3.fill_id).signal == pagedkv.ExternalSignal.DUPLICATE
    m.free(3)
    # An orphan hold whose late signal never comes ends at the orphan timeout after the last reap.
    m.set_orphan_timeout(5.0)
    m.reap_external(100.0)
    m.try_admit_external(4, rand_prompt(rng, 21), 20)
    m.free(4)  # free of a sequence whose fill is in flight: a non-quiescent abort
    assert used(m) > 0
    assert m.reap_external(104.0) == 0 and used(m) > 0
    assert m.reap_external(105.0) == 1 and used(m) == 0
    c = m.external_counters()
    assert (c.late_signals, c.duplicate_signals, c.unknown_signals, c.orphans_expired) == (3, 1, 1, 1)
    assert c.fills_aborted == 3 and c.holds_active == 0 and c.fills_in_flight == 0
    with pytest.raises(pagedkv.InvalidArgumentError, match="seconds = -1"):
        m.set_orphan_timeout(-1.0)


def test_lease_keeps_blocks_until_release_and_expires_by_reap():
    rng = np.random.default_rng(5)
    m = make(num_blocks=12)
    p = rand_prompt(rng, 17)
    assert m.try_admit(1, p).admitted
    build(m, 1)
    fp = m.layout_fingerprint("nhd", "bf16", 8, 128)
    d = m.finish_with_lease(1, fp, 50.0)
    assert 1 not in m and d.hold_id and d.num_tokens == 17 and d.num_blocks == 5 and d.num_groups == 1
    assert len(d.identities) == 17 // BS and all(len(i) == 32 for i in d.identities)
    assert m.external_counters().blocks_held == 5
    # The pool's other 6 usable blocks serve others; the leased blocks are never evicted for them.
    assert m.try_admit(2, rand_prompt(rng, 6 * BS)).admitted
    assert m.try_admit(3, rand_prompt(rng, BS)).status == pagedkv.AdmitStatus.NO_CAPACITY
    assert all(m.is_current_block(b, g) for b, g in zip(d.blocks, d.generations))
    assert m.extend_lease(d.hold_id, 60.0) == pagedkv.ExternalSignal.APPLIED
    assert m.reap_external(55.0) == 0
    assert m.release_lease(d.hold_id) == pagedkv.ExternalSignal.APPLIED
    assert m.release_lease(d.hold_id) == pagedkv.ExternalSignal.DUPLICATE
    assert not m.is_current_block(d.blocks[0], d.generations[0])  # a stale reference is refused, and counted
    assert m.external_counters().stale_generations >= 1
    assert m.try_admit(3, rand_prompt(rng, BS)).admitted
    m.free(2)
    m.free(3)
    assert m.query_admit(p).num_cached_tokens == 16  # released, the blocks are cached as a freed sequence's
    assert m.try_admit(4, p).admitted
    build(m, 4)
    d2 = m.finish_with_lease(4, fp, 70.0)
    assert m.reap_external(70.0) == 1 and m.release_lease(d2.hold_id) == pagedkv.ExternalSignal.LATE
    c = m.external_counters()
    assert (c.leases_started, c.leases_released, c.leases_expired, c.leases_extended) == (2, 1, 1, 1)
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_size: 4 vs 8"):
        bad = m.layout_fingerprint("nhd", "bf16", 8, 128)
        bad.block_size = 8
        m.try_admit(5, p)
        build(m, 5)
        m.finish_with_lease(5, bad, None)
    assert 5 in m  # refused before anything changed


def test_save_pin_holds_blocks_through_free():
    rng = np.random.default_rng(6)
    m = make(num_blocks=9)
    p = rand_prompt(rng, 16)
    assert m.try_admit(1, p).admitted
    build(m, 1)
    pin = m.pin_for_save(1)
    m.free(1)
    assert used(m) == 4 and m.external_counters().blocks_held == 4
    assert m.try_admit(2, rand_prompt(rng, 5 * BS)).status == pagedkv.AdmitStatus.NO_CAPACITY  # 4 usable left
    assert m.end_save(pin) == pagedkv.ExternalSignal.APPLIED and used(m) == 0
    assert m.end_save(pin) == pagedkv.ExternalSignal.DUPLICATE
    assert m.try_admit(2, rand_prompt(rng, 5 * BS)).admitted


@pytest.mark.parametrize("trial", range(5))
def test_import_plan_transfers_only_what_the_consumer_lacks(trial):
    rng = np.random.default_rng(700 + trial)
    prod, cons = make(seed=7), make(seed=7)
    p = rand_prompt(rng, int(rng.integers(10, 50)))
    assert prod.try_admit(1, p).admitted
    build(prod, 1)
    fp = prod.layout_fingerprint("nhd", "bf16", 2, 64)
    ours = cons.layout_fingerprint("nhd", "bf16", 2, 64)
    assert fp.first_mismatch(ours) is None
    d = prod.finish_with_lease(1, fp, None)
    local = int(rng.integers(0, (len(p) - 1) // BS + 1)) * BS
    if local:
        cache_prefix(cons, 90, p[:local + 1])
    # The descriptor as a consumer rebuilds it from the wire.
    wire = pagedkv.HandoffDescriptor()
    wire.hold_id, wire.num_tokens, wire.num_groups = d.hold_id, d.num_tokens, d.num_groups
    wire.blocks, wire.generations, wire.identities, wire.layout = d.blocks, d.generations, d.identities, d.layout
    wire.tail_tokens = d.tail_tokens
    plan = cons.plan_import(wire, ours, p)
    n = pagedkv.importable_tokens(len(p), len(p), local)
    assert (plan.first_token, plan.end_token, plan.skipped_blocks) == (local, local + n, local // BS)
    assert plan.remote_blocks == d.blocks[plan.first_block:plan.first_block + plan.num_blocks]
    assert plan.remote_generations == d.generations[plan.first_block:plan.first_block + plan.num_blocks]
    assert cons.external_counters().blocks_transferred == 0  # counted at admission, never at plan time
    r = cons.try_admit_external(2, p, plan)
    if plan.num_blocks == 0:
        assert r.ticket is None
    else:
        assert r.ticket.first_block == plan.first_block and r.ticket.num_blocks == plan.num_blocks
        assert all(prod.is_current_block(b, g) for b, g in zip(plan.remote_blocks, plan.remote_generations))
        cons.complete_external_fill(r.ticket.fill_id)
    assert prod.release_lease(d.hold_id) == pagedkv.ExternalSignal.APPLIED
    c = cons.external_counters()
    assert (c.blocks_transferred, c.blocks_skipped) == (plan.num_blocks, plan.skipped_blocks)


def test_import_refuses_mismatched_layouts_and_bad_descriptors():
    rng = np.random.default_rng(8)
    prod, cons = make(seed=1), make(seed=1)
    p = rand_prompt(rng, 20)
    prod.try_admit(1, p)
    build(prod, 1)
    d = prod.finish_with_lease(1, prod.layout_fingerprint("nhd", "bf16", 2, 64), None)
    with pytest.raises(pagedkv.InvalidArgumentError, match="dtype: fp8 vs bf16"):
        cons.plan_import(d, cons.layout_fingerprint("nhd", "fp8", 2, 64), p)
    other = make(seed=2)
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash_seed: 2 vs 1"):
        other.plan_import(d, other.layout_fingerprint("nhd", "bf16", 2, 64), p)
    short = pagedkv.HandoffDescriptor()
    short.num_tokens, short.num_groups, short.layout = d.num_tokens, 1, d.layout
    short.blocks, short.generations, short.identities = d.blocks[:-1], d.generations[:-1], d.identities
    with pytest.raises(pagedkv.InvalidArgumentError, match=r"expected ceil\(20 / 4\) = 5 blocks"):
        cons.plan_import(short, cons.layout_fingerprint("nhd", "bf16", 2, 64), p)
    with pytest.raises(pagedkv.InvalidArgumentError, match="identity differs"):
        cons.plan_import(d, cons.layout_fingerprint("nhd", "bf16", 2, 64), rand_prompt(rng, 20))
    with pytest.raises(pagedkv.InvalidArgumentError, match="31 bytes, expected 32"):
        short.identities = [b"x" * 31]
    assert cons.external_counters().blocks_transferred == 0


def test_block_refcount_counts_tables_and_holds():
    m = make(num_blocks=8)
    p = np.arange(1, 10, dtype=np.int32)
    m.try_admit(1, p)
    build(m, 1)
    ids = m.block_ids(1).tolist()
    assert [m.block_refcount(b) for b in ids] == [1, 1, 1]
    m.fork(1, 2)
    assert [m.block_refcount(b) for b in ids] == [2, 2, 2]
    pin = m.pin_for_save(1)  # the two full blocks
    assert [m.block_refcount(b) for b in ids] == [3, 3, 2]
    m.free(1)
    m.free(2)
    assert [m.block_refcount(b) for b in ids] == [1, 1, 0]
    m.end_save(pin)
    assert [m.block_refcount(b) for b in ids] == [0, 0, 0]
    with pytest.raises(pagedkv.BlockOutOfRangeError, match="block 8 >= num_blocks = 8"):
        m.block_refcount(8)


@pytest.mark.parametrize("trial", range(4))
def test_check_claim_names_the_failing_entry(trial):
    rng = np.random.default_rng(300 + trial)
    prod = make()
    p = rand_prompt(rng, int(rng.integers(9, 40)))
    prod.try_admit(1, p)
    build(prod, 1)
    d = prod.finish_with_lease(1, prod.layout_fingerprint("nhd", "bf16", 2, 64), None)
    order = rng.permutation(len(d.blocks))
    blocks = [d.blocks[i] for i in order]
    gens = [d.generations[i] for i in order]
    c = prod.check_claim(d.hold_id, blocks, gens)
    assert c.ok and c.status == pagedkv.ClaimStatus.OK and c.entry == len(blocks)
    bad = int(rng.integers(0, len(blocks)))
    stale = list(gens)
    stale[bad] += 1
    c = prod.check_claim(d.hold_id, blocks, stale)
    assert (c.status, c.entry, c.current_generation) == (pagedkv.ClaimStatus.STALE_GENERATION, bad, gens[bad])
    other = list(blocks)
    other[bad] = next(b for b in range(1, 48) if b not in d.blocks)
    c = prod.check_claim(d.hold_id, other, gens)
    assert (c.status, c.entry) == (pagedkv.ClaimStatus.NOT_IN_HOLD, bad)
    assert prod.check_claim(d.hold_id + 7, blocks, gens).status == pagedkv.ClaimStatus.UNKNOWN_HOLD
    with pytest.raises(pagedkv.InvalidArgumentError, match="blocks but"):
        prod.check_claim(d.hold_id, blocks, gens[:-1])
    prod.release_lease(d.hold_id)
    assert prod.check_claim(d.hold_id, blocks, gens).status == pagedkv.ClaimStatus.UNKNOWN_HOLD


def test_admission_with_a_stale_plan_is_refused():
    rng = np.random.default_rng(11)
    prod, cons = make(), make()
    p = rand_prompt(rng, 21)
    prod.try_admit(1, p)
    build(prod, 1)
    fp = prod.layout_fingerprint("nhd", "bf16", 2, 64)
    plan = cons.plan_import(prod.finish_with_lease(1, fp, None), fp, p)
    cache_prefix(cons, 50, p[:9])  # two blocks registered after the plan
    with pytest.raises(pagedkv.InvalidArgumentError, match=r"0 tokens then, 8 now"):
        cons.try_admit_external(2, p, plan)
    assert not cons.contains(2) and cons.external_counters().blocks_transferred == 0


@pytest.mark.parametrize("trial", range(4))
def test_evict_cached_block_leaves_the_index_now(trial):
    rng = np.random.default_rng(400 + trial)
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=48, block_size=BS, enable_events=True))
    p = rand_prompt(rng, int(rng.integers(13, 40)))
    m.try_admit(1, p)
    build(m, 1)
    ids = m.block_ids(1).tolist()
    live = bool(trial % 2)
    if not live:
        m.free(1)
    m.drain_events()
    victim = int(rng.integers(0, len(p) // BS))
    assert m.evict_cached_block(ids[victim])
    assert m.block_hash(ids[victim]) is None
    assert m.lookup(p) == victim * BS
    ev = m.drain_events()
    assert [e.type for e in ev] == [pagedkv.KVEventType.BLOCK_REMOVED]
    assert not m.evict_cached_block(ids[victim])
    if live:
        assert m.block_ids(1).tolist()[victim] == ids[victim]
    with pytest.raises(pagedkv.BlockOutOfRangeError):
        m.evict_cached_block(48)


@pytest.mark.parametrize("trial", range(6))
def test_window_group_fill_takes_only_the_blocks_its_window_reads(trial):
    """A sliding-window group's blocks wholly before the window of the fill's end are not taken (null in the table
    and the ticket, as vLLM pads an external load's skipped blocks); query_admit_external counts what the admission
    takes, explain_admit_external names the fill."""
    rng = np.random.default_rng(700 + trial)
    window = int(rng.integers(1, 3 * BS))
    groups = [pagedkv.KVCacheGroupSpec(),
              pagedkv.KVCacheGroupSpec(kind=pagedkv.AttentionKind.SLIDING_WINDOW, window_tokens=window)]
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=96, block_size=BS, groups=groups))
    p = rand_prompt(rng, int(rng.integers(12, 60)))
    local = int(rng.integers(0, 3)) * BS
    if local:  # a local hit: the prefix computed by another sequence (both groups' blocks registered)
        lim = pagedkv.BatchMetadataLimits(max_batch=1, max_tokens_per_step=256, max_blocks_per_seq=64)
        assert m.try_admit(90, p[:local + 1]).admitted
        m.build_batch_metadata([90], groups=[pagedkv.BatchMetadataBuffers(lim) for _ in range(2)])
        m.free(90)
    ext = int(rng.integers(1, len(p) + 4))
    x = m.explain_admit_external(p, ext)
    q = m.query_admit_external(p, ext)
    base = used(m)
    r = m.try_admit_external(1, p, ext)
    assert r.admit.admitted and r.admit.num_cached_tokens == local == x.first_external_token == x.local.hit_tokens
    n = min(ext, len(p) - 1 - local)
    assert (x.external_tokens, x.clamped_tokens, x.computed_tokens) == (n, ext - n, local + n)
    end = local + n
    first_kept = max(end - window + 1, 0) // BS  # the window of the query at the fill's end
    skipped = max(first_kept - local // BS, 0)
    full_blocks = -(-len(p) // BS)
    assert q.fits and q.num_blocks == r.admit.num_new_blocks == 2 * (full_blocks - local // BS) - skipped
    if not local:
        assert used(m) - base == q.num_blocks  # nothing else taken
    table = m.block_ids(1, 1).tolist()
    assert all(b == 0 for b in table[local // BS:first_kept]) and all(table[max(first_kept, local // BS):])
    if r.ticket is not None:
        assert x.external_blocks == r.ticket.num_blocks and x.first_external_block == r.ticket.first_block
        assert r.ticket.group_blocks(1) == table[r.ticket.first_block:r.ticket.first_block + r.ticket.num_blocks]
    m.abort_sequence(1, True)
    assert used(m) == base
    # The same admission of the prompt prepared once (hashed by prepare_prompt; the connector's path).
    pp = m.prepare_prompt(p)
    q2 = m.query_admit_external(pp, ext)
    assert (q2.fits, q2.num_blocks, q2.num_cached_tokens) == (q.fits, q.num_blocks, q.num_cached_tokens)
    r2 = m.try_admit_external(2, pp, ext)
    assert (r2.admit.num_cached_tokens, r2.admit.num_new_blocks) == (r.admit.num_cached_tokens, r.admit.num_new_blocks)
    assert (r2.ticket is None) == (r.ticket is None)
    if r.ticket is not None:
        assert (r2.ticket.first_token, r2.ticket.end_token, r2.ticket.first_block, r2.ticket.num_blocks) == (
            r.ticket.first_token, r.ticket.end_token, r.ticket.first_block, r.ticket.num_blocks)
    assert [b == 0 for b in m.block_ids(2, 1).tolist()] == [b == 0 for b in table]
    with pytest.raises(pagedkv.DuplicateSequenceError, match="try_admit_external: sequence 2"):
        m.try_admit_external(2, pp, ext)
    m.abort_sequence(2, True)
    assert used(m) == base
