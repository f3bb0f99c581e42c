"""pagedkv: paged KV-cache management for LLM-serving schedulers (Python bindings of the C++ library).

The manager (KVCacheManager) admits prompts with prefix caching, grows sequences a token or a chunk at a time, forks,
frees, preempts and rewinds them, and writes each step's batch metadata (page table, slot mapping, copy lists)
straight into caller-owned numpy arrays, one set per KV-cache group for hybrid models (CacheConfig.groups). See
docs/python.md.

Errors: misuse raises pagedkv.Error (``.code`` a pagedkv.Errc, ``.message``) through its subclass for the code, and
changes nothing; expected outcomes (no capacity, never fits, prefix miss) are returned as values.
"""
from __future__ import annotations

import numpy as _np

from ._pagedkv import (  # noqa: F401  (re-exported)
    AdmitExplanation,
    AdmitResult,
    AdmitStatus,
    AppendResult,
    AppendStatus,
    AttentionKind,
    AttentionWindow,
    BadShapeError,
    BatchMetadataCapacity,
    BatchMetadataLimits,
    BatchMetadataSizes,
    BlockIdentityConvention,
    BlockOutOfRangeError,
    CacheConfig,
    CacheStats,
    CapacityQuery,
    CapacityStatus,
    ClaimCheck,
    ClaimStatus,
    DEFAULT_RETENTION_PRIORITY,
    DoubleFreeError,
    DuplicateSequenceError,
    Errc,
    Error,
    EvictedTier,
    EvictionRecord,
    ExternalAdmitResult,
    ExternalCompletion,
    ExternalFailurePolicy,
    ExternalKvCounters,
    ExternalSignal,
    FillTicket,
    HandoffDescriptor,
    ImportPlan,
    InvalidArgumentError,
    KVCacheGroupSpec,
    KVCacheManager,
    KVEvent,
    KVEventBatch,
    KVEventType,
    KvLayoutFingerprint,
    LimitExceededError,
    MAX_RETENTION_PRIORITY,
    Medium,
    MissCause,
    MultimodalItem,
    OffloadPolicy,
    PreemptMode,
    PrefixCacheStats,
    PreparedPrompt,
    RequestKeys,
    RetentionConfig,
    TokenRangeRetention,
    UnknownSequenceError,
    __version__,
    batch_metadata_capacity,
    importable_tokens,
)


class BatchMetadataBuffers:
    """Host buffers for one build's metadata, sized once from an engine's limits (the C++ BatchMetadataStorage).

    Allocates only here; pass ``**buffers.kwargs()`` (or a subset) to KVCacheManager.build_batch_metadata every
    step: the arrays are written in place. ``allocator`` makes each array from (shape, dtype), e.g. a function that
    returns pinned host memory viewed as numpy; default numpy.empty. Swap buffers exist only with max_swaps > 0.
    """

    def __init__(self, limits: BatchMetadataLimits, allocator=None):
        cap = batch_metadata_capacity(limits)
        alloc = allocator or (lambda shape, dtype: _np.empty(shape, dtype=dtype))
        i32 = _np.int32
        self.limits = limits
        self.indptr = alloc((cap.indptr,), i32)
        self.indices = alloc((cap.indices,), i32)
        self.last_page_len = alloc((cap.last_page_len,), i32)
        self.block_tables = alloc((limits.max_batch, cap.max_blocks_per_seq), i32)
        self.seq_lens = alloc((cap.seq_lens,), i32)
        self.qo_indptr = alloc((cap.qo_indptr,), i32)
        self.slot_mapping = alloc((cap.slot_mapping,), _np.int64)
        self.copies = alloc((cap.copies // 2, 2), i32)
        self.swap_out = alloc((cap.swap_out // 2, 2), i32) if cap.swap_out else None
        self.swap_in = alloc((cap.swap_in // 2, 2), i32) if cap.swap_in else None
        # A recurrent-state group's outputs (state_in / state_out per row, the checkpoints of the step).
        self.state_in = alloc((cap.state_in,), i32)
        self.state_out = alloc((cap.state_out,), i32)
        self.checkpoint_indptr = alloc((cap.checkpoint_indptr,), i32)
        self.checkpoint_positions = alloc((cap.checkpoint_positions,), i32)
        self.checkpoint_blocks = alloc((cap.checkpoint_blocks,), i32)

    def kwargs(self) -> dict:
        """Every buffer by its build_batch_metadata keyword (swap lists only when allocated; the recurrent-state
        outputs, which only the per-group build takes, are attributes: pass ``groups=[buffers, ...]``)."""
        names = ("indptr", "indices", "last_page_len", "block_tables", "seq_lens", "qo_indptr", "slot_mapping",
                 "copies", "swap_out", "swap_in")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


__all__ = [name for name in dir() if not name.startswith("_")] + ["__version__"]
