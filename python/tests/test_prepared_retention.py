"""prepare_prompt / PreparedPrompt (admissions retried without hashing again) and retention priorities
(RetentionConfig under eviction="priority", expire_retention)."""
import datetime

import numpy as np
import pytest

import pagedkv
from pagedkv import RetentionConfig, TokenRangeRetention
from conftest import prompt, state

BS = 4


def make(num_blocks=64, eviction="lru", hasher="sha256", **kw):
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=num_blocks, block_size=BS, **kw), hasher=hasher,
                                  eviction=eviction)


def build(m, seqs):
    buf = pagedkv.BatchMetadataBuffers(pagedkv.BatchMetadataLimits(8, 256, 64, 8))
    return m.build_batch_metadata(seqs, **buf.kwargs())


@pytest.mark.parametrize("hasher", ["sha256", "xxh3"])
def test_prepared_prompt_admits_as_the_tokens_do(hasher):
    rng = np.random.default_rng(5)
    a, b = make(num_blocks=40, hasher=hasher), make(num_blocks=40, hasher=hasher)
    base = rng.integers(0, 1000, 30, dtype=np.int32)
    for seq in range(12):
        toks = np.concatenate([base[: rng.integers(1, 31)], rng.integers(0, 1000, rng.integers(0, 6), np.int32)])
        p = a.prepare_prompt(toks)
        assert len(p) == p.num_tokens == len(toks) and p.tokens == toks.tolist() and p.keys is None
        assert len(p.hashes) == len(toks) // BS and all(isinstance(h, bytes) and len(h) == 16 for h in p.hashes)
        assert p.hashes == b.prepare_prompt(toks).hashes  # same hasher and seed: same hashes
        q = a.query_admit(p, num_reserved_tokens=3)
        assert (q.status, q.num_blocks, q.num_cached_tokens) == (lambda r: (r.status, r.num_blocks,
                                                                           r.num_cached_tokens))(
            b.query_admit(toks, num_reserved_tokens=3))
        ra, rb = a.try_admit(seq, p), b.try_admit(seq, toks)
        assert (ra.status, ra.num_cached_tokens, ra.num_new_blocks, ra.num_missing_blocks) == \
            (rb.status, rb.num_cached_tokens, rb.num_new_blocks, rb.num_missing_blocks)
        if ra:
            assert a.block_ids(seq).tolist() == b.block_ids(seq).tolist()
            build(a, [seq]), build(b, [seq])
        if seq % 3 == 2:
            for m in (a, b):
                for s in range(seq - 2, seq + 1):
                    if s in m:
                        m.free(s)
    assert a.stats().as_dict() == b.stats().as_dict() and a.stats().prefix_hit_tokens > 0


def test_prepared_prompt_retry_while_full_and_its_checks():
    m = make(num_blocks=5)  # 4 usable blocks
    m.try_admit(1, prompt(16))
    p = m.prepare_prompt(prompt(12, start=500), pagedkv.RequestKeys(salt="s"))
    assert p.keys.salt == "s"
    before = state(m, [1, 2])
    for _ in range(3):  # an engine retrying every step: nothing changes while the pool is full
        r = m.try_admit(2, p)
        assert r.status == pagedkv.AdmitStatus.NO_CAPACITY and r.num_missing_blocks == 3
        assert state(m, [1, 2]) == before
    m.free(1)
    assert m.try_admit(2, p).admitted and m.token_ids(2) == prompt(12, start=500).tolist()
    with pytest.raises(pagedkv.DuplicateSequenceError):
        m.try_admit(2, p)
    # The salt travels with the prepared prompt: the unsalted prompt does not hit its blocks.
    build(m, [2])
    m.free(2)
    assert m.lookup(prompt(12, start=500)) == 0
    assert m.lookup(prompt(12, start=500), pagedkv.RequestKeys(salt="s")) == 8
    # Another seed or hasher: refused.
    for other in (make(hash_seed=1), make(hasher="xxh3")):
        with pytest.raises(pagedkv.InvalidArgumentError, match="not prepared by a manager with this hasher"):
            other.try_admit(1, p)
        with pytest.raises(pagedkv.InvalidArgumentError):
            other.query_admit(p)
    assert len(m.prepare_prompt(np.empty(0, np.int32)).hashes) == 0  # an empty prompt: nothing to hash
    with pytest.raises(TypeError):
        pagedkv.PreparedPrompt()


def fill_and_free(m, seq, toks, retention=None):
    assert m.try_admit(seq, toks, retention=retention).admitted
    build(m, [seq])
    m.free(seq)


def survivors(eviction, prio_a, prio_b, expire_at=None, duration_a=None, expired=0):
    """Cache A (8 blocks) then B (8 blocks) with the given priorities, then admit C needing 8 new blocks in a pool
    with 4 free: 4 cached blocks are evicted. A's priority lasts `duration_a`; the retention clock is moved to
    `expire_at` before C, when `expired` blocks fall back to the default. Returns the cached prefix lengths of A and
    B afterwards."""
    m = make(num_blocks=21, eviction=eviction)  # 20 usable
    a, b, c = prompt(32, start=1000), prompt(32, start=2000), prompt(32, start=3000)
    ret = lambda p, d=None: None if p is None else RetentionConfig([TokenRangeRetention(0, None, p, d)])  # noqa
    fill_and_free(m, 1, a, ret(prio_a, duration_a))
    fill_and_free(m, 2, b, ret(prio_b))
    if expire_at is not None:
        assert m.expire_retention(expire_at) == expired
    assert m.stats().blocks_cached == 16 and m.stats().evictions == 0
    assert m.try_admit(3, c).admitted and m.stats().evictions == 4
    return m.lookup(a), m.lookup(b)


def test_retention_priority_protects_a_prefix_from_eviction():
    # LRU evicts A's blocks (freed first), whatever their retention.
    # (free releases the tail first: A keeps its first 4 blocks, 16 tokens)
    assert survivors("lru", None, None) == (16, 28)
    assert survivors("lru", 90, 10) == (16, 28)
    # Priority: the low-priority B is evicted instead of A, and the other way round.
    assert survivors("priority", 90, 10) == (28, 16)
    assert survivors("priority", 10, 90) == (16, 28)
    assert survivors("priority", None, None) == (16, 28)  # the default priority everywhere: LRU order
    # A's priority lasts 1 s after it is cached (at retention time 0): at 0.5 s it still protects A, at 2 s (as a
    # timedelta) A is back to the default 35, below B's 50.
    assert survivors("priority", 90, 50, expire_at=0.5, duration_a=1.0, expired=0) == (28, 16)
    m_a, m_b = survivors("priority", 90, 50, expire_at=datetime.timedelta(seconds=2), duration_a=1.0, expired=8)
    assert (m_a, m_b) == (16, 28)


def test_retention_decode_priority_and_clock():
    m = make(num_blocks=21, eviction="priority")
    assert m.retention_now() == datetime.timedelta(0)
    assert m.expire_retention(3.5) == 0 and m.retention_now() == datetime.timedelta(seconds=3.5)
    m.expire_retention(1.0)  # the clock never goes back
    assert m.retention_now() == datetime.timedelta(seconds=3.5)
    # Prompt blocks at priority 0, generated-only blocks at 100: the prompt blocks go first, although LRU (tail
    # first) would evict the decode blocks first.
    r = RetentionConfig([TokenRangeRetention(0, 8, 0)], decode_priority=100)
    assert m.try_admit(1, prompt(8), retention=r).admitted
    for t in range(8):
        assert m.try_append(1, [t]).ok
    build(m, [1])
    m.free(1)
    hashes = m.prepare_prompt(prompt(8).tolist() + list(range(8))).hashes
    fill_and_free(m, 2, prompt(32, start=5000))  # default priority, freed later than sequence 1
    assert m.try_admit(3, prompt(40, start=9000)).admitted  # 10 blocks: 2 cached blocks evicted
    assert m.stats().evictions == 2
    assert [m.cached_block(h) is not None for h in hashes] == [False, False, True, True]


@pytest.mark.parametrize("config, match", [
    (RetentionConfig([TokenRangeRetention(0, 8, 101)]), "retention range 0 priority 101 outside"),
    (RetentionConfig([TokenRangeRetention(4, 4)]), r"retention range 0 \[4, 4\) is empty"),
    (RetentionConfig([TokenRangeRetention(0, 8), TokenRangeRetention(6, 9)]), "overlaps or follows range 1"),
    (RetentionConfig([TokenRangeRetention(0, None), TokenRangeRetention(6, 9)]), "overlaps or follows range 1"),
    (RetentionConfig(decode_priority=200), "decode priority 200"),
    (RetentionConfig(decode_duration=datetime.timedelta(0)), "duration 0 ns is not positive"),
])
def test_bad_retention_is_refused_and_changes_nothing(config, match):
    m = make(eviction="priority")
    m.try_admit(1, prompt(9))
    before = state(m, [1, 2])
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        config.validate()
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        m.try_admit(2, prompt(9, start=50), retention=config)
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        m.query_admit(prompt(9, start=50), retention=config)
    with pytest.raises(pagedkv.InvalidArgumentError, match=match):
        m.try_admit(2, m.prepare_prompt(prompt(9, start=50)), retention=config)
    assert state(m, [1, 2]) == before


def test_retention_types():
    r = TokenRangeRetention(2, 10, 80, datetime.timedelta(milliseconds=1500))
    assert (r.begin, r.end, r.priority, r.duration) == (2, 10, 80, datetime.timedelta(seconds=1.5))
    assert TokenRangeRetention().priority == pagedkv.DEFAULT_RETENTION_PRIORITY == 35
    assert TokenRangeRetention(duration=0.25).duration == datetime.timedelta(milliseconds=250)
    c = RetentionConfig([r])
    c.ranges[0].priority = 1  # a copy
    assert c.ranges[0].priority == 80
    c.ranges = [TokenRangeRetention(0, 4, pagedkv.MAX_RETENTION_PRIORITY)]
    assert c.ranges[0].priority == 100
    with pytest.raises(TypeError):
        TokenRangeRetention(priority=256)  # not a uint8


def test_prepared_prompt_of_another_block_size_is_refused():
    # The same number of full blocks at block sizes 4 and 5 (6 tokens): once accepted, and the block hashed over
    # tokens 1..4 was registered for 1..5, so a prompt differing at token 5 was served wrong K/V. Now refused.
    a = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 4))
    b = pagedkv.KVCacheManager(pagedkv.CacheConfig(64, 5))  # same hasher and seed, block size 5
    x = a.prepare_prompt(np.array([1, 2, 3, 4, 5, 6], np.int32))  # one hash, over tokens 1..4
    with pytest.raises(pagedkv.InvalidArgumentError, match="prepared with block size 4"):
        b.try_admit(1, x)
    with pytest.raises(pagedkv.InvalidArgumentError):
        b.query_admit(x)
    assert not b.contains(1)
    assert b.stats().blocks_used == 0
