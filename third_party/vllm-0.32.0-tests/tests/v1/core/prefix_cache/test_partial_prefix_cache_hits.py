# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fine-grained partial prefix-cache hits for hybrid (full attention + mamba
"align") models: scheduler chunk splitting, partial tail registration, CoW
on partial hits, and same-step deferral."""

from math import lcm
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

from tests.v1.core.test_prefix_caching import make_kv_cache_manager, make_request
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.model_executor.layers.mamba.checkpoint import (
    compute_mamba_prefill_checkpoints,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlockCopy,
    get_block_hash,
    get_group_id,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    get_mamba_prefill_checkpoint_position,
)


@pytest.fixture(autouse=True)
def _auto_init_hash_fn():
    init_none_hash(sha256)


def test_connector_without_divergent_hit_support_uses_common_lookup():
    common_blocks = MagicMock()
    manager = MagicMock()
    manager.get_computed_blocks.return_value = (common_blocks, 0, 0)
    scheduler = SimpleNamespace(
        connector=SimpleNamespace(
            supports_divergent_local_hybrid_hits=False,
        ),
        kv_cache_manager=manager,
    )

    result = Scheduler._get_local_prefix_cache_hit(scheduler, MagicMock())

    assert result == (common_blocks, 0, 0, False)
    manager.get_computed_blocks_for_connector.assert_not_called()


def test_capable_connector_uses_divergent_partial_hit_lookup():
    per_group_blocks = MagicMock()
    manager = MagicMock()
    manager.get_computed_blocks_for_connector.return_value = (
        per_group_blocks,
        6,
        0,
        True,
    )
    scheduler = SimpleNamespace(
        connector=SimpleNamespace(
            supports_divergent_local_hybrid_hits=True,
        ),
        kv_cache_manager=manager,
    )

    result = Scheduler._get_local_prefix_cache_hit(scheduler, MagicMock())

    assert result == (per_group_blocks, 6, 0, True)
    manager.get_computed_blocks.assert_not_called()


def drain_boundary_state_offloads(manager):
    """Drain exact boundary-state block ids offered to a connector."""
    return manager.take_boundary_state_offloads()


def _free_block_ids(manager):
    """Block ids the pool would hand out to the next allocation."""
    return {
        block.block_id
        for block in manager.block_pool.free_block_queue.get_all_free_blocks()
    }


def make_full_mamba_manager(
    *,
    dcp_world_size: int,
    hash_block_size: int = 2,
    full_block_size: int = 4,
    mamba_block_size: int = 4,
    num_blocks: int = 32,
    use_eagle: bool = False,
    num_speculative_blocks: int = 0,
    num_prefill_checkpoint_blocks: int = 0,
):
    mamba_group = KVCacheGroupSpec(
        ["mamba"],
        MambaSpec(
            block_size=mamba_block_size,
            shapes=(1, 1),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=num_speculative_blocks,
            num_prefill_checkpoint_blocks=num_prefill_checkpoint_blocks,
            prefill_checkpoint_alignment=(
                16 if num_prefill_checkpoint_blocks > 0 else None
            ),
        ),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=full_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            mamba_group,
        ],
    )
    scheduler_block_size = lcm(
        full_block_size * dcp_world_size,
        mamba_block_size,
    )
    return make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        dcp_world_size=dcp_world_size,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        use_eagle=use_eagle,
    )


@pytest.mark.parametrize(
    "dcp_world_size,hash_block_size,block_size,prompt_tokens,checkpoint_blocks",
    [
        (4, 2, 2, 7, 0),
        (8, 16, 16, 512, 1),
        (8, 16, 16, 513, 1),
        *[(8, 128, 896, p, 1) for p in (127, 128, 129, 7040, 7168, 7296, 7449)],
    ],
)
@pytest.mark.parametrize("use_eagle", [False, True])
@pytest.mark.parametrize("extension_tokens", [0, 32])
def test_dcp_fine_hit_retention_uses_hash_alignment(
    dcp_world_size,
    hash_block_size,
    block_size,
    prompt_tokens,
    checkpoint_blocks,
    use_eagle,
    extension_tokens,
):
    """Resends and extensions reuse the retained hash-aligned checkpoint."""
    manager = make_full_mamba_manager(
        dcp_world_size=dcp_world_size,
        hash_block_size=hash_block_size,
        full_block_size=block_size,
        mamba_block_size=block_size,
        num_blocks=128,
        use_eagle=use_eagle,
        num_speculative_blocks=4 if use_eagle else 0,
        num_prefill_checkpoint_blocks=checkpoint_blocks,
    )
    manager.coordinator.retention_interval = 0
    assert manager.coordinator.enable_partial_hash_hits
    scheduler = SimpleNamespace(
        block_size=block_size * dcp_world_size,
        cache_config=SimpleNamespace(block_size=block_size),
        hash_block_size=hash_block_size,
        max_num_scheduled_tokens=8192,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        use_eagle_block_drop=use_eagle,
        mamba_partial_cache_hit=True,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=bool(checkpoint_blocks),
        mamba_prefill_checkpoint_alignment=16,
    )
    producer = make_request(
        "producer", list(range(prompt_tokens)), hash_block_size, sha256
    )
    while producer.num_computed_tokens < prompt_tokens:
        scheduled = Scheduler._mamba_block_aligned_split(
            scheduler, producer, prompt_tokens - producer.num_computed_tokens
        )
        assert scheduled > 0
        manager.new_step_starts()
        assert manager.allocate_slots(producer, scheduled) is not None
        producer.num_computed_tokens += scheduled
    manager.free(producer)
    manager.new_step_starts()

    replay = make_request(
        "replay", list(range(prompt_tokens + extension_tokens)), hash_block_size, sha256
    )
    _, hit, _ = manager.get_computed_blocks(replay)
    expected = (
        max((prompt_tokens // hash_block_size - 1) * hash_block_size, 0)
        if use_eagle
        else ((prompt_tokens - 1) // hash_block_size * hash_block_size)
    )
    assert hit == expected
    cached_states = {
        end
        for end in range(hash_block_size, prompt_tokens + 1, hash_block_size)
        if manager.block_pool.get_cached_block(
            producer.block_hashes[end // hash_block_size - 1], [1]
        )
        is not None
    }
    assert cached_states == ({expected} if expected else set())


@pytest.mark.parametrize("dcp_world_size", [1, 4])
def test_mamba_align_split_partial_tail_schedule(dcp_world_size: int):
    """Chunk ends with partial hits on: block-aligned chunks, one extra stop
    at the prompt's last hash boundary (registering the partial tail), then
    the remaining tokens. block=512, hash=32, prompt=10000, budget=8192:
    0 -> 8192 -> 9728 -> 9984 -> 10000."""
    block_size = 512
    scheduler_block_size = block_size * dcp_world_size
    hash_block_size = 32
    mock = SimpleNamespace(
        block_size=scheduler_block_size,
        cache_config=SimpleNamespace(block_size=block_size),
        max_num_scheduled_tokens=8192,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        use_eagle_block_drop=False,
        hash_block_size=hash_block_size,
        dcp_world_size=dcp_world_size,
        scheduler_block_size=scheduler_block_size,
        mamba_partial_cache_hit=True,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=False,
    )
    split = Scheduler._mamba_block_aligned_split

    req = make_request("0", [0] * 10000, hash_block_size, sha256)
    req.num_computed_tokens = 0
    assert split(self=mock, request=req, num_new_tokens=8192) == 8192
    req.num_computed_tokens = 8192
    # Stop at the last block boundary (9728).
    assert split(self=mock, request=req, num_new_tokens=1808) == 1536
    req.num_computed_tokens = 9728
    # Extra stop at the prompt's last hash boundary (9984).
    assert split(self=mock, request=req, num_new_tokens=272) == 256
    req.num_computed_tokens = 9984
    # Final 16 tokens run unchanged (no mid-block-resume stop: the next
    # block boundary is past the last block boundary).
    assert split(self=mock, request=req, num_new_tokens=16) == 16

    # Partial hits off: no extra stop, the tail runs in one chunk.
    mock.mamba_partial_cache_hit = False
    req.num_computed_tokens = 9728
    assert split(self=mock, request=req, num_new_tokens=272) == 272
    mock.mamba_partial_cache_hit = True

    # A request resumed mid-block (partial hash hit at 9984): the first chunk
    # stops at the next block boundary (10240), later chunk ends re-align.
    req2 = make_request("1", [0] * 12000, hash_block_size, sha256)
    req2.num_computed_tokens = 9984
    assert req2.num_computed_tokens % scheduler_block_size != 0
    assert split(self=mock, request=req2, num_new_tokens=2016) == 256
    req2.num_computed_tokens = 10240
    assert split(self=mock, request=req2, num_new_tokens=1000) == 512


def test_mamba_align_split_when_block_exceeds_scheduling_budget():
    """Sub-block chunks make progress only when no step can fit a full block."""
    block_size = 11392
    token_budget = 8192
    prompt_length = 30000
    mock = SimpleNamespace(
        block_size=block_size,
        cache_config=SimpleNamespace(block_size=block_size),
        max_num_scheduled_tokens=token_budget,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        use_eagle_block_drop=False,
        hash_block_size=32,
        mamba_partial_cache_hit=False,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=False,
    )
    req = make_request("0", [0] * prompt_length, 32, sha256)
    split = Scheduler._mamba_block_aligned_split

    mock.max_num_scheduled_tokens = block_size
    assert split(self=mock, request=req, num_new_tokens=token_budget) == 0
    mock.max_num_scheduled_tokens = token_budget

    scheduled_chunks = []
    while req.num_computed_tokens < prompt_length:
        num_new_tokens = min(token_budget, prompt_length - req.num_computed_tokens)
        num_scheduled_tokens = split(
            self=mock,
            request=req,
            num_new_tokens=num_new_tokens,
        )
        assert 0 < num_scheduled_tokens <= token_budget
        scheduled_chunks.append(num_scheduled_tokens)
        req.num_computed_tokens += num_scheduled_tokens

    assert scheduled_chunks == [8192, 3200, 8192, 3200, 7216]


def test_mamba_align_split_when_block_exceeds_long_prefill_threshold():
    """A long-prefill cap below the block size permits sub-block progress."""
    block_size = 512
    token_budget = 8192
    long_prefill_threshold = 384
    prompt_length = 1300
    mock = SimpleNamespace(
        block_size=block_size,
        cache_config=SimpleNamespace(block_size=block_size),
        max_num_scheduled_tokens=token_budget,
        scheduler_config=SimpleNamespace(
            long_prefill_token_threshold=long_prefill_threshold
        ),
        use_eagle_block_drop=False,
        hash_block_size=32,
        mamba_partial_cache_hit=False,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=False,
    )
    req = make_request("0", [0] * prompt_length, 32, sha256)
    split = Scheduler._mamba_block_aligned_split

    scheduled_chunks = []
    while req.num_computed_tokens < prompt_length:
        num_new_tokens = min(
            long_prefill_threshold,
            prompt_length - req.num_computed_tokens,
        )
        num_scheduled_tokens = split(
            self=mock,
            request=req,
            num_new_tokens=num_new_tokens,
        )
        assert 0 < num_scheduled_tokens <= long_prefill_threshold
        scheduled_chunks.append(num_scheduled_tokens)
        req.num_computed_tokens += num_scheduled_tokens

    assert scheduled_chunks == [384, 128, 384, 128, 276]


def test_hybrid_mamba_align_partial_hash_hit():
    hash_block_size = 2
    mamba_block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=20,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=mamba_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    blocks = manager.allocate_slots(req0, 6, num_computed, computed_blocks)
    assert blocks is not None
    manager.free(req0)
    manager.new_step_starts()

    partial_mamba_hash = req0.block_hashes[6 // hash_block_size - 1]
    partial_mamba_block = manager.block_pool.get_cached_block(
        partial_mamba_hash, kv_cache_group_ids=[1]
    )
    assert partial_mamba_block is not None
    assert partial_mamba_block[0].block_hash_num_tokens == 6

    req1 = make_request("1", [0, 0, 1, 1, 2, 2, 3, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6
    assert [len(group) for group in computed_blocks.blocks] == [3, 2]

    new_blocks = manager.allocate_slots(req1, 2, num_computed, computed_blocks)
    assert new_blocks is not None
    mamba_new_block_ids = new_blocks.get_block_ids()[1]
    assert len(mamba_new_block_ids) == 1
    assert mamba_new_block_ids[0] != partial_mamba_block[0].block_id
    assert manager.get_blocks("1").get_block_ids()[1][1] == mamba_new_block_ids[0]
    assert partial_mamba_block[0].block_hash is not None
    assert get_block_hash(partial_mamba_block[0].block_hash) == partial_mamba_hash
    assert get_group_id(partial_mamba_block[0].block_hash) == 1
    assert partial_mamba_block[0].block_hash_num_tokens == 6
    copies, _ = manager.take_kv_cache_block_copies()
    assert (
        KVCacheBlockCopy(
            src_block_id=partial_mamba_block[0].block_id,
            dst_block_id=mamba_new_block_ids[0],
        )
        in copies
    )
    assert manager.get_blocks("1").blocks[1][1].block_hash_num_tokens == 8


def test_eagle_group_registers_unaligned_tail_under_partial_hash_hits():
    """An EAGLE group must not re-floor what partial hash hits leaves un-floored.

    ``cache_blocks`` decides once how far a request may be registered, and with
    fine-grained partial hash hits that bound is the raw token count. The EAGLE
    branch then re-derives its own bound for the lookahead block; if it rounds
    down to ``scheduler_block_size`` again, everything between the last aligned
    boundary and the tail stops being registered -- ``(n % scheduler_block_size)
    - manager.block_size`` tokens per call, which is most of a segment whenever
    the group's own block is much smaller than the scheduler block.
    """
    hash_block_size = 2
    mamba_block_size = 4 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=mamba_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    coordinator = manager.coordinator
    assert coordinator.enable_partial_hash_hits
    # The full-attention group is the EAGLE one, and its block is smaller than
    # the scheduler block -- the geometry where re-flooring loses tokens.
    eagle_manager = coordinator.single_type_managers[0]
    eagle_manager.use_eagle = True
    assert eagle_manager.block_size < coordinator.scheduler_block_size

    # Deliberately not a multiple of the scheduler block, so the two bounds
    # differ: floor(22/8)*8 + 2 = 18 against 22.
    num_tokens = coordinator.scheduler_block_size * 2 + hash_block_size * 3
    req = make_request("0", list(range(num_tokens)), hash_block_size, sha256)

    recorded: list[int] = []
    for single_type_manager in coordinator.single_type_managers:
        original = single_type_manager.cache_blocks

        def spy(request, num_tokens_to_cache, *args, _orig=original, **kwargs):
            recorded.append(num_tokens_to_cache)
            return _orig(request, num_tokens_to_cache, *args, **kwargs)

        single_type_manager.cache_blocks = spy

    # allocate_slots caches on the way out, so this exercises the real path.
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, num_tokens, num_computed, computed_blocks)

    # Every group, EAGLE or not, may register the whole unaligned tail.
    assert recorded == [num_tokens] * len(coordinator.single_type_managers)


def test_hybrid_mamba_partial_tail_owner_uses_cow_on_continue():
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None

    partial_mamba_hash = req0.block_hashes[6 // hash_block_size - 1]
    partial_mamba_block = manager.block_pool.get_cached_block(
        partial_mamba_hash, kv_cache_group_ids=[1]
    )
    assert partial_mamba_block is not None
    partial_mamba_block_id = partial_mamba_block[0].block_id
    assert manager.get_blocks("0").get_block_ids()[1][1] == partial_mamba_block_id

    req0.num_computed_tokens = 6
    req0.append_output_token_ids([3])
    new_blocks = manager.allocate_slots(req0, 1)
    assert new_blocks is not None

    # Reversed CoW for the owning request: it keeps its own block (the
    # worker's block table is append-only), and no new mamba block is handed
    # to the worker. The prefix-cache entry is moved to a private copy that
    # the queued block copy fills before the next forward.
    assert new_blocks.get_block_ids()[1] == []
    assert manager.get_blocks("0").get_block_ids()[1][1] == partial_mamba_block_id
    copies, _ = manager.take_kv_cache_block_copies()
    cow_copy = next(c for c in copies if c.src_block_id == partial_mamba_block_id)
    assert cow_copy.dst_block_id != partial_mamba_block_id
    # The source block gave up the hash; the copy target now owns the entry.
    assert partial_mamba_block[0].block_hash is None
    moved = manager.block_pool.get_cached_block(
        partial_mamba_hash, kv_cache_group_ids=[1]
    )
    assert moved is not None
    assert moved[0].block_id == cow_copy.dst_block_id
    assert get_block_hash(moved[0].block_hash) == partial_mamba_hash
    assert get_group_id(moved[0].block_hash) == 1
    assert moved[0].block_hash_num_tokens == 6


def test_partial_hit_then_internal_checkpoint_uses_distinct_mamba_blocks():
    hash_block_size = 2
    mamba_block_size = 4
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=mamba_block_size,
        num_prefill_checkpoint_blocks=1,
    )

    owner = make_request("owner", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(owner)
    assert manager.allocate_slots(owner, 6, num_computed, computed_blocks) is not None
    manager.free(owner)
    manager.new_step_starts()

    partial_hash = owner.block_hashes[2]
    partial_block = manager.block_pool.get_cached_block(partial_hash, [1])
    assert partial_block is not None
    partial_block_id = partial_block[0].block_id

    replay = make_request(
        "replay",
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6],
        hash_block_size,
        sha256,
    )
    computed_blocks, num_computed, _ = manager.get_computed_blocks(replay)
    assert num_computed == 6

    realigned_blocks = manager.allocate_slots(replay, 2, num_computed, computed_blocks)
    assert realigned_blocks is not None
    mamba_cow_block_id = realigned_blocks.get_block_ids()[1][0]
    copies, retained = manager.take_kv_cache_block_copies()
    assert KVCacheBlockCopy(partial_block_id, mamba_cow_block_id) in copies
    manager.block_pool.free_blocks(retained)

    replay.num_computed_tokens = 8
    manager.new_step_starts()
    final_blocks = manager.allocate_slots(replay, 6)
    assert final_blocks is not None

    checkpoint_block_id, running_block_id = final_blocks.get_block_ids()[1]
    assert len({mamba_cow_block_id, checkpoint_block_id, running_block_id}) == 3
    mamba_blocks = manager.get_blocks(replay.request_id).blocks[1]
    assert mamba_blocks[2].block_id == checkpoint_block_id
    assert mamba_blocks[3].block_id == running_block_id


def test_internal_checkpoint_uses_partial_hash_lifecycle():
    hash_block_size = 16
    mamba_block_size = 32
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=mamba_block_size,
        num_prefill_checkpoint_blocks=1,
    )
    request = make_request("producer", list(range(120)), hash_block_size, sha256)

    new_blocks = manager.allocate_slots(request, request.num_tokens)

    assert new_blocks is not None
    mamba_blocks = manager.get_blocks(request.request_id).blocks[1]
    checkpoint_idx = 2
    checkpoint_block = mamba_blocks[checkpoint_idx]
    running_block = mamba_blocks[checkpoint_idx + 1]
    assert not checkpoint_block.is_null
    assert not running_block.is_null
    assert checkpoint_block is not running_block

    # The internal block is exported at state@112, replacing its temporary
    # full-block state@96 key while retaining #52789's req_to_blocks ownership.
    partial_hash = request.block_hashes[112 // hash_block_size - 1]
    partial_hit = manager.block_pool.get_cached_block(partial_hash, [1])
    assert partial_hit is not None
    assert partial_hit[0] is checkpoint_block
    assert checkpoint_block.block_hash_num_tokens == 112
    full_hash = request.block_hashes[96 // hash_block_size - 1]
    assert manager.block_pool.get_cached_block(full_hash, [1]) is None
    assert drain_boundary_state_offloads(manager) == {
        request.request_id: [(1, checkpoint_block.block_id, 112)]
    }

    manager.free(request)
    replay = make_request("replay", list(range(120)), hash_block_size, sha256)
    _, num_computed, _ = manager.get_computed_blocks(replay)
    assert num_computed == 112


@pytest.mark.parametrize("retention_interval", [None, 0, 32, 64, 256])
@pytest.mark.parametrize("hash_block_size", [16, 32])
@pytest.mark.parametrize("use_eagle", [False, True])
def test_internal_checkpoint_publication_respects_retention(
    retention_interval, hash_block_size, use_eagle
):
    """Publish only retained block boundaries and the final prompt checkpoint."""
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=32,
        num_prefill_checkpoint_blocks=1,
        use_eagle=use_eagle,
    )
    manager.coordinator.retention_interval = retention_interval

    request = make_request("producer", list(range(240)), hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(request)

    # The EAGLE adjustment can make a chunk checkpoint block-aligned or partial.
    assert manager.allocate_slots(request, 128, num_computed, computed_blocks)
    checkpoint = (128 if use_eagle else 127) // hash_block_size * hash_block_size - (
        hash_block_size if use_eagle else 0
    )
    retained_checkpoint = checkpoint % 32 == 0 and (
        retention_interval is None
        or (retention_interval > 0 and checkpoint % retention_interval == 0)
    )
    transient_hash = request.block_hashes[checkpoint // hash_block_size - 1]
    transient_hit = manager.block_pool.get_cached_block(transient_hash, [1])
    assert (transient_hit is not None) == retained_checkpoint
    offloads = drain_boundary_state_offloads(manager).get(request.request_id, [])
    assert any(position == checkpoint for _, _, position in offloads) == (
        retained_checkpoint
    )
    assert all(
        position % 32 == 0
        and (
            retention_interval is None
            or (retention_interval > 0 and position % retention_interval == 0)
        )
        for _, _, position in offloads
    )
    if retention_interval in (None, 32, 64):
        retained_hash = request.block_hashes[128 // hash_block_size - 1]
        assert manager.block_pool.get_cached_block(retained_hash, [1]) is not None

    request.num_computed_tokens = 128
    manager.new_step_starts()

    # The final checkpoint is reusable regardless of the retention interval.
    assert manager.allocate_slots(request, 112) is not None
    prompt_checkpoint = (
        240 if use_eagle else 239
    ) // hash_block_size * hash_block_size - (hash_block_size if use_eagle else 0)
    end_hash = request.block_hashes[prompt_checkpoint // hash_block_size - 1]
    assert manager.block_pool.get_cached_block(end_hash, [1]) is not None
    assert any(
        position == prompt_checkpoint
        for _, _, position in drain_boundary_state_offloads(manager).get(
            request.request_id, []
        )
    )


def test_transient_checkpoint_evicts_retained_boundary_hash():
    """With retention_interval=0, the checkpoint slot can coincide with a
    reachable boundary block that this step's full-block pass just hashed.
    The checkpoint state overwrites the slot, so the stale boundary hash
    must be evicted rather than left pointing at the wrong state.
    """
    hash_block_size = 16
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=32,
        num_prefill_checkpoint_blocks=1,
    )
    manager.coordinator.retention_interval = 0

    request = make_request("producer", list(range(240)), hash_block_size, sha256)
    # Block 2 ends at the shared-prefix junction 96, so the full-block pass
    # hashes it as a retained boundary.
    request.shared_prefix_boundary = 96
    computed_blocks, num_computed, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 128, num_computed, computed_blocks)

    # The same slot is the transient checkpoint block (state@112): both the
    # boundary hash and the checkpoint itself must stay unpublished.
    boundary_hash = request.block_hashes[96 // hash_block_size - 1]
    assert manager.block_pool.get_cached_block(boundary_hash, [1]) is None
    checkpoint_hash = request.block_hashes[112 // hash_block_size - 1]
    assert manager.block_pool.get_cached_block(checkpoint_hash, [1]) is None


@pytest.mark.parametrize("prompt_len", [120, 104, 96])
def test_prompt_end_checkpoint_survives_block_aligned_cache_count(prompt_len):
    """At the default match unit the hybrid coordinator hands ``cache_blocks``
    a block-aligned token count, which is below the prompt length whenever the
    prompt is not block-aligned. The prompt-end checkpoint is the replay
    boundary and must stay published under retention_interval=0; only a
    mid-prompt checkpoint is transient.
    """
    hash_block_size = mamba_block_size = 32
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=mamba_block_size,
        num_prefill_checkpoint_blocks=1,
    )
    manager.coordinator.retention_interval = 0
    assert not manager.coordinator.enable_partial_hash_hits

    request = make_request("producer", list(range(prompt_len)), hash_block_size, sha256)
    assert manager.allocate_slots(request, request.num_tokens) is not None
    checkpoint_position = get_mamba_prefill_checkpoint_position(
        prompt_len, hash_block_size, drop_eagle_block=False
    )
    checkpoint_hash = request.block_hashes[checkpoint_position // hash_block_size - 1]
    hit = manager.block_pool.get_cached_block(checkpoint_hash, [1])
    assert hit is not None
    assert hit[0].block_hash_num_tokens == checkpoint_position

    manager.free(request)
    replay = make_request("replay", list(range(prompt_len)), hash_block_size, sha256)
    _, num_computed, _ = manager.get_computed_blocks(replay)
    assert num_computed == checkpoint_position


@pytest.mark.parametrize("retention_interval,reserved", [(None, True), (0, False)])
def test_intermediate_chunk_checkpoint_reserved_only_under_dense_retention(
    retention_interval, reserved
):
    """A checkpoint inside a chunk that does not finish the prefill is only
    publishable under dense retention. With retention_interval=0 it would be
    evicted as transient, so the block is not reserved in the first place;
    the prefill-end checkpoint is reserved either way.
    """
    hash_block_size = 16
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=32,
        num_prefill_checkpoint_blocks=1,
    )
    manager.coordinator.retention_interval = retention_interval
    mamba_manager = manager.coordinator.single_type_managers[1]

    request = make_request("producer", list(range(240)), hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(request)
    free_before = manager.block_pool.get_num_free_blocks()

    # Mid-prompt chunk: the chunk-keyed position (112) is inside it. Blocks:
    # the attention blocks, the running mamba block, plus the checkpoint.
    assert manager.allocate_slots(request, 128, num_computed, computed_blocks)
    assert (request.request_id in mamba_manager._checkpoints) == reserved
    allocated = free_before - manager.block_pool.get_num_free_blocks()
    assert allocated == 128 // hash_block_size + 1 + int(reserved)

    request.num_computed_tokens = 128
    manager.new_step_starts()
    # Final chunk: the prefill-end checkpoint at 224 is reserved either way.
    assert manager.allocate_slots(request, 112) is not None
    assert mamba_manager._checkpoints[request.request_id][0] == 224
    end_hash = request.block_hashes[224 // hash_block_size - 1]
    assert manager.block_pool.get_cached_block(end_hash, [1]) is not None


def test_eagle_block_aligned_checkpoint_replaces_newer_hash():
    hash_block_size = mamba_block_size = 32
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=mamba_block_size,
        use_eagle=True,
        num_speculative_blocks=3,
        num_prefill_checkpoint_blocks=1,
    )
    request = make_request("producer", list(range(104)), hash_block_size, sha256)

    assert manager.allocate_slots(request, request.num_tokens) is not None

    mamba_blocks = manager.get_blocks(request.request_id).blocks[1]
    checkpoint_block = mamba_blocks[2]
    checkpoint_hash = request.block_hashes[64 // hash_block_size - 1]
    checkpoint_hit = manager.block_pool.get_cached_block(checkpoint_hash, [1])
    assert checkpoint_hit is not None
    assert checkpoint_hit[0] is checkpoint_block
    assert checkpoint_block.block_hash_num_tokens == 64

    overwritten_full_hash = request.block_hashes[96 // hash_block_size - 1]
    assert manager.block_pool.get_cached_block(overwritten_full_hash, [1]) is None


def test_hash_aligned_query_end_uses_regular_partial_tail():
    hash_block_size = 2
    mamba_block_size = 4
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=mamba_block_size,
        num_prefill_checkpoint_blocks=1,
    )
    request = make_request("producer", list(range(15)), hash_block_size, sha256)

    new_blocks = manager.allocate_slots(request, 14)

    assert new_blocks is not None
    mamba_manager = manager.coordinator.single_type_managers[1]
    assert request.request_id not in mamba_manager._checkpoints
    mamba_blocks = manager.get_blocks(request.request_id).blocks[1]
    assert sum(not block.is_null for block in mamba_blocks) == 1

    partial_hash = request.block_hashes[14 // hash_block_size - 1]
    cached = manager.block_pool.get_cached_block(partial_hash, [1])
    assert cached is not None
    assert cached[0] is mamba_blocks[14 // mamba_block_size]
    assert cached[0].block_hash_num_tokens == 14


def test_external_mamba_hit_same_block_uses_running_cow_on_continue():
    """An external mid-block hit must become a running request even when its
    first continuation does not need another Mamba block."""
    hash_block_size = 2
    mamba_block_size = 4 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=mamba_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    request = make_request("0", [0] * 15, hash_block_size, sha256)
    loaded_blocks = manager.allocate_slots(
        request,
        num_new_tokens=0,
        num_external_computed_tokens=10,
        delay_cache_blocks=True,
    )
    assert loaded_blocks is not None

    request.num_computed_tokens = 10
    first_step_blocks = manager.allocate_slots(request, num_new_tokens=4)
    assert first_step_blocks is not None

    source_block_id = manager.get_blocks("0").get_block_ids()[1][1]
    partial_hash = request.block_hashes[14 // hash_block_size - 1]
    partial_block = manager.block_pool.get_cached_block(
        partial_hash, kv_cache_group_ids=[1]
    )
    assert partial_block is not None
    assert partial_block[0].block_id == source_block_id

    request.num_computed_tokens = 14
    continuation_blocks = manager.allocate_slots(request, num_new_tokens=1)
    assert continuation_blocks is not None

    assert continuation_blocks.get_block_ids()[1] == []
    assert manager.get_blocks("0").get_block_ids()[1][1] == source_block_id
    copies, _ = manager.take_kv_cache_block_copies()
    cow_copy = next(c for c in copies if c.src_block_id == source_block_id)
    assert cow_copy.dst_block_id != source_block_id

    moved = manager.block_pool.get_cached_block(partial_hash, kv_cache_group_ids=[1])
    assert moved is not None
    assert moved[0].block_id == cow_copy.dst_block_id


def test_boundary_state_offloads_returns_cow_target():
    """Boundary hand-offs expose aligned snapshots and the partial-tail CoW
    target, never the overwritten CoW source."""
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                    num_prefill_checkpoint_blocks=1,
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None

    # The final hash-aligned boundary uses the regular partial-tail path rather
    # than allocating an internal checkpoint at the query end.
    assert drain_boundary_state_offloads(manager) == {}

    partial_mamba_hash = req0.block_hashes[6 // hash_block_size - 1]
    source_block = manager.block_pool.get_cached_block(
        partial_mamba_hash, kv_cache_group_ids=[1]
    )
    assert source_block is not None
    source_block_id = source_block[0].block_id

    # Step B: the producer continues, triggering the CoW X->Y.
    req0.num_computed_tokens = 6
    req0.append_output_token_ids([3])
    assert manager.allocate_slots(req0, 1) is not None

    offloads = drain_boundary_state_offloads(manager)
    assert list(offloads.keys()) == ["0"]
    assert len(offloads["0"]) == 1
    group_id, block_id, boundary_tokens = offloads["0"][0]
    assert group_id == 1  # the mamba group
    assert boundary_tokens == 6
    copies, retained = manager.take_kv_cache_block_copies()
    cow_copy = next(c for c in copies if c.src_block_id == source_block_id)
    # The offload points at the durable CoW target Y, not the overwritten X.
    assert block_id == cow_copy.dst_block_id
    assert block_id != source_block_id
    # Draining clears it.
    assert manager.take_boundary_state_offloads() == {}
    # CoW consumed the producer marker, so finishing cannot emit the same
    # boundary a second time.
    assert manager.finalize_partial_tail_offloads(req0) == []

    manager.block_pool.free_blocks(retained)
    manager.free(req0)


def test_finished_partial_tail_uses_table_source_once():
    """A finish without another allocation hands off the unchanged table block."""
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    source_block_id = manager.get_blocks("0").get_block_ids()[1][1]

    req0.num_computed_tokens = 6
    offloads = manager.finalize_partial_tail_offloads(req0)

    assert offloads == [(1, source_block_id, 6)]
    assert manager.finalize_partial_tail_offloads(req0) == []
    assert manager.take_boundary_state_offloads() == {}

    # A table state that advanced beyond the boundary is unsafe and is
    # consumed without producing a handoff.
    advanced_manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    req1 = make_request("1", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = advanced_manager.get_computed_blocks(req1)
    assert (
        advanced_manager.allocate_slots(req1, 6, num_computed, computed_blocks)
        is not None
    )
    req1.num_computed_tokens = 7
    assert advanced_manager.finalize_partial_tail_offloads(req1) == []
    assert advanced_manager.finalize_partial_tail_offloads(req1) == []


def test_connector_finish_registers_partial_tail_before_cleanup():
    class _Connector(SupportsHMA):
        def register_finished_partial_tail(self, request, block_ids, offloads):
            self.registered = (request, block_ids, offloads)
            return True

        def request_finished_all_groups(self, request, block_ids):
            return False, None

    scheduler = object.__new__(Scheduler)
    scheduler.connector = _Connector()
    scheduler.vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_producer=True)
    )
    scheduler.kv_cache_manager = MagicMock()
    scheduler.kv_cache_manager.finalize_partial_tail_offloads.return_value = [
        (1, 9, 12)
    ]
    scheduler.kv_cache_manager.get_block_ids_for_computed_tokens.return_value = (
        [3],
        [9],
    )
    request = SimpleNamespace(
        request_id="0",
        num_computed_tokens=12,
        num_in_flight_tokens=0,
        num_prompt_tokens=12,
    )

    delay_free, kv_xfer_params = scheduler._connector_finished(request)

    assert delay_free is True
    assert kv_xfer_params is None
    assert scheduler.connector.registered == (
        request,
        ([3], [9]),
        [(1, 9, 12)],
    )
    scheduler.kv_cache_manager.remove_skipped_blocks.assert_called_once()


def test_boundary_state_offload_dropped_when_request_freed_before_drain():
    """A hand-off recorded in the same scheduling pass as the request's death
    must not be drained: its release hook has already run, so draining would
    leak a pinned block."""
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    req0 = make_request("0", [0, 0, 1, 1, 2, 2], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    req0.num_computed_tokens = 6
    req0.append_output_token_ids([3])
    assert manager.allocate_slots(req0, 1) is not None

    # The request dies (preempt/abort) before the scheduler drains.
    manager.block_pool.free_blocks(manager.pop_blocks_for_free(req0))
    assert manager.take_boundary_state_offloads() == {}


def test_boundary_state_offloads_block_aligned_prompt():
    """A prompt ending on a block boundary registers no CoW partial tail; its
    boundary state block is handed off as a snapshot instead (once)."""
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    # 4-token prompt ends exactly on the mamba block boundary (block_size=4).
    req0 = make_request("0", [0, 0, 1, 1], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 4, num_computed, computed_blocks) is not None
    mamba_blocks = manager.coordinator.single_type_managers[1].req_to_blocks["0"]
    ((group_id, block_id, boundary),) = drain_boundary_state_offloads(manager)["0"]
    assert group_id == 1
    assert boundary == block_size
    assert block_id == mamba_blocks[0].block_id

    req0.num_computed_tokens = 4
    req0.append_output_token_ids([2])
    assert manager.allocate_slots(req0, 1) is not None
    # The boundary was already handed off; decoding emits nothing new.
    assert manager.take_boundary_state_offloads() == {}


def test_truncate_computed_blocks_preserves_sparse_prefix_positions():
    """truncate_computed_blocks slices each group by its own block size,
    keeps null placeholders in the retained prefix, and leaves the original
    lookup result untouched (pure view, no refcount changes)."""
    hash_block_size = 2
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=2 * hash_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    producer = make_request("producer", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    blocks, num_computed, _ = manager.get_computed_blocks(producer)
    assert manager.allocate_slots(producer, 6, num_computed, blocks) is not None
    manager.free(producer)
    manager.new_step_starts()

    consumer = make_request(
        "consumer", [0, 0, 1, 1, 2, 2, 3, 3], hash_block_size, sha256
    )
    blocks, num_computed, _ = manager.get_computed_blocks(consumer)
    assert num_computed == 6
    assert [len(group) for group in blocks.blocks] == [3, 2]
    assert blocks.blocks[1][0].is_null

    truncated = manager.truncate_computed_blocks(blocks, 4)

    assert [len(group) for group in truncated.blocks] == [2, 1]
    assert truncated.blocks[1][0].is_null
    assert [len(group) for group in blocks.blocks] == [3, 2]


def test_truncate_computed_blocks_allows_short_mamba_group_only():
    """External state may replace a short Mamba hit, but other groups must
    cover the aligned local endpoint."""
    hash_block_size = 2
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=2 * hash_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    producer = make_request("producer", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    blocks, num_computed, _ = manager.get_computed_blocks(producer)
    assert manager.allocate_slots(producer, 6, num_computed, blocks) is not None
    manager.free(producer)
    manager.new_step_starts()

    consumer = make_request(
        "consumer", [0, 0, 1, 1, 2, 2, 3, 3], hash_block_size, sha256
    )
    blocks, num_computed, _ = manager.get_computed_blocks(consumer)
    assert num_computed == 6
    assert [len(group) for group in blocks.blocks] == [3, 2]

    short_mamba = manager.create_kv_cache_blocks((list(blocks.blocks[0]), []))
    truncated = manager.truncate_computed_blocks(short_mamba, 4)
    assert [len(group) for group in truncated.blocks] == [2, 0]

    short_full_attention = manager.create_kv_cache_blocks(
        (list(blocks.blocks[0][:1]), list(blocks.blocks[1]))
    )
    with pytest.raises(AssertionError):
        manager.truncate_computed_blocks(short_full_attention, 4)

    with pytest.raises(AssertionError):
        manager.truncate_computed_blocks(blocks, 6)

    # The lookup result itself is never mutated.
    assert [len(group) for group in blocks.blocks] == [3, 2]


def test_hybrid_mamba_partial_tail_owner_continue_preserves_later_hit():
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None

    partial_mamba_hash = req0.block_hashes[6 // hash_block_size - 1]
    partial_mamba_block = manager.block_pool.get_cached_block(
        partial_mamba_hash, kv_cache_group_ids=[1]
    )
    assert partial_mamba_block is not None
    partial_mamba_block_id = partial_mamba_block[0].block_id

    req0.num_computed_tokens = 6
    req0.append_output_token_ids([3])
    assert manager.allocate_slots(req0, 1) is not None
    # The owner moved the prefix-cache entry to a private copy; capture its id.
    owner_copies, _ = manager.take_kv_cache_block_copies()
    cow_copy = next(c for c in owner_copies if c.src_block_id == partial_mamba_block_id)
    moved_block_id = cow_copy.dst_block_id
    manager.new_step_starts()

    req1 = make_request("1", [0, 0, 1, 1, 2, 2, 4, 4], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6
    # The later request hits the moved (private-copy) entry, not the source.
    assert computed_blocks.get_block_ids()[1][1] == moved_block_id

    new_blocks = manager.allocate_slots(req1, 2, num_computed, computed_blocks)
    assert new_blocks is not None
    mamba_new_block_ids = new_blocks.get_block_ids()[1]
    assert len(mamba_new_block_ids) == 1
    assert mamba_new_block_ids[0] != moved_block_id
    # The hitting request CoWs from the moved entry into its own private block.
    copies, _ = manager.take_kv_cache_block_copies()
    assert (
        KVCacheBlockCopy(
            src_block_id=moved_block_id,
            dst_block_id=mamba_new_block_ids[0],
        )
        in copies
    )


def test_hybrid_mamba_moved_partial_entry_defers_same_step_hit():
    """The owner's move re-arms the same-step guard: the moved entry is
    filled by this step's copy, and chained same-step copies read stale
    sources, so a request hitting it in the move step must be deferred."""
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    manager.new_step_starts()

    # The owning request continues decoding: the partial entry moves to a
    # private copy in this step.
    req0.num_computed_tokens = 6
    req0.append_output_token_ids([3])
    assert manager.allocate_slots(req0, 1) is not None

    # A request hitting the moved entry in the SAME step must be deferred.
    req1 = make_request("1", [0, 0, 1, 1, 2, 2, 4, 4], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6
    assert manager.allocate_slots(req1, 2, num_computed, computed_blocks) is None

    # Next step the moved entry is consumable.
    manager.new_step_starts()
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6
    assert manager.allocate_slots(req1, 2, num_computed, computed_blocks) is not None


def test_hybrid_full_attention_partial_hash_hit_uses_cow():
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    manager.free(req0)
    manager.new_step_starts()

    partial_full_hash = req0.block_hashes[6 // hash_block_size - 1]
    partial_full_block = manager.block_pool.get_cached_block(
        partial_full_hash, kv_cache_group_ids=[0]
    )
    assert partial_full_block is not None

    req1 = make_request("1", [0, 0, 1, 1, 2, 2, 3, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6
    assert [len(group) for group in computed_blocks.blocks] == [2, 2]

    new_blocks = manager.allocate_slots(req1, 2, num_computed, computed_blocks)
    assert new_blocks is not None
    full_new_block_ids = new_blocks.get_block_ids()[0]
    assert len(full_new_block_ids) == 1
    assert full_new_block_ids[0] != partial_full_block[0].block_id
    assert partial_full_block[0].block_hash is not None
    assert get_block_hash(partial_full_block[0].block_hash) == partial_full_hash
    assert get_group_id(partial_full_block[0].block_hash) == 0
    assert partial_full_block[0].block_hash_num_tokens == 6
    copies, retained = manager.take_kv_cache_block_copies()
    assert (
        KVCacheBlockCopy(
            src_block_id=partial_full_block[0].block_id,
            dst_block_id=full_new_block_ids[0],
        )
        in copies
    )
    assert partial_full_block[0].ref_cnt == 1
    manager.block_pool.free_blocks(retained)
    assert partial_full_block[0].ref_cnt == 0


def test_hybrid_partial_hit_cow_target_starts_uncached():
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    manager.free(req0)
    manager.new_step_starts()

    partial_hash = req0.block_hashes[6 // hash_block_size - 1]
    partial_full_block = manager.block_pool.get_cached_block(
        partial_hash, kv_cache_group_ids=[0]
    )
    partial_mamba_block = manager.block_pool.get_cached_block(
        partial_hash, kv_cache_group_ids=[1]
    )
    assert partial_full_block is not None
    assert partial_mamba_block is not None

    req1 = make_request("1", [0, 0, 1, 1, 2, 2, 3, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6

    new_blocks = manager.allocate_slots(
        req1,
        2,
        num_computed,
        computed_blocks,
        delay_cache_blocks=True,
    )
    assert new_blocks is not None

    full_cow_block = manager.get_blocks("1").blocks[0][1]
    mamba_cow_block = manager.get_blocks("1").blocks[1][1]
    assert full_cow_block.block_id != partial_full_block[0].block_id
    assert mamba_cow_block.block_id != partial_mamba_block[0].block_id
    assert full_cow_block.block_hash is None
    assert full_cow_block.block_hash_num_tokens is None
    assert mamba_cow_block.block_hash is None
    assert mamba_cow_block.block_hash_num_tokens is None

    assert partial_full_block[0].block_hash is not None
    assert get_block_hash(partial_full_block[0].block_hash) == partial_hash
    assert get_group_id(partial_full_block[0].block_hash) == 0
    assert partial_full_block[0].block_hash_num_tokens == 6
    assert partial_mamba_block[0].block_hash is not None
    assert get_block_hash(partial_mamba_block[0].block_hash) == partial_hash
    assert get_group_id(partial_mamba_block[0].block_hash) == 1
    assert partial_mamba_block[0].block_hash_num_tokens == 6


def test_hybrid_partial_hash_truncates_full_attention_hit_length():
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    pool = manager.block_pool
    req = make_request(
        "0",
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5],
        hash_block_size,
        sha256,
    )

    full_blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(
        request=req,
        blocks=full_blocks,
        num_cached_blocks=0,
        num_full_blocks=2,
        block_size=block_size,
        kv_cache_group_id=0,
    )
    pool.cache_partial_block(
        request=req,
        block=full_blocks[2],
        num_tokens=10,
        kv_cache_group_id=0,
        block_size=block_size,
    )

    mamba_block = pool.get_new_blocks(1)[0]
    pool.cache_partial_block(
        request=req,
        block=mamba_block,
        num_tokens=6,
        kv_cache_group_id=1,
        block_size=block_size,
    )

    computed_blocks, num_computed, _ = manager.get_computed_blocks(req)
    assert num_computed == 6
    assert [len(group) for group in computed_blocks.blocks] == [2, 2]


def test_cow_retained_blocks_returned_for_release():
    """new_step_starts returns the CoW copy retentions instead of freeing
    them; the scheduler owns releasing them once the copy has run."""
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None

    # The owner's move queues a copy and retains both endpoints.
    req0.num_computed_tokens = 6
    req0.append_output_token_ids([3])
    assert manager.allocate_slots(req0, 1) is not None
    (cow_copy,), retained = manager.take_kv_cache_block_copies()
    assert {b.block_id for b in retained} == {
        cow_copy.src_block_id,
        cow_copy.dst_block_id,
    }
    # Not freed yet: the retention refs are still held.
    assert all(b.ref_cnt > 0 for b in retained)
    manager.block_pool.free_blocks(retained)


def test_free_cow_retained_blocks_defers_until_copy_step_processed():
    """Scheduler releases CoW retentions immediately when the copy's step has
    been processed (or deferral is off), and defers them otherwise."""
    from collections import deque

    freed: list = []
    blocks = [SimpleNamespace(block_id=7), SimpleNamespace(block_id=9)]
    mock = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(
            block_pool=SimpleNamespace(free_blocks=freed.extend)
        ),
        deferred_frees=deque(),
        defer_block_free=True,
        processed_step_seq=2,
    )
    free = Scheduler._free_cow_retained_blocks

    # Copy step still in flight: deferred with its fence.
    free(mock, list(blocks), fence_seq=3)
    assert not freed
    assert mock.deferred_frees == deque([(3, blocks[::-1])])

    # Copy step processed: freed immediately.
    mock.processed_step_seq = 3
    free(mock, list(blocks), fence_seq=3)
    assert freed == blocks

    # Deferral disabled: freed immediately regardless of the fence.
    freed.clear()
    mock.deferred_frees.clear()
    mock.defer_block_free = False
    mock.processed_step_seq = 0
    free(mock, list(blocks), fence_seq=3)
    assert freed == blocks


def test_full_attention_eagle_drops_one_hash_unit():
    """With fine-grained partial hits, eagle rewinds the hit by one hash unit
    instead of a whole cache block: the tail block's KV is append-only, so it
    still covers the reduced length and stays in the hit as a partial block."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    hash_block_size = 2
    block_size = 4
    pool = BlockPool(
        num_gpu_blocks=10, enable_caching=True, hash_block_size=hash_block_size
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    req = make_request("0", [0, 0, 1, 1, 2, 2, 3, 3], hash_block_size, sha256)

    def find(drop_eagle_block):
        return FullAttentionManager.find_longest_cache_hit(
            block_hashes=req.block_hashes,
            max_length=8,
            kv_cache_group_ids=[0],
            block_pool=pool,
            kv_cache_spec=spec,
            drop_eagle_block=drop_eagle_block,
            alignment_tokens=hash_block_size,
        )

    # Two full cached blocks (hit 8): eagle rewinds to 6, keeping the last
    # block as a partial hit instead of dropping it to 4.
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(
        request=req,
        blocks=blocks,
        num_cached_blocks=0,
        num_full_blocks=2,
        block_size=block_size,
        kv_cache_group_id=0,
    )
    hit_blocks, hit_length = find(drop_eagle_block=False)
    assert (hit_length, len(hit_blocks[0])) == (8, 2)
    hit_blocks, hit_length = find(drop_eagle_block=True)
    assert (hit_length, len(hit_blocks[0])) == (6, 2)

    # A partial tail at 6 (block 1 not fully cached): eagle rewinds to the
    # block boundary and trims the tail block.
    pool2 = BlockPool(
        num_gpu_blocks=10, enable_caching=True, hash_block_size=hash_block_size
    )
    pool = pool2
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(
        request=req,
        blocks=blocks[:1],
        num_cached_blocks=0,
        num_full_blocks=1,
        block_size=block_size,
        kv_cache_group_id=0,
    )
    assert (
        pool.cache_partial_block(
            request=req,
            block=blocks[1],
            num_tokens=6,
            kv_cache_group_id=0,
            block_size=block_size,
        )
        is not None
    )
    hit_blocks, hit_length = find(drop_eagle_block=False)
    assert (hit_length, len(hit_blocks[0])) == (6, 2)
    hit_blocks, hit_length = find(drop_eagle_block=True)
    assert (hit_length, len(hit_blocks[0])) == (4, 1)


def test_hybrid_partial_hit_with_eagle_stays_within_group_blocks():
    """Regression: with eagle, the mamba group must not receive the eagle
    lookup margin — its finder never applies the drop, so it could return a
    hit past the blocks the (dropped) full-attention group covers, crashing
    the consumer's CoW with block_idx >= len(req_blocks)."""
    hash_block_size = 2
    block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
        use_eagle=True,
    )

    # The owner prefills in scheduler-split style: stop at the block boundary
    # (4), then at the prompt's last hash boundary (6, partial entries).
    req0 = make_request("0", [7] * 6, hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 4, num_computed, computed_blocks) is not None
    req0.num_computed_tokens = 4
    manager.new_step_starts()
    assert manager.allocate_slots(req0, 2) is not None
    req0.num_computed_tokens = 6
    manager.new_step_starts()

    # A longer request with eagle: full attention drops the partial tail, so
    # the joint hit must fall back to the block boundary the FA blocks cover.
    req1 = make_request("1", [7] * 6 + [9] * 2, hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 4
    assert all(
        len(group) * block_size >= num_computed for group in computed_blocks.blocks
    )
    assert manager.allocate_slots(req1, 4, num_computed, computed_blocks) is not None


def test_mamba_align_split_stops_below_eagle_proof_boundary():
    """The chunk that registers the partial tail must end one hash unit below
    the prompt's last hash boundary under Eagle, which drops one unit past the
    candidate.
    """
    block_size = 1536
    hash_block_size = 128
    mock = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size),
        max_num_scheduled_tokens=8192,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        use_eagle=True,
        use_eagle_block_drop=True,
        hash_block_size=hash_block_size,
        mamba_partial_cache_hit=True,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=False,
    )
    split = Scheduler._mamba_block_aligned_split

    for prompt_len in (24576, 24577):
        req = make_request("0", [0] * prompt_len, hash_block_size, sha256)
        req.num_computed_tokens = 23040
        assert (
            split(self=mock, request=req, num_new_tokens=prompt_len - 23040)
            == 24448 - 23040
        )

    # Without the eagle block drop the tail stays at the prompt's own last hash
    # boundary -- the shift exists only to compensate for the drop, so it keys
    # on use_eagle_block_drop rather than plain use_eagle.
    mock.use_eagle_block_drop = False
    req = make_request("1", [0] * 24577, hash_block_size, sha256)
    req.num_computed_tokens = 23040
    assert split(self=mock, request=req, num_new_tokens=1537) == 24576 - 23040


def test_mamba_partial_tail_hits_below_eagle_proof_boundary():
    """Regression: a prompt whose last hash boundary coincides with its last
    mamba block boundary registered its only fine-grained checkpoint at a
    position Eagle can never resume from, collapsing the next turn to the
    coarse block boundary (or, under sparse retention, to a full miss).
    """
    hash_block_size = 2
    mamba_block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=mamba_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
        use_eagle=True,
    )

    # 9 tokens: the last hash boundary (8) is also a mamba block boundary, so
    # the prompt's two checkpoints collapse. The reachable tail is 6.
    req0 = make_request("0", [7] * 9, hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    req0.num_computed_tokens = 6
    manager.new_step_starts()
    assert manager.allocate_slots(req0, 3) is not None
    req0.num_computed_tokens = 9
    manager.new_step_starts()

    partial_hash = req0.block_hashes[6 // hash_block_size - 1]
    partial_block = manager.block_pool.get_cached_block(
        partial_hash, kv_cache_group_ids=[1]
    )
    assert partial_block is not None
    assert partial_block[0].block_hash_num_tokens == 6

    # Full attention matches to 8 and drops one hash unit to 6, where the
    # mamba tail now exists -- instead of falling back to the block boundary 4.
    req1 = make_request("1", [7] * 9 + [9] * 4, hash_block_size, sha256)
    _, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6


def test_mamba_coarse_checkpoint_retained_below_eagle_proof_boundary():
    """Without a prefix-match unit there is no partial tail, so the only
    checkpoint comes from the retention mask. A prompt ending just past its
    last block boundary pinned that checkpoint where eagle can never resume,
    so under ``retention_interval=0`` the reachable block was masked out and
    the next turn missed entirely.
    """
    block_size = 4
    kv_cache_config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
        prefix_cache_retention_interval=0,
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=block_size,
        use_eagle=True,
    )

    # 9 tokens: the last aligned boundary is 8, which eagle cannot resume
    # from, so block 0 (ending at 4) must stay retained. Prefill in
    # scheduler-split style -- Mamba keeps one rolling state, so a boundary is
    # only materialized by a chunk that ends exactly on it.
    req0 = make_request("0", [7] * 9, block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert num_computed == 0
    assert manager.allocate_slots(req0, 4, num_computed, computed_blocks) is not None
    req0.num_computed_tokens = 4
    manager.new_step_starts()
    assert manager.allocate_slots(req0, 5) is not None
    req0.num_computed_tokens = 9
    manager.free(req0)
    manager.new_step_starts()

    # The reachable state (4) is retained; the unreachable one (8) is not.
    assert (
        manager.block_pool.get_cached_block(
            req0.block_hashes[0], kv_cache_group_ids=[1]
        )
        is not None
    )

    req1 = make_request("1", [7] * 9 + [9] * 4, block_size, sha256)
    _, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 4


def test_hybrid_sliding_window_group_disables_partial_hash_hits():
    hash_block_size = 2
    sliding_window_block_size = 2 * hash_block_size
    mamba_block_size = 2 * sliding_window_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=mamba_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
            KVCacheGroupSpec(
                ["swa_draft"],
                SlidingWindowSpec(
                    block_size=sliding_window_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                    sliding_window=sliding_window_block_size,
                ),
                is_eagle_group=True,
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
        use_eagle=True,
    )

    tokens = list(range(3 * sliding_window_block_size))
    request = make_request("0", tokens, hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(request)
    assert not manager.coordinator.enable_partial_hash_hits
    assert (
        manager.allocate_slots(request, mamba_block_size, num_computed, computed_blocks)
        is not None
    )
    request.num_computed_tokens = mamba_block_size
    manager.new_step_starts()
    assert manager.allocate_slots(request, len(tokens) - mamba_block_size) is not None
    request.num_computed_tokens = len(tokens)
    manager.free(request)
    manager.new_step_starts()

    cached_request = make_request(
        "1", tokens + [len(tokens), len(tokens) + 1], hash_block_size, sha256
    )
    computed_blocks, num_computed, _ = manager.get_computed_blocks(cached_request)

    assert num_computed == mamba_block_size
    assert len(computed_blocks.blocks[0]) * hash_block_size == num_computed


@pytest.mark.parametrize("with_sliding_window", [False, True])
def test_resolved_cache_hit_alignment_matches_coordinator(with_sliding_window):
    """Workers place Mamba checkpoints on the engine-resolved alignment, so it
    must be where the coordinator lands hits, including when a group without
    fine-grained lookups disables partial hits."""
    hash_block_size = 2
    mamba_block_size = 4 * hash_block_size
    kv_cache_groups = [
        KVCacheGroupSpec(
            ["full"],
            FullAttentionSpec(
                block_size=hash_block_size,
                num_kv_heads=1,
                head_size=1,
                dtype=torch.float32,
            ),
        ),
        KVCacheGroupSpec(
            ["mamba"],
            MambaSpec(
                block_size=mamba_block_size,
                shapes=(1, 1),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
            ),
        ),
    ]
    if with_sliding_window:
        kv_cache_groups.append(
            KVCacheGroupSpec(
                ["swa"],
                SlidingWindowSpec(
                    block_size=2 * hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                    sliding_window=2 * hash_block_size,
                ),
            )
        )
    kv_cache_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups
    )
    coordinator = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    ).coordinator
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )

    assert coordinator.enable_partial_hash_hits != with_sliding_window
    assert (
        resolve_cache_hit_alignment_tokens(
            kv_cache_config,
            vllm_config,
            coordinator.scheduler_block_size,
            hash_block_size,
        )
        == coordinator._cache_hit_alignment_tokens
    )


def test_opted_out_scratch_group_keeps_partial_hash_hits():
    hash_block_size = 2
    mamba_block_size = 2 * hash_block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=mamba_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
            KVCacheGroupSpec(
                ["tail"],
                CircularBufferSpec(
                    block_size=mamba_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    assert manager.coordinator.enable_partial_hash_hits

    req0 = make_request("0", [0, 0, 1, 1, 2, 2, 3], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    manager.free(req0)
    manager.new_step_starts()

    req1 = make_request("1", [0, 0, 1, 1, 2, 2, 3, 3], hash_block_size, sha256)
    _, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6


def test_kpool_tail_supports_128_token_partial_hash_hits():
    hash_block_size = 128
    cache_block_size = 9 * hash_block_size
    kpool_block_size = 64
    kv_cache_config = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=cache_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=cache_block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
            KVCacheGroupSpec(
                ["tail"],
                CircularBufferSpec(
                    block_size=kpool_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
        ],
    )
    manager = make_kv_cache_manager(
        kv_cache_config=kv_cache_config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )

    assert manager.coordinator.scheduler_block_size == cache_block_size
    assert manager.coordinator.hash_block_size == hash_block_size
    assert manager.coordinator.enable_partial_hash_hits

    shared_prefix = [10] * (12 * hash_block_size)
    req0 = make_request("0", shared_prefix + [11], hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert (
        manager.allocate_slots(req0, len(shared_prefix), num_computed, computed_blocks)
        is not None
    )
    manager.free(req0)
    manager.new_step_starts()

    req1 = make_request("1", shared_prefix + [12] * 64, hash_block_size, sha256)
    _, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == len(shared_prefix)


@pytest.mark.parametrize("dcp_world_size", [1, 2, 4])
def test_hybrid_partial_hash_hit_uses_cow_under_dcp(dcp_world_size: int):
    hash_block_size = 2
    physical_block_size = 4
    manager = make_full_mamba_manager(
        dcp_world_size=dcp_world_size,
        hash_block_size=hash_block_size,
        full_block_size=physical_block_size,
        mamba_block_size=physical_block_size,
    )
    assert manager.coordinator.enable_partial_hash_hits

    req0 = make_request("dcp-owner", [0, 0, 1, 1, 2, 2, 3], 2, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 6, num_computed, computed_blocks) is not None
    manager.free(req0)
    manager.new_step_starts()

    partial_hash = req0.block_hashes[2]
    partial_full_block = manager.block_pool.get_cached_block(partial_hash, [0])
    partial_mamba_block = manager.block_pool.get_cached_block(partial_hash, [1])
    assert partial_full_block is not None
    assert partial_mamba_block is not None

    req1 = make_request("dcp-replay", [0, 0, 1, 1, 2, 2, 3, 3], 2, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 6
    full_block_size = physical_block_size * dcp_world_size
    assert [len(group) for group in computed_blocks.blocks] == [
        (6 + full_block_size - 1) // full_block_size,
        2,
    ]

    new_blocks = manager.allocate_slots(req1, 2, num_computed, computed_blocks)
    assert new_blocks is not None
    full_new_block_id = new_blocks.get_block_ids()[0][0]
    mamba_new_block_id = new_blocks.get_block_ids()[1][0]
    copies, retained = manager.take_kv_cache_block_copies()
    assert KVCacheBlockCopy(partial_full_block[0].block_id, full_new_block_id) in copies
    assert (
        KVCacheBlockCopy(partial_mamba_block[0].block_id, mamba_new_block_id) in copies
    )
    manager.block_pool.free_blocks(retained)


@pytest.mark.parametrize("dcp_world_size", [2, 4])
def test_dcp_partial_hit_resumes_on_replicated_mamba_snapshot(
    dcp_world_size: int,
):
    block_size = 4
    manager = make_full_mamba_manager(
        dcp_world_size=dcp_world_size,
        hash_block_size=block_size,
        full_block_size=block_size,
        mamba_block_size=block_size,
    )
    assert manager.coordinator.enable_partial_hash_hits
    assert manager.coordinator._cache_hit_alignment_tokens == block_size
    assert manager.coordinator.single_type_managers[0].block_size == (
        block_size * dcp_world_size
    )
    assert manager.coordinator.single_type_managers[1].block_size == block_size

    prefix = list(range(12))
    req0 = make_request("snapshot-owner", prefix + [12], block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 12, num_computed, computed_blocks) is not None
    manager.free(req0)
    manager.new_step_starts()

    req1 = make_request(
        "snapshot-replay", prefix + list(range(12, 16)), block_size, sha256
    )

    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 12
    assert [len(group) for group in computed_blocks.blocks] == [
        (12 + block_size * dcp_world_size - 1) // (block_size * dcp_world_size),
        3,
    ]
    partial_full_block = computed_blocks.blocks[0][-1]
    new_blocks = manager.allocate_slots(req1, 4, num_computed, computed_blocks)
    assert new_blocks is not None
    full_new_block_id = new_blocks.get_block_ids()[0][0]
    copies, retained = manager.take_kv_cache_block_copies()
    assert KVCacheBlockCopy(partial_full_block.block_id, full_new_block_id) in copies
    assert all(
        copy.src_block_id != computed_blocks.blocks[1][-1].block_id for copy in copies
    )
    manager.block_pool.free_blocks(retained)


def test_dcp_joint_hit_is_bounded_by_replicated_mamba_snapshots():
    block_size = 4
    manager = make_full_mamba_manager(
        dcp_world_size=2,
        hash_block_size=block_size,
        full_block_size=block_size,
        mamba_block_size=block_size,
    )
    prefix = list(range(12))
    req0 = make_request("joint-owner", prefix + [12], block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 8, num_computed, computed_blocks) is not None
    manager.new_step_starts()

    replay_tokens = prefix + list(range(12, 16))
    req1 = make_request("joint-before", replay_tokens, block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 8
    assert [len(group) for group in computed_blocks.blocks] == [1, 2]

    req0.num_computed_tokens = 8
    assert manager.allocate_slots(req0, 4) is not None
    manager.new_step_starts()

    req2 = make_request("joint-after", replay_tokens, block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req2)
    assert num_computed == 12
    assert [len(group) for group in computed_blocks.blocks] == [2, 3]


def test_dcp_partial_hit_with_eagle_rewinds_one_hash_unit():
    hash_block_size = 2
    manager = make_full_mamba_manager(
        dcp_world_size=2,
        hash_block_size=hash_block_size,
        full_block_size=4,
        mamba_block_size=4,
        use_eagle=True,
    )

    req0 = make_request("eagle-owner", [7] * 6, hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 4, num_computed, computed_blocks) is not None
    req0.num_computed_tokens = 4
    manager.new_step_starts()
    assert manager.allocate_slots(req0, 2) is not None
    req0.num_computed_tokens = 6
    manager.new_step_starts()

    req1 = make_request("eagle-replay", [7] * 6 + [9] * 2, 2, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req1)
    assert num_computed == 4
    assert [len(group) for group in computed_blocks.blocks] == [1, 1]
    assert manager.allocate_slots(req1, 4, num_computed, computed_blocks) is not None


def _snapshot_offload_kv_cache_config(
    hash_block_size: int, block_size: int, num_blocks: int = 24
):
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["full"],
                FullAttentionSpec(
                    block_size=hash_block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=block_size,
                    shapes=(1, 1),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
    )


def test_retention_snapshots_handed_off_with_exact_block_ids():
    """Under sparse retention, each retained mamba boundary state block is
    handed to the connector with its exact block id. Connectors must not resolve
    align-mode state blocks positionally because the block table is not
    append-only."""
    hash_block_size = 2
    block_size = 4
    manager = make_kv_cache_manager(
        kv_cache_config=_snapshot_offload_kv_cache_config(hash_block_size, block_size),
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    manager.coordinator.retention_interval = 2 * block_size

    req0 = make_request("0", [0] * 16, hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 8, num_computed, computed_blocks) is not None

    mamba_blocks = manager.coordinator.single_type_managers[1].req_to_blocks["0"]
    offloads = drain_boundary_state_offloads(manager)
    ((group_id, block_id, boundary),) = offloads["0"]
    assert group_id == 1
    assert boundary == 2 * block_size
    assert block_id == mamba_blocks[1].block_id

    req0.num_computed_tokens = 8
    manager.new_step_starts()
    assert manager.allocate_slots(req0, 8) is not None

    offloads = drain_boundary_state_offloads(manager)
    ((group_id, block_id2, boundary2),) = offloads["0"]
    assert group_id == 1
    assert boundary2 == 4 * block_size
    assert block_id2 == mamba_blocks[3].block_id
    # Interior align-mode positions stay null and are never handed off.
    assert mamba_blocks[0].is_null and mamba_blocks[2].is_null

    manager.free(req0)


def test_snapshot_handoff_dense_default_retention():
    """With dense (default) retention, every materialized mamba boundary
    state block is handed off — regular mamba-align + prefix-match-unit
    deployments get store-able boundary snapshots without setting a
    prefix-cache retention interval."""
    hash_block_size = 2
    block_size = 4
    manager = make_kv_cache_manager(
        kv_cache_config=_snapshot_offload_kv_cache_config(hash_block_size, block_size),
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=hash_block_size,
    )
    assert manager.coordinator.retention_interval is None

    req0 = make_request("0", [0] * 16, hash_block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, 8, num_computed, computed_blocks) is not None

    mamba_blocks = manager.coordinator.single_type_managers[1].req_to_blocks["0"]
    ((group_id, block_id, boundary),) = drain_boundary_state_offloads(manager)["0"]
    assert group_id == 1
    assert boundary == 2 * block_size
    assert block_id == mamba_blocks[1].block_id

    req0.num_computed_tokens = 8
    manager.new_step_starts()
    assert manager.allocate_slots(req0, 8) is not None
    ((group_id, block_id2, boundary2),) = drain_boundary_state_offloads(manager)["0"]
    assert group_id == 1
    assert boundary2 == 4 * block_size
    assert block_id2 == mamba_blocks[3].block_id


def _run_chunked_prefill(manager, req, chunk_size, num_chunks):
    """Prefill ``req`` one ``chunk_size`` chunk per scheduler step, yielding the
    boundary-state hand-offs offered (and claimed) at each step."""
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req)
    for step in range(num_chunks):
        manager.new_step_starts()
        req.num_computed_tokens = step * chunk_size
        if step == 0:
            allocated = manager.allocate_slots(
                req, chunk_size, num_computed, computed_blocks
            )
        else:
            allocated = manager.allocate_slots(req, chunk_size)
        assert allocated is not None
        yield drain_boundary_state_offloads(manager).get(req.request_id, [])


def test_boundary_state_offer_includes_more_mamba_groups_than_two():
    """One offer batch carries one exact block entry per mamba group."""
    block_size = 8
    num_mamba_groups = 3
    manager = make_kv_cache_manager(
        kv_cache_config=KVCacheConfig(
            num_blocks=200,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["full"],
                    FullAttentionSpec(
                        block_size=block_size,
                        num_kv_heads=1,
                        head_size=1,
                        dtype=torch.float32,
                    ),
                ),
                *(
                    KVCacheGroupSpec(
                        [f"mamba{i}"],
                        MambaSpec(
                            block_size=block_size,
                            shapes=(1, 1),
                            dtypes=(torch.float32,),
                            mamba_cache_mode="align",
                        ),
                    )
                    for i in range(num_mamba_groups)
                ),
            ],
        ),
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=block_size,
    )

    req0 = make_request("0", [0] * (2 * block_size), block_size, sha256)
    entries = next(_run_chunked_prefill(manager, req0, block_size, 1))

    assert [group_id for group_id, _, _ in entries] == [1, 2, 3]
    assert {boundary for _, _, boundary in entries} == {block_size}


def test_boundary_states_offered_past_prompt_for_resumed_prefill():
    """The core offers every committed boundary, including past
    ``num_prompt_tokens``. A resumed request re-prefills its generated tokens
    and every group re-saves them, so filtering on the original prompt length
    would silently strip the mamba key for boundaries full attention still
    stores; only the connector knows where its save window ends."""
    block_size = 8
    prompt_len = block_size
    manager = make_kv_cache_manager(
        kv_cache_config=_snapshot_offload_kv_cache_config(
            hash_block_size=block_size, block_size=block_size, num_blocks=200
        ),
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=block_size,
    )

    req0 = make_request("0", [0] * prompt_len, block_size, sha256)
    assert [
        boundary
        for entries in _run_chunked_prefill(manager, req0, block_size, 1)
        for _, _, boundary in entries
    ] == [prompt_len]

    # Generate past the next mamba boundary, then replay it as a resumed
    # prefill: its committed boundary is offered even though it is past the
    # prompt, matching what full attention saves for the same range.
    for i in range(block_size):
        manager.new_step_starts()
        req0.num_computed_tokens = prompt_len + i
        req0.append_output_token_ids([1])
        assert manager.allocate_slots(req0, 1) is not None
        drain_boundary_state_offloads(manager)
    assert req0.num_tokens == 2 * block_size

    manager.free(req0)
    manager.new_step_starts()
    req0.num_computed_tokens = 0
    computed_blocks, num_computed, _ = manager.get_computed_blocks(req0)
    assert manager.allocate_slots(req0, req0.num_tokens - num_computed, num_computed)
    offered = [b for _, _, b in drain_boundary_state_offloads(manager).get("0", [])]
    assert 2 * block_size in offered
    assert req0.num_prompt_tokens < 2 * block_size


def test_prompt_end_checkpoint_survives_sparse_retention_with_coarse_hash():
    """With hash_block_size == mamba block size (no fine-grained matching), the
    hybrid coordinator caches the final chunk only up to its last full block,
    so the managers see ``num_tokens < num_prompt_tokens`` there too. The
    prompt-end checkpoint must still be published under retention_interval=0,
    otherwise the next request that extends this prompt misses the prefix.
    """
    block_size = 32
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=block_size,
        full_block_size=block_size,
        mamba_block_size=block_size,
        num_prefill_checkpoint_blocks=1,
    )
    manager.coordinator.retention_interval = 0

    # 240 tokens: not block aligned, prompt-end checkpoint at 224.
    request = make_request("producer", list(range(240)), block_size, sha256)
    computed_blocks, num_computed, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 128, num_computed, computed_blocks)
    request.num_computed_tokens = 128
    manager.new_step_starts()
    assert manager.allocate_slots(request, 112) is not None

    end_hash = request.block_hashes[224 // block_size - 1]
    assert manager.block_pool.get_cached_block(end_hash, [1]) is not None

    # A request extending the prompt resumes from that checkpoint.
    follower = make_request("follower", list(range(240)) + [7] * 40, block_size, sha256)
    _, num_hit, _ = manager.get_computed_blocks(follower)
    assert num_hit == 224


@pytest.mark.parametrize(
    "hash_block_size,mamba_block_size,use_eagle",
    [(32, 32, False), (16, 32, False), (32, 32, True)],
)
@pytest.mark.parametrize("retention_interval", [0, None])
@pytest.mark.parametrize(
    "num_prompt_tokens,num_output_tokens",
    [(104, 0), (200, 0), (40, 24), (40, 25), (150, 43)],
)
@pytest.mark.parametrize("chunk_blocks", [2, 100])
def test_checkpoint_reservation_matches_worker(
    hash_block_size,
    mamba_block_size,
    use_eagle,
    retention_interval,
    num_prompt_tokens,
    num_output_tokens,
    chunk_blocks,
):
    """The worker exports a checkpoint wherever `compute_mamba_prefill_checkpoints`
    says, into whatever block sits at its column. Each chunk, the manager must
    either reserve exactly that position and column, or leave the column null so
    the export is masked; anything else publishes a hash over the wrong state.
    Under sparse retention, only the prefill-end chunk may reserve one.
    """
    manager = make_full_mamba_manager(
        dcp_world_size=1,
        hash_block_size=hash_block_size,
        full_block_size=hash_block_size,
        mamba_block_size=mamba_block_size,
        num_blocks=64,
        use_eagle=use_eagle,
        num_speculative_blocks=3 if use_eagle else 0,
        num_prefill_checkpoint_blocks=1,
    )
    manager.coordinator.retention_interval = retention_interval
    mamba_manager = manager.coordinator.single_type_managers[1]

    request = make_request(
        "req", list(range(num_prompt_tokens)), hash_block_size, sha256
    )
    request.append_output_token_ids(list(range(1000, 1000 + num_output_tokens)))
    num_tokens = request.num_tokens
    prefill_end = max(num_prompt_tokens, num_tokens - 1)

    start = 0
    while start < num_tokens:
        end = min(start + chunk_blocks * mamba_block_size, num_tokens)
        assert manager.allocate_slots(request, end - start) is not None
        offsets, cols = compute_mamba_prefill_checkpoints(
            [end],
            [end - start],
            hash_block_size=hash_block_size,
            mamba_block_size=mamba_block_size,
            checkpoint_alignment=16,
            drop_eagle_block=use_eagle,
            cache_hit_alignment_tokens=mamba_manager.cache_hit_alignment_tokens,
        )
        reserved = mamba_manager._checkpoints.get(request.request_id)
        if reserved is not None:
            assert reserved == (start + offsets[0], cols[0])
            assert retention_interval is None or end >= prefill_end
        elif offsets[0]:
            assert mamba_manager.req_to_blocks[request.request_id][cols[0]].is_null
        request.num_computed_tokens = end
        manager.new_step_starts()
        start = end
