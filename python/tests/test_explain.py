"""explain_admit, the eviction history and the per-cause counters (issue 20, "hits that explain themselves")."""
import numpy as np
import pytest

import pagedkv
from conftest import prompt


def _cycle(m, seq, p):
    """Admit, build (registers the full blocks), free."""
    assert m.try_admit(seq, p).admitted
    m.build_batch_metadata([seq], slot_mapping=np.empty(len(p), np.int64), copies=np.empty((1, 2), np.int32))
    m.free(seq)


@pytest.mark.parametrize("hasher", ["sha256", "xxh3"])
def test_evicted_never_stored_capped_and_counters(hasher):
    cfg = pagedkv.CacheConfig(num_blocks=9, block_size=4, eviction_history=64, count_miss_causes=True)
    assert (cfg.eviction_history, cfg.count_miss_causes) == (64, True)
    m = pagedkv.KVCacheManager(cfg, hasher=hasher)
    a = prompt(9)  # 2 full blocks + 1 token
    _cycle(m, 1, a)
    x = m.explain_admit(a)
    assert x.cause == pagedkv.MissCause.NONE and x.hit_tokens == 8 == m.lookup(a) and x.eviction is None
    assert m.explain_admit(a, max_cached_tokens=4).cause == pagedkv.MissCause.CAPPED
    assert m.explain_admit(prompt(9, start=7)).cause == pagedkv.MissCause.NOT_CACHED  # never stored
    for s in range(10, 13):  # three more 3-block prompts push a's blocks out (LRU)
        _cycle(m, s, prompt(12, start=1000 * s))
    x = m.explain_admit(a)
    assert x.cause == pagedkv.MissCause.EVICTED and x.first_miss_block * 4 == x.hit_tokens
    assert x.eviction.tier == pagedkv.EvictedTier.DEVICE and x.eviction.group == 0
    assert 0 <= x.evictions_since < m.stats().evictions
    before = m.stats().admissions_by_miss_cause
    assert set(before) == {"none", "prefix_caching_off", "short_prompt", "capped", "not_cached", "key_mismatch",
                           "limited_by_group", "evicted"}
    assert before["not_cached"] == 4  # every admission so far ended at a block never stored
    assert m.try_admit(2, a).admitted
    after = m.stats().admissions_by_miss_cause
    assert after["evicted"] == before["evicted"] + 1 and sum(after.values()) == sum(before.values()) + 1


def test_off_by_default_and_bad_config():
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=9, block_size=4))
    _cycle(m, 1, prompt(9))
    for s in range(10, 13):
        _cycle(m, s, prompt(12, start=1000 * s))
    assert m.explain_admit(prompt(9)).cause == pagedkv.MissCause.NOT_CACHED  # no history: not "evicted"
    assert sum(m.stats().admissions_by_miss_cause.values()) == 0
    with pytest.raises(pagedkv.LimitExceededError, match="eviction_history = 1073741825"):
        pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=9, eviction_history=(1 << 30) + 1))
    assert m.explain_admit(np.array([], np.int32)).cause == pagedkv.MissCause.SHORT_PROMPT  # no full block
