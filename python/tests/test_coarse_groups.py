"""Coarse-page groups from Python (issue 20 sec. 2, docs/groups.md "Coarse pages"): a FULL group whose pages hold
16 tokens beside the match unit of 4; its tables and page tables count in pages, its hits in match blocks."""
import numpy as np
import pytest

import pagedkv
from pagedkv import AttentionKind, KVCacheGroupSpec

BS = 4


def _manager():
    cfg = pagedkv.CacheConfig(num_blocks=64, block_size=BS,
                              groups=[KVCacheGroupSpec(), KVCacheGroupSpec(block_size=16)])
    return pagedkv.KVCacheManager(cfg, hasher="xxh3")


def test_coarse_group_config_and_errors():
    spec = KVCacheGroupSpec(block_size=16)
    assert spec.block_size == 16 and "block_size=16" in repr(spec)
    assert spec != KVCacheGroupSpec()
    m = _manager()
    assert m.group_block_size(0) == BS and m.group_block_size(1) == 16
    with pytest.raises(pagedkv.InvalidArgumentError, match="group 0"):
        pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=64, block_size=BS,
                                                   groups=[KVCacheGroupSpec(block_size=16), KVCacheGroupSpec()]))
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_size = 10"):
        pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=64, block_size=BS,
                                                   groups=[KVCacheGroupSpec(), KVCacheGroupSpec(block_size=10)]))
    with pytest.raises(pagedkv.InvalidArgumentError, match="only a full-attention group"):
        pagedkv.KVCacheManager(pagedkv.CacheConfig(
            num_blocks=64, block_size=BS,
            groups=[KVCacheGroupSpec(), KVCacheGroupSpec(AttentionKind.SLIDING_WINDOW, window_tokens=8,
                                                         block_size=16)]))
    with pytest.raises(pagedkv.InvalidArgumentError):
        m.group_block_size(2)


def test_coarse_group_pages_and_partial_hits():
    m = _manager()
    lim = pagedkv.BatchMetadataLimits(max_batch=4, max_tokens_per_step=256, max_blocks_per_seq=64)
    bufs = [pagedkv.BatchMetadataBuffers(lim) for _ in range(2)]
    prompt = list(range(1, 21))  # 5 match blocks; page 0 full, page 1 holds 4 tokens
    assert m.try_admit(1, prompt).admitted
    assert len(m.block_ids(1, 0)) == 5 and len(m.block_ids(1, 1)) == 2
    sizes = m.build_batch_metadata(np.array([1], np.int64), groups=bufs)
    assert sizes[1].num_indices == 2
    assert int(bufs[1].last_page_len[0]) == 4 and int(bufs[0].last_page_len[0]) == 4
    pages = [int(b) for b in m.block_ids(1, 1)]
    slots = bufs[1].slot_mapping[:20]
    assert [int(s) for s in slots] == [pages[p // 16] * 16 + p % 16 for p in range(20)]
    m.free(1)
    r = m.try_admit(2, prompt + [500, 501, 502])
    assert r.num_cached_tokens == 20  # the partial page's entry: not rounded down to the 16-token page
    assert [int(b) for b in m.block_ids(2, 1)] == pages  # cached pages taken in place
