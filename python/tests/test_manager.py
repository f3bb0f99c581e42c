"""Every bound call of pagedkv.KVCacheManager on small pools whose answers are worked out by hand."""
import threading

import numpy as np
import pytest

import pagedkv
from conftest import prompt, state


@pytest.mark.parametrize("hasher", ["sha256", "xxh3"])
@pytest.mark.parametrize("eviction", ["lru", "slru", "priority"])
def test_every_policy_admits_hits_and_evicts(hasher, eviction):
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=5, block_size=4), hasher=hasher, eviction=eviction)
    assert (m.hasher, m.eviction) == (hasher, eviction)
    p = prompt(9)  # 3 blocks, 2 of them full
    assert m.try_admit(1, p).admitted
    m.build_batch_metadata([1], slot_mapping=np.empty(16, np.int64), copies=np.empty((1, 2), np.int32))
    m.free(1)
    r = m.try_admit(2, p)
    assert r.status == pagedkv.AdmitStatus.ADMITTED and r.num_cached_tokens == 8 and r.num_new_blocks == 1
    m.build_batch_metadata([2], slot_mapping=np.empty(16, np.int64), copies=np.empty((1, 2), np.int32))
    m.free(2)
    # A different 12-token prompt needs 3 of the 4 usable blocks: one cached block is evicted.
    assert m.try_admit(3, prompt(12, start=5000)).admitted
    assert m.stats().evictions == 1


def test_hashers_differ_and_unknown_names_raise():
    cfg = pagedkv.CacheConfig(num_blocks=8, enable_events=True, block_size=2)
    hashes = []
    for h in ("sha256", "xxh3"):
        m = pagedkv.KVCacheManager(cfg, hasher=h)
        m.try_admit(1, [1, 2, 3])
        m.build_batch_metadata([1], slot_mapping=np.empty(4, np.int64), copies=np.empty((1, 2), np.int32))
        hashes.append(m.take_event_batch(0.0).events[0].hash)
    assert hashes[0] != hashes[1] and all(len(h) == 16 for h in hashes)
    with pytest.raises(pagedkv.InvalidArgumentError, match='hasher = "md5"'):
        pagedkv.KVCacheManager(cfg, hasher="md5")
    with pytest.raises(pagedkv.InvalidArgumentError, match='eviction = "fifo"'):
        pagedkv.KVCacheManager(cfg, eviction="fifo")


def test_config_errors_carry_code_and_message():
    with pytest.raises(pagedkv.InvalidArgumentError) as e:
        pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=1))
    assert e.value.code == pagedkv.Errc.INVALID_ARGUMENT == 1
    assert isinstance(e.value, pagedkv.Error) and isinstance(e.value, ValueError)
    assert str(e.value) == "pagedkv: invalid_argument: " + e.value.message
    assert "num_blocks" in e.value.message
    with pytest.raises(pagedkv.LimitExceededError) as e:
        pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, max_tokens_per_seq=2**31))
    assert e.value.code == pagedkv.Errc.LIMIT_EXCEEDED
    assert pagedkv.LimitExceededError.code == pagedkv.Errc.LIMIT_EXCEEDED


def test_config_fields_round_trip():
    c = pagedkv.CacheConfig(num_blocks=10, block_size=8, enable_prefix_caching=False, hash_seed=7,
                            max_tokens_per_seq=100, enable_events=True, num_host_blocks=4,
                            offload=pagedkv.OffloadPolicy.WRITE_THROUGH, min_offload_priority=3)
    m = pagedkv.KVCacheManager(c)
    got = m.config
    assert (got.num_blocks, got.block_size, got.enable_prefix_caching, got.hash_seed, got.max_tokens_per_seq,
            got.enable_events, got.num_host_blocks, got.offload, got.min_offload_priority) == \
        (10, 8, False, 7, 100, True, 4, pagedkv.OffloadPolicy.WRITE_THROUGH, 3)
    assert m.block_size == 8 and m.max_tokens_per_seq == 100


def test_admit_append_blocks_and_slots(mgr):
    r = mgr.try_admit(7, prompt(6))
    assert r.admitted and bool(r) and r.num_cached_tokens == 0 and r.num_new_blocks == 2
    blocks = mgr.block_ids(7)
    assert blocks.dtype == np.uint32 and len(blocks) == 2 and 7 in mgr and len(mgr) == 1
    assert mgr.num_tokens(7) == 6 and mgr.token_ids(7) == list(range(1000, 1006))
    expected = [int(blocks[p // 4]) * 4 + p % 4 for p in range(6)]
    assert mgr.pending_slots(7) == expected
    a = mgr.try_append(7, [42])
    assert a.ok and a.status == pagedkv.AppendStatus.OK and a.copy is None
    assert a.slots == [int(blocks[1]) * 4 + 2]
    assert mgr.num_tokens(7) == 7 and mgr.token_ids(7)[-1] == 42


def test_duplicate_and_invalid_admissions_change_nothing(mgr):
    mgr.try_admit(1, prompt(5))
    before = state(mgr, [1, 2])
    with pytest.raises(pagedkv.DuplicateSequenceError, match="sequence 1"):
        mgr.try_admit(1, prompt(3))
    keys = pagedkv.RequestKeys(multimodal=[pagedkv.MultimodalItem(b"\x01" * 16, 3, 10)])
    with pytest.raises(pagedkv.InvalidArgumentError, match="multimodal item 0 at offset 3 with length 10"):
        mgr.try_admit(2, prompt(5), keys)
    small = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4, max_tokens_per_seq=4))
    with pytest.raises(pagedkv.LimitExceededError):
        small.try_admit(1, prompt(5))
    assert state(mgr, [1, 2]) == before


def test_empty_prompt_admits_a_sequence_with_no_token_yet():
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4))
    r = m.try_admit(1, np.empty(0, np.int32))
    assert r.admitted and r.num_cached_tokens == 0 and r.num_new_blocks == 0
    assert m.num_tokens(1) == 0 and len(m.block_ids(1)) == 0
    assert m.try_append(1, prompt(5)).status == pagedkv.AppendStatus.OK  # its first tokens
    assert m.num_tokens(1) == 5 and len(m.block_ids(1)) == 2
    m.free(1)
    assert m.stats().blocks_used == 0


def test_no_capacity_and_never_fits_are_values():
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=4, block_size=4))  # 3 usable blocks
    r = m.try_admit(1, prompt(20))
    assert r.status == pagedkv.AdmitStatus.NEVER_FITS and r.num_missing_blocks == 2 and not r
    assert m.try_admit(1, prompt(8)).admitted
    q = m.query_admit(prompt(8, start=50))
    assert q.status == pagedkv.CapacityStatus.NO_CAPACITY and q.num_missing_blocks == 1 and not q.fits
    r = m.try_admit(2, prompt(8, start=50))
    assert r.status == pagedkv.AdmitStatus.NO_CAPACITY and r.num_missing_blocks == 1
    assert 2 not in m
    assert m.query_append(1, 4).fits and m.query_append(1, 4).num_blocks == 1
    q = m.query_append(1, 5)  # 13 tokens = 4 blocks > the 3 usable ones
    assert q.status == pagedkv.CapacityStatus.NEVER_FITS and q.num_missing_blocks == 1
    assert m.try_append(1, prompt(5)).status == pagedkv.AppendStatus.NEVER_FITS
    assert m.try_admit(3, prompt(4, start=90)).admitted  # the last block
    q = m.query_append(1, 1)
    assert q.status == pagedkv.CapacityStatus.NO_CAPACITY and q.num_missing_blocks == 1
    a = m.try_append(1, [5])
    assert a.status == pagedkv.AppendStatus.NO_CAPACITY and a.num_missing_blocks == 1 and not a
    assert m.num_tokens(1) == 8


def test_input_conversion_is_strict(mgr):
    with pytest.raises(TypeError):
        mgr.try_admit(1, np.arange(4, dtype=np.int64))  # never cast silently
    with pytest.raises(TypeError):
        mgr.try_admit(1, [1, 2**40])  # out of int32
    with pytest.raises(TypeError):
        mgr.try_admit(-1, [1, 2])  # sequence ids are uint64
    assert len(mgr) == 0
    assert mgr.try_admit(1, (5, 6, 7)).admitted  # tuples and lists are converted
    assert mgr.try_admit(2, np.arange(3, dtype=np.int32)[::-1].copy()).admitted


def test_try_append_errors_change_nothing(mgr):
    mgr.try_admit(1, prompt(5), num_reserved_tokens=2)  # chunked: 3 prompt tokens without slots
    mgr.try_admit(2, prompt(3))
    before = state(mgr, [1, 2])
    with pytest.raises(pagedkv.UnknownSequenceError, match="sequence 9"):
        mgr.try_append(9, [1])
    with pytest.raises(pagedkv.InvalidArgumentError, match="prompt tokens without slots"):
        mgr.try_append(1, [1])
    small = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4, max_tokens_per_seq=4))
    small.try_admit(1, prompt(4))
    with pytest.raises(pagedkv.LimitExceededError, match="max_tokens_per_seq = 4"):
        small.try_append(1, [1])
    assert state(mgr, [1, 2]) == before


def test_chunked_admission_and_try_reserve(mgr):
    r = mgr.try_admit(1, prompt(10), num_reserved_tokens=4)
    assert r.admitted and mgr.num_tokens(1) == 4
    with pytest.raises(pagedkv.InvalidArgumentError):
        mgr.try_reserve(1, 7)
    assert mgr.num_tokens(1) == 4
    a = mgr.try_reserve(1, 6)
    assert a.ok and len(a.slots) == 6 and mgr.num_tokens(1) == 10


def test_lookahead_commit(mgr):
    mgr.try_admit(1, prompt(4))
    a = mgr.try_reserve_lookahead(1, 3)
    assert a.ok and len(a.slots) == 3 and mgr.num_tokens(1) == 7
    with pytest.raises(pagedkv.InvalidArgumentError, match="accepts 4 tokens but has 3 lookahead slots"):
        mgr.commit_lookahead(1, [1, 2, 3, 4])
    mgr.commit_lookahead(1, [11])
    assert mgr.num_tokens(1) == 5 and mgr.token_ids(1)[-1] == 11


def test_rewind(mgr):
    mgr.try_admit(1, prompt(9))
    before = state(mgr, [1])
    with pytest.raises(pagedkv.LimitExceededError):
        mgr.rewind(1, 10)
    assert state(mgr, [1]) == before
    mgr.rewind(1, 5)
    assert mgr.num_tokens(1) == 4 and len(mgr.block_ids(1)) == 1


def test_lookup_and_query_admit_agree_with_admission(mgr):
    p = prompt(13)
    mgr.try_admit(1, p)
    mgr.build_batch_metadata([1], slot_mapping=np.empty(16, np.int64), copies=np.empty((1, 2), np.int32))
    assert mgr.lookup(p) == 12 and mgr.lookup(p, max_cached_tokens=5) == 4
    assert mgr.query_admit(p).num_cached_tokens == 12
    assert mgr.query_admit(p, max_cached_tokens=8).num_cached_tokens == 8
    assert mgr.lookup(p, pagedkv.RequestKeys(salt="tenant-b")) == 0
    assert mgr.lookup(p, pagedkv.RequestKeys(adapter_id=3)) == 0
    r = mgr.try_admit(2, p, max_cached_tokens=8)
    assert r.num_cached_tokens == 8


def test_fork_copy_on_write_and_copies_buffer(mgr):
    mgr.try_admit(1, prompt(6))
    slots = np.full(16, -7, np.int64)
    copies = np.full((4, 2), -7, np.int32)
    mgr.build_batch_metadata([1], slot_mapping=slots, copies=copies)
    with pytest.raises(pagedkv.DuplicateSequenceError):
        mgr.fork(1, 1)
    mgr.fork(1, 2)
    assert mgr.block_ids(2).tolist() == mgr.block_ids(1).tolist()
    a = mgr.try_append(2, [99])  # the shared partial last block is copied
    assert a.ok and a.copy is not None
    src, dst = a.copy
    assert src == mgr.block_ids(1)[-1] and dst == mgr.block_ids(2)[-1] and src != dst
    mgr.try_append(1, [98])
    with pytest.raises(pagedkv.InvalidArgumentError, match="unbuilt"):
        mgr.fork(2, 3)  # not settled
    sz = mgr.build_batch_metadata([2], slot_mapping=slots, copies=copies)
    assert sz.num_copies == 1 and copies[0].tolist() == [src, dst] and copies[1].tolist() == [-1, -1]
    assert mgr.stats().cow_copies == 1


def test_free_preempt_readmit_and_prefix_stats(mgr):
    p = prompt(9)
    mgr.try_admit(1, p)
    mgr.build_batch_metadata([1], slot_mapping=np.empty(16, np.int64), copies=np.empty((1, 2), np.int32))
    assert mgr.preempt(1) is True
    assert 1 not in mgr and mgr.stats().preemptions == 1
    with pytest.raises(pagedkv.UnknownSequenceError):
        mgr.preempt(1)
    r = mgr.try_admit(1, p)
    assert r.num_cached_tokens == 8
    s = mgr.stats()
    assert (s.readmitted_requests, s.readmitted_query_tokens, s.readmitted_hit_tokens) == (1, 9, 8)
    ps = mgr.take_prefix_cache_stats()
    assert (ps.requests, ps.queries, ps.hits, ps.preempted_requests, ps.preempted_hits) == (1, 9, 0, 1, 8)
    assert ps.hit_rate == 0.0 and ps.preempted_hit_rate == pytest.approx(8 / 9)
    assert mgr.take_prefix_cache_stats().requests == 0  # a new interval
    mgr.free(1)
    with pytest.raises(pagedkv.UnknownSequenceError, match="free: sequence 1 is not live"):
        mgr.free(1)


def test_swap_preemption_and_resume():
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4, num_host_blocks=8))
    with pytest.raises(pagedkv.InvalidArgumentError, match="host tier"):
        _swap_without_tier()
    m.try_admit(1, prompt(6))
    swap = np.full((8, 2), -7, np.int32)
    m.build_batch_metadata([1], slot_mapping=np.empty(8, np.int64), copies=np.empty((1, 2), np.int32),
                           swap_out=swap, swap_in=np.empty((8, 2), np.int32))
    assert m.preempt(1, pagedkv.PreemptMode.SWAP) is True
    assert m.is_swapped(1) and 1 not in m
    sz = m.build_batch_metadata([], swap_out=swap, swap_in=np.empty((8, 2), np.int32))
    assert sz.num_swap_out == 2 and sz.transfer_token != 0
    r = m.try_resume(1)
    assert r.status == pagedkv.AdmitStatus.TRANSFER_PENDING
    m.complete_transfers(sz.transfer_token)
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.complete_transfers(sz.transfer_token)  # already completed
    r = m.try_resume(1)
    assert r.admitted and r.num_cached_tokens == 6 and m.num_tokens(1) == 6
    assert m.stats().swap_outs == 2


def _swap_without_tier():
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=8, block_size=4))
    m.try_admit(1, prompt(4))
    m.build_batch_metadata([1], slot_mapping=np.empty(4, np.int64), copies=np.empty((1, 2), np.int32))
    m.preempt(1, pagedkv.PreemptMode.SWAP)


def test_events_batches_drain_and_reset():
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=16, block_size=4, enable_events=True))
    assert m.take_event_batch(1.0) is None
    p = prompt(9)
    keys = pagedkv.RequestKeys(adapter_id=5, salt="s1")
    m.try_admit(1, p, keys)
    m.build_batch_metadata([1], slot_mapping=np.empty(16, np.int64), copies=np.empty((1, 2), np.int32))
    b = m.take_event_batch(12.5)
    assert b.seq_no == 1 and b.ts == 12.5 and len(b.events) == 2
    e0, e1 = b.events
    assert e0.type == pagedkv.KVEventType.BLOCK_STORED and e0.medium == pagedkv.Medium.GPU
    assert e0.token_ids == p[:4].tolist() and e1.token_ids == p[4:8].tolist()
    assert e0.parent_hash is None and e1.parent_hash == e0.hash and e0.hash != e1.hash
    assert (e0.block_start, e1.block_start, e0.block_size, e0.adapter_id) == (0, 4, 4, 5)
    assert e0.salt == "s1" and e1.salt == "s1" and e0.seq_no + 1 == e1.seq_no  # the salt rides on every block
    assert m.reset_prefix_cache() is False  # sequence 1 holds blocks
    m.free(1)
    assert m.reset_prefix_cache() is True
    ev = m.drain_events()
    assert [e.type for e in ev] == [pagedkv.KVEventType.ALL_CLEARED]
    assert m.take_event_batch(13.0) is None
    assert m.take_prefix_cache_stats().reset is True


def test_multimodal_keys_separate_blocks():
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=16, block_size=4))
    p = prompt(9)
    img_a = pagedkv.RequestKeys(multimodal=[pagedkv.MultimodalItem(b"A" * 16, 1, 2)])
    img_b = pagedkv.RequestKeys(multimodal=[pagedkv.MultimodalItem(b"B" * 16, 1, 2)])
    assert img_a.multimodal[0].item_hash == b"A" * 16 and img_a.multimodal[0].length_tokens == 2
    m.try_admit(1, p, img_a)
    m.build_batch_metadata([1], slot_mapping=np.empty(16, np.int64), copies=np.empty((1, 2), np.int32))
    assert m.lookup(p, img_a) == 8
    assert m.lookup(p, img_b) == 0  # the image is in the first block: nothing shared
    assert m.lookup(p) == 0
    with pytest.raises(pagedkv.InvalidArgumentError, match="16 bytes"):
        pagedkv.MultimodalItem(b"short", 0, 1)


def test_threads_share_one_manager_safely():
    # Calls release the GIL; the binding's per-manager lock keeps the single-writer C++ manager consistent.
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=512, block_size=16), hasher="sha256")
    errors = []

    def worker(t):
        try:
            for i in range(200):
                seq = t * 1000 + i
                assert m.try_admit(seq, prompt(64, start=(i % 7) * 64)).admitted
                m.build_batch_metadata([seq], slot_mapping=np.empty(64, np.int64),
                                       copies=np.empty((1, 2), np.int32))
                m.free(seq)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = m.stats()
    assert s.prefix_query_requests == 800 and s.blocks_used == 0 and len(m) == 0
    assert s.blocks_cached == 7 * 4  # 7 distinct 64-token prompts of 4 full blocks each stay cached
