"""The per-step calls: append_tokens / free_many (one crossing per step) and build_batch_metadata writing into
caller-owned numpy arrays in place, reused step after step."""
import numpy as np
import pytest

import pagedkv
from conftest import prompt, state

BS = 4


def make(num_blocks=64, **kw):
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=num_blocks, block_size=BS, **kw))


def test_append_tokens_one_token_per_sequence():
    m = make()
    for s in (10, 11, 12):
        m.try_admit(s, prompt(3 + s))
    ids = np.array([10, 11, 12], np.int64)
    st = m.append_tokens(ids, np.array([7, 8, 9], np.int32))
    assert st.dtype == np.uint8 and st.tolist() == [0, 0, 0]
    assert [m.token_ids(s)[-1] for s in (10, 11, 12)] == [7, 8, 9]
    assert [m.num_tokens(s) for s in (10, 11, 12)] == [14, 15, 16]
    out = np.full(8, 255, np.uint8)
    r = m.append_tokens([10, 11], [1, 2], out=out)
    assert out[:2].tolist() == [0, 0] and out[2] == 255 and r.tolist() == [0, 0]
    assert np.shares_memory(r, out)
    assert m.append_tokens(np.empty(0, np.int64), np.empty(0, np.int32)).tolist() == []


def test_append_tokens_reports_no_capacity_per_sequence():
    m = make(num_blocks=4)  # 3 usable blocks
    m.try_admit(1, prompt(4))  # block 1 full
    m.try_admit(2, prompt(8, start=50))  # blocks 2, 3 full
    st = m.append_tokens([1, 2], [5, 6])
    assert st.tolist() == [pagedkv.AppendStatus.NO_CAPACITY] * 2
    assert m.num_tokens(1) == 4 and m.num_tokens(2) == 8
    m.free(2)
    st = m.append_tokens([1], [5])
    assert st.tolist() == [pagedkv.AppendStatus.OK]


def test_append_tokens_bad_input_changes_nothing():
    m = make(max_tokens_per_seq=6)
    m.try_admit(1, prompt(3))
    m.try_admit(2, prompt(5))
    m.try_admit(3, prompt(5), num_reserved_tokens=1)
    before = state(m, [1, 2, 3])
    with pytest.raises(pagedkv.UnknownSequenceError, match=r"seq_ids\[1\] = 99 is not live"):
        m.append_tokens([1, 99, 2], [1, 2, 3])
    with pytest.raises(pagedkv.InvalidArgumentError, match=r"seq_ids\[1\] = 3 has 4 prompt tokens without slots"):
        m.append_tokens([1, 3], [1, 2])
    with pytest.raises(pagedkv.BadShapeError, match="2 sequence ids but 1 tokens"):
        m.append_tokens([1, 2], [1])
    # Sequence 2 has 5 tokens: one more fits, two (it appears twice) exceed max_tokens_per_seq = 6.
    with pytest.raises(pagedkv.LimitExceededError, match="would reach 7 tokens"):
        m.append_tokens([1, 2, 2], [1, 2, 3])
    with pytest.raises(pagedkv.BadShapeError):
        m.append_tokens([1, 2], [1, 2], out=np.empty(1, np.uint8))
    with pytest.raises(TypeError):
        m.append_tokens([1, 2], [1, 2], out=np.empty(2, np.int32))
    assert state(m, [1, 2, 3]) == before
    assert m.append_tokens([1, 1], [4, 5]).tolist() == [0, 0]  # twice within the limit: fine
    assert m.token_ids(1)[-2:] == [4, 5]


def test_free_many():
    m = make()
    for s in range(5):
        m.try_admit(s, prompt(5, start=100 * s))
    before = state(m, range(5))
    with pytest.raises(pagedkv.UnknownSequenceError, match=r"seq_ids\[2\] = 9 is not live"):
        m.free_many([0, 1, 9])
    with pytest.raises(pagedkv.UnknownSequenceError, match="sequence 1 appears twice"):
        m.free_many(np.array([1, 3, 1], np.int64))
    assert state(m, range(5)) == before
    m.free_many(np.array([0, 3, 4], np.int64))
    assert sorted(s for s in range(5) if s in m) == [1, 2]
    assert m.stats().blocks_used == 4


def decode_reference(m, seqs):
    """What one decode step's metadata must hold, computed from block_ids / num_tokens / pending_slots."""
    indptr, indices, lpl, lens, slots = [0], [], [], [], []
    for s in seqs:
        b = m.block_ids(s).tolist()
        n = m.num_tokens(s)
        indices += b
        indptr.append(len(indices))
        lpl.append((n - 1) % BS + 1)
        lens.append(n)
        slots += m.pending_slots(s)
    return indptr, indices, lpl, lens, slots


def test_build_reuses_caller_buffers_across_steps():
    m = make()
    seqs = [3, 1, 2]
    for i, s in enumerate(seqs):
        m.try_admit(s, prompt(5 + 3 * i, start=1000 * s))
    limits = pagedkv.BatchMetadataLimits(max_batch=4, max_tokens_per_step=32, max_blocks_per_seq=8)
    buf = pagedkv.BatchMetadataBuffers(limits)
    for a in buf.kwargs().values():
        a.fill(-7)  # poison: every entry up to capacity must be written or padded
    addrs = {k: v.__array_interface__["data"][0] for k, v in buf.kwargs().items()}
    ids = np.array(seqs, np.int64)
    for step in range(6):
        indptr, indices, lpl, lens, slots = decode_reference(m, seqs)
        qo = [0] + list(np.cumsum([len(m.pending_slots(s)) for s in seqs]))
        sz = m.build_batch_metadata(ids, **buf.kwargs())
        assert (sz.batch_size, sz.num_indices, sz.num_new_tokens, sz.num_copies) == (3, len(indices), len(slots), 0)
        assert buf.indptr.tolist() == indptr + [indptr[-1]]  # padding repeats the last value
        assert buf.indices[:len(indices)].tolist() == indices
        assert buf.last_page_len.tolist() == lpl + [0] and buf.seq_lens.tolist() == lens + [0]
        assert buf.qo_indptr.tolist() == qo + [qo[-1]]
        assert buf.slot_mapping[:len(slots)].tolist() == slots and (buf.slot_mapping[len(slots):] == -1).all()
        for r, s in enumerate(seqs):
            b = m.block_ids(s).tolist()
            assert buf.block_tables[r, :len(b)].tolist() == b
        assert (buf.copies == -1).all()
        # Written in place: the same memory every step, no reallocation.
        assert {k: v.__array_interface__["data"][0] for k, v in buf.kwargs().items()} == addrs
        st = m.append_tokens(ids, np.full(3, 500 + step, np.int32))
        assert (st == 0).all()


def test_build_bad_buffers_raise_and_change_nothing():
    m = make()
    m.try_admit(1, prompt(9))
    m.try_admit(2, prompt(5, start=77))
    before = state(m, [1, 2])
    slots = np.full(32, -7, np.int64)
    with pytest.raises(pagedkv.BadShapeError):
        m.build_batch_metadata([1, 2], slot_mapping=np.empty(4, np.int64), copies=np.empty((2, 2), np.int32))
    with pytest.raises(pagedkv.BadShapeError, match="max_blocks_per_seq = 2"):
        m.build_batch_metadata([1, 2], slot_mapping=slots, block_tables=np.empty((2, 2), np.int32))
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.build_batch_metadata([1, 5], slot_mapping=slots)
    with pytest.raises(pagedkv.InvalidArgumentError, match="appears twice"):
        m.build_batch_metadata([1, 1], slot_mapping=slots)
    with pytest.raises(pagedkv.BadShapeError, match="num_scheduled_tokens"):
        m.build_batch_metadata([1, 2], slot_mapping=slots, num_scheduled_tokens=[1])
    with pytest.raises(TypeError):
        m.build_batch_metadata([1, 2], slot_mapping=np.empty(32, np.int32))  # wrong dtype: never converted
    ro = np.empty(32, np.int64)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        m.build_batch_metadata([1, 2], slot_mapping=ro)
    with pytest.raises(TypeError):
        m.build_batch_metadata([1, 2], slot_mapping=np.empty(64, np.int64)[::2])  # not contiguous
    assert state(m, [1, 2]) == before
    assert (slots == -7).all()  # nothing written
    sz = m.build_batch_metadata([1, 2], slot_mapping=slots, num_scheduled_tokens=np.array([4, 5], np.uint32))
    assert sz.num_new_tokens == 9 and len(m.pending_slots(1)) == 5 and m.pending_slots(2) == []


def test_batch_metadata_capacity_and_buffers():
    lim = pagedkv.BatchMetadataLimits(max_batch=8, max_tokens_per_step=100, max_blocks_per_seq=5, max_swaps=3)
    c = pagedkv.batch_metadata_capacity(lim)
    assert (c.indptr, c.indices, c.seq_lens, c.slot_mapping, c.copies, c.swap_out, c.max_blocks_per_seq) == \
        (9, 40, 8, 100, 16, 6, 5)
    b = pagedkv.BatchMetadataBuffers(lim)
    assert b.block_tables.shape == (8, 5) and b.swap_in.shape == (3, 2) and b.slot_mapping.dtype == np.int64
    assert "swap_in" not in pagedkv.BatchMetadataBuffers(
        pagedkv.BatchMetadataLimits(max_batch=1, max_tokens_per_step=1, max_blocks_per_seq=1)).kwargs()
    with pytest.raises(pagedkv.InvalidArgumentError, match="max_batch = 0"):
        pagedkv.batch_metadata_capacity(pagedkv.BatchMetadataLimits(0, 1, 1))
