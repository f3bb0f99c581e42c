"""A deliberately wrong pagedkv.vllm for scripts/vllm-e2e.sh: the check must catch it.

PlantedScheduler is pagedkv.vllm.Scheduler whose manager hands the engine a wrong block table: when a running
request grows into a new block, the block id given to vLLM is its neighbour's (another request's or a cached
block), so the model writes and reads K/V in the wrong page. The generated tokens or the prefix-cache hits then
differ from vLLM's own manager, and vllm-e2e.sh fails if they do not.
"""

import pagedkv.vllm as pv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks


class PlantedKVCacheManager(pv.KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        out = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        if out is not None and request.num_computed_tokens > 0 and out.blocks and len(out.blocks[0]) > 0:
            groups = [list(g) for g in out.blocks]
            wrong = groups[0][-1].block_id % (self.kv_cache_config.num_blocks - 1) + 1
            groups[0][-1] = self._block(wrong)
            return KVCacheBlocks(tuple(groups))
        return out


class PlantedScheduler(pv.Scheduler):
    def __init__(self, *args, **kwargs):
        saved = pv.KVCacheManager
        pv.KVCacheManager = PlantedKVCacheManager  # the mixin binds pagedkv.vllm.KVCacheManager by module name
        try:
            super().__init__(*args, **kwargs)
        finally:
            pv.KVCacheManager = saved
