"""KV-cache groups from Python: CacheConfig.groups, the per-group accessors and the per-group build writing one set
of numpy buffers per group (include/pagedkv/kv_cache_manager.hpp, docs/groups.md)."""
import numpy as np
import pytest

import pagedkv
from pagedkv import AttentionKind, KVCacheGroupSpec
from conftest import prompt, state

BS = 4
FULL = KVCacheGroupSpec()
SLIDING = KVCacheGroupSpec(AttentionKind.SLIDING_WINDOW, 10)  # W = 10: not a multiple of the block size
CHUNKED = KVCacheGroupSpec(AttentionKind.CHUNKED_LOCAL, 8)
LIMITS = pagedkv.BatchMetadataLimits(max_batch=8, max_tokens_per_step=256, max_blocks_per_seq=64, max_copies=16)


def make(groups, num_blocks=512, eviction="lru", **kw):
    cfg = pagedkv.CacheConfig(num_blocks=num_blocks, block_size=BS, groups=groups, **kw)
    return pagedkv.KVCacheManager(cfg, eviction=eviction)


def poisoned_buffers(n):
    bufs = [pagedkv.BatchMetadataBuffers(LIMITS) for _ in range(n)]
    for b in bufs:
        for a in b.kwargs().values():
            a.fill(-7)
    return bufs


def rows(buf, sz, b):
    """Sequence b's page table in `buf` (indices), checked equal to its block_tables row."""
    lo, hi = buf.indptr[b], buf.indptr[b + 1]
    row = buf.indices[lo:hi].copy()
    assert buf.block_tables[b, : hi - lo].tolist() == row.tolist()
    return row


def expected_hit_blocks(m, hashes, prompt_len):
    """Brute force of the prefix-hit fixed point: the largest k (at most (prompt_len - 1) // BS blocks) such that
    every group holds every block its first computed query (position k * BS) sees."""
    for k in range(min(len(hashes), (prompt_len - 1) // BS), 0, -1):
        if all(m.cached_block(hashes[i], g) is not None
               for g in range(m.num_groups)
               for i in range(m.window(g).first_visible(k * BS) // BS, k)):
            return k
    return 0


def test_config_groups_and_accessors():
    cfg = pagedkv.CacheConfig(num_blocks=64, block_size=BS, groups=[KVCacheGroupSpec(num_layers=3), SLIDING],
                              page_size_bytes=1000)
    assert cfg.groups == [KVCacheGroupSpec(AttentionKind.FULL, 0, 3), SLIDING] and cfg.page_size_bytes == 1000
    cfg.groups[0].num_layers = 9  # a copy: the config keeps its groups
    assert cfg.groups[0].num_layers == 3
    m = pagedkv.KVCacheManager(cfg)
    assert m.num_groups == 2 and m.bytes_per_block == 3000
    assert m.window(0) == pagedkv.AttentionWindow() and not m.window(0).enabled
    assert m.window(1) == pagedkv.AttentionWindow(sliding_window_tokens=10) == SLIDING.window()
    assert m.window(1).first_visible(25) == 16 and m.window(1).first_needed_token(25, 3) == 13
    assert m.window_block_bound(0, 1) is None
    assert m.window_block_bound(1, 1) == (10 - 1 + 1 + BS - 1) // BS + 1
    assert [m.held_blocks(g) for g in (0, 1)] == [0, 0] and m.peak_used_blocks() == 0
    assert pagedkv.KVCacheManager(pagedkv.CacheConfig(64, BS)).num_groups == 1
    with pytest.raises(pagedkv.InvalidArgumentError, match="group 2 >= num_groups = 2"):
        m.window(2)
    for call in (m.held_blocks, m.peak_held_blocks, m.held_bytes, m.num_cached_blocks):
        with pytest.raises(pagedkv.InvalidArgumentError):
            call(2)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.window_block_bound(2, 1)
    with pytest.raises(pagedkv.BlockOutOfRangeError, match=r"group_of: block 0 outside \[1, 64\)"):
        m.group_of(0)
    with pytest.raises(pagedkv.BlockOutOfRangeError):
        m.group_of(64)
    m.try_admit(1, prompt(9))
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.block_ids(1, 2)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.num_null_blocks(1, 2)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.pending_slots(1, 2)
    assert {m.group_of(b) for b in m.block_ids(1, 0)} == {0} and {m.group_of(b) for b in m.block_ids(1, 1)} == {1}
    assert m.held_bytes(1) == m.held_blocks(1) * 3000 == 3 * 3000


@pytest.mark.parametrize("groups, match", [
    ([KVCacheGroupSpec(AttentionKind.FULL, 5)], r"groups\[0\] \(full\).window_tokens = 5"),
    ([FULL, KVCacheGroupSpec(AttentionKind.SLIDING_WINDOW, 0)], r"groups\[1\] \(sliding_window\).window_tokens = 0"),
    ([FULL, KVCacheGroupSpec(num_layers=0)], r"groups\[1\] \(full\).num_layers = 0"),
    ([FULL] * 65, "has 65 groups"),
])
def test_bad_groups_are_refused(groups, match):
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        make(groups)


@pytest.mark.parametrize("groups", [[FULL, SLIDING], [SLIDING, FULL, CHUNKED]], ids=["gemma", "three"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_windows_hits_and_footprint(groups, seed):
    """Random prompts sharing prefixes, chunked prefill and decode, built per group into numpy buffers: each build's
    page table of a windowed group is the null block exactly before the window of its first query, the tables
    release exactly the blocks before the window of the next query, admissions hit the fixed point, and
    held_blocks counts each group's distinct blocks."""
    rng = np.random.default_rng(seed)
    m = make(groups, enable_events=True)
    G = m.num_groups
    windowed = [g for g in range(G) if m.window(g).enabled]
    bufs = poisoned_buffers(G)
    bases = [rng.integers(0, 50_000, size=n, dtype=np.int32) for n in (23, 40, 57)]
    live, next_id, chunk = {}, 0, 8
    hits = 0
    for step in range(60):
        # Admissions: a shared base prefix (possibly cut) plus a random suffix.
        while len(live) < 6 and rng.random() < 0.6:
            base = bases[rng.integers(len(bases))]
            toks = np.concatenate([base[: rng.integers(1, len(base) + 1)],
                                   rng.integers(0, 50_000, size=rng.integers(0, 12), dtype=np.int32)])
            p = m.prepare_prompt(toks)
            want = expected_hit_blocks(m, p.hashes, len(toks))
            assert m.lookup(toks) == want * BS
            r = m.try_admit(next_id, p)
            assert r.admitted and r.num_cached_tokens == want * BS
            hits += want
            for g in windowed:  # a hit takes only the blocks its first computed query sees
                assert m.num_null_blocks(next_id, g) == m.window(g).first_visible(want * BS) // BS
            live[next_id] = len(toks)
            next_id += 1
        # Decode: one token for every sequence whose prefill is done.
        decode = [s for s in live if not m.pending_slots(s)]
        if decode:
            st = m.append_tokens(np.array(decode, np.int64), rng.integers(0, 50_000, len(decode), dtype=np.int32))
            assert st.tolist() == [0] * len(decode)
        batch = list(live)
        sched = [min(len(m.pending_slots(s)), chunk) for s in batch]
        before = {s: [m.block_ids(s, g).tolist() for g in range(G)] for s in batch}
        seq_len = [m.num_built(s) + q for s, q in zip(batch, sched)]
        dedup = m.stats().dedup_blocks
        sizes = m.build_batch_metadata(np.array(batch, np.int64), groups=[b.kwargs() for b in bufs],
                                       num_scheduled_tokens=np.array(sched, np.uint32))
        assert len(sizes) == G
        for g in range(G):
            sz, buf, w = sizes[g], bufs[g], m.window(g)
            assert sz.batch_size == len(batch) and sz.num_new_tokens == sum(sched) and sz.num_copies == 0
            assert buf.seq_lens[: len(batch)].tolist() == seq_len
            assert buf.qo_indptr[: len(batch) + 1].tolist() == np.concatenate([[0], np.cumsum(sched)]).tolist()
            for b, s in enumerate(batch):
                row = rows(buf, sz, b)
                assert len(row) == -(-seq_len[b] // BS)
                lead = w.first_needed_token(seq_len[b], sched[b]) // BS  # pages this step's queries never read
                assert (row[:lead] == 0).all() and (row[lead:] != 0).all(), (g, s, row)
                after = m.block_ids(s, g)
                kept = m.window(g).first_visible(m.num_built(s)) // BS  # the release rule, after the build
                assert m.num_null_blocks(s, g) == kept
                assert (after[:kept] == 0).all() and (after[kept:] != 0).all()
                assert row[kept:].tolist() == after[kept: len(row)].tolist()
                if not w.enabled:
                    assert kept == 0
                if m.stats().dedup_blocks == dedup:  # no dedup this step: the row is the table as it was
                    assert row[lead:].tolist() == before[s][g][lead: len(row)]
        # held_blocks: each group's distinct blocks over live tables (no copies, no swap here).
        for g in range(G):
            held = {b for s in live for b in m.block_ids(s, g).tolist() if b != 0}
            assert m.held_blocks(g) == len(held)
            assert m.peak_held_blocks(g) >= m.held_blocks(g)
            for s in live:  # a decoding sequence (one token per build) within the group's footprint bound
                if m.window_block_bound(g, 1) is not None and not m.pending_slots(s):
                    assert np.count_nonzero(m.block_ids(s, g)) <= m.window_block_bound(g, 1)
        assert m.peak_used_blocks() >= sum(m.held_blocks(g) for g in range(G)) == m.stats().blocks_used
        # Finish some sequences.
        for s in [s for s in live if m.num_tokens(s) > 40 and rng.random() < 0.3]:
            m.free(s)
            del live[s]
    assert hits > 0  # the shared prefixes were hit
    full = [g for g in range(G) if not m.window(g).enabled][0]
    longest = max(live, key=m.num_tokens)
    for g in windowed:  # the window groups hold less than the full group
        assert np.count_nonzero(m.block_ids(longest, g)) < np.count_nonzero(m.block_ids(longest, full))
        assert m.held_blocks(g) < m.held_blocks(full)
    events = m.drain_events()
    assert {e.group for e in events if e.type == pagedkv.KVEventType.BLOCK_STORED} == set(range(G))


def test_one_group_build_refused_on_several_groups():
    m = make([FULL, SLIDING])
    m.try_admit(1, prompt(30))
    before = state(m, [1]), m.pending_slots(1, 1), m.num_built(1)
    bufs = poisoned_buffers(2)
    with pytest.raises(pagedkv.BadShapeError, match="the manager has 2 KV-cache groups") as e:
        m.build_batch_metadata([1], **bufs[0].kwargs())
    assert isinstance(e.value, ValueError) and e.value.code == pagedkv.Errc.BAD_SHAPE
    with pytest.raises(pagedkv.BadShapeError, match="1 buffer sets and 1 sizes for 2 groups"):
        m.build_batch_metadata([1], groups=[bufs[0].kwargs()])
    with pytest.raises(TypeError, match=r"groups\[1\]\[\"slot_mapping\"\]: expected .* int64.*got ndarray of dtype int32"):
        m.build_batch_metadata([1], groups=[bufs[0].kwargs(), dict(bufs[1].kwargs(), slot_mapping=bufs[1].indptr)])
    with pytest.raises(TypeError, match=r"groups\[0\]: unknown buffer 'slot_map'"):
        m.build_batch_metadata([1], groups=[{"slot_map": bufs[0].slot_mapping}, bufs[1].kwargs()])
    ro = bufs[1].indices.copy()
    ro.setflags(write=False)
    with pytest.raises(TypeError, match=r"groups\[1\]\[\"indices\"\]"):
        m.build_batch_metadata([1], groups=[bufs[0].kwargs(), dict(bufs[1].kwargs(), indices=ro)])
    with pytest.raises(pagedkv.BadShapeError):  # group 1's slot mapping too small: nothing written in group 0
        m.build_batch_metadata([1], groups=[bufs[0].kwargs(), dict(bufs[1].kwargs(), slot_mapping=np.empty(3, np.int64))])
    assert (state(m, [1]), m.pending_slots(1, 1), m.num_built(1)) == before
    for b in bufs:
        assert all((a == -7).all() for a in b.kwargs().values())
    # BatchMetadataBuffers objects work as well as their kwargs() dicts.
    table = m.block_ids(1, 1).tolist()
    sizes = m.build_batch_metadata([1], groups=bufs)
    assert [s.num_new_tokens for s in sizes] == [30, 30] and m.num_built(1) == 30
    # The prefill's first query (position 0) sees block 0: its page table is whole; then the blocks wholly before
    # the next query's window (position 30 sees 21..30) are released.
    assert bufs[1].indices[: sizes[1].num_indices].tolist() == table and 0 not in table
    assert m.num_null_blocks(1, 1) == (30 - 10 + 1) // BS == 5
    assert m.block_ids(1, 1).tolist() == [0] * 5 + table[5:]


def run_workload(m, build, seed=7):
    """A random admit / append / build / free workload on a one-group manager; returns everything it observed."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1000, size=40, dtype=np.int32)
    buf = pagedkv.BatchMetadataBuffers(LIMITS)
    log = []
    live = []
    for step in range(40):
        if len(live) < 5:
            toks = np.concatenate([base[: rng.integers(1, 41)], rng.integers(0, 1000, rng.integers(0, 9), np.int32)])
            r = m.try_admit(step, toks)
            log.append(("admit", r.status, r.num_cached_tokens, r.num_new_blocks))
            if r:
                live.append(step)
        dec = [s for s in live if not m.pending_slots(s)]
        if dec:
            log.append(("append", m.append_tokens(dec, rng.integers(0, 1000, len(dec), np.int32)).tolist()))
        ready = [s for s in live if m.pending_slots(s)]
        for a in buf.kwargs().values():
            a.fill(-3)
        sz = build(m, ready, buf)
        log.append(("build", sz.num_indices, sz.num_new_tokens, sz.num_copies,
                    *(a.tolist() for a in buf.kwargs().values())))
        log.append(("tables", [m.block_ids(s).tolist() for s in live], m.stats().as_dict()))
        if live and rng.random() < 0.4:
            s = live.pop(int(rng.integers(len(live))))
            m.free(s)
    log.append([(e.type, e.hash, e.group) for e in m.drain_events()])
    return log


def test_explicit_full_group_is_the_default():
    one = lambda m, ready, buf: m.build_batch_metadata(ready, **buf.kwargs())  # noqa: E731
    per_group = lambda m, ready, buf: m.build_batch_metadata(ready, groups=[buf.kwargs()])[0]  # noqa: E731
    default = run_workload(pagedkv.KVCacheManager(pagedkv.CacheConfig(24, BS, enable_events=True)), one)
    explicit = pagedkv.KVCacheManager(pagedkv.CacheConfig(24, BS, enable_events=True, groups=[FULL]))
    assert explicit.num_groups == 1
    assert run_workload(explicit, one) == default
    assert run_workload(pagedkv.KVCacheManager(pagedkv.CacheConfig(24, BS, enable_events=True)), per_group) == default
    assert any(x[0] == "admit" and x[2] > 0 for x in default[:-1])  # the workload hit the cache
    assert [x for x in default if x[0] == "tables"][-1][2]["evictions"] > 0  # and filled it


def test_append_result_counts_blocks_over_groups():
    m = make([FULL, SLIDING])
    m.try_admit(1, prompt(4))
    m.build_batch_metadata([1], groups=poisoned_buffers(2))
    r = m.try_append(1, [5])  # a new block in each group
    assert r.ok and r.num_new_blocks == 2 and r.copy is None
    assert m.try_append(1, [6]).num_new_blocks == 0


def test_sparse_window_retention_keeps_the_boundary_tails():
    """CacheConfig.window_retention_interval (vLLM's prefix_cache_retention_interval): with 0 a sliding-window group
    keeps only the blocks before each sequence's replay boundary and its shared-prefix junction, so a sibling that
    shares only a prefix misses unless an earlier request pinned the junction there (vLLM's worked example,
    docs/vllm-swa-retention.md section 3, at block size 4 and window 8: need = 2 blocks)."""
    win = KVCacheGroupSpec(AttentionKind.SLIDING_WINDOW, 8)
    a = np.arange(100, 125, dtype=np.int32)  # P = 25: replay tail ends at floor4(24) = 24 -> blocks 4, 5
    shared = a[:16]
    b = np.concatenate([shared, np.arange(500, 505, dtype=np.int32)])
    c = np.concatenate([shared, np.arange(700, 705, dtype=np.int32)])
    bufs = poisoned_buffers(2)

    def run(m, seq, toks, **kw):
        assert m.try_admit(seq, toks, **kw).status == pagedkv.AdmitStatus.ADMITTED
        m.build_batch_metadata([seq], groups=[x.kwargs() for x in bufs])
        m.free(seq)

    for junction, c_hit in ((16, 16), (0, 0)):
        m = make([FULL, win], window_retention_interval=0)
        assert m.config.window_retention_interval == 0
        run(m, 1, a)
        assert m.query_admit(b).num_cached_tokens == 0  # full attention has 16, the window's blocks 2-3 are gone
        run(m, 2, b, shared_prefix_boundary=junction)
        assert m.query_admit(c).num_cached_tokens == c_hit
        assert m.query_admit(a).num_cached_tokens == 24
    dense = make([FULL, win])
    assert dense.config.window_retention_interval is None
    run(dense, 1, a)
    assert dense.query_admit(b).num_cached_tokens == 16
    with pytest.raises(pagedkv.InvalidArgumentError, match="shared_prefix_boundary = 26"):
        dense.try_admit(3, a, shared_prefix_boundary=26)
    with pytest.raises(pagedkv.InvalidArgumentError, match="window_retention_interval = 6"):
        make([FULL, win], window_retention_interval=6)
