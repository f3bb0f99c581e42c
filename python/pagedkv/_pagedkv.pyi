"""
pagedkv: paged KV-cache management (block tables, prefix caching, eviction, events) for LLM serving schedulers. See docs/python.md.
"""

from collections.abc import Sequence
import datetime
import enum
from typing import Annotated, overload

import numpy
import numpy.typing
from numpy.typing import NDArray



class Errc(enum.IntEnum):
    """Stable error codes of pagedkv.Error (error.hpp)."""

    INVALID_ARGUMENT = 1

    UNKNOWN_SEQUENCE = 2

    DUPLICATE_SEQUENCE = 3

    DOUBLE_FREE = 4

    LIMIT_EXCEEDED = 5

    BLOCK_OUT_OF_RANGE = 6

    BAD_SHAPE = 7

class Error(Exception):
    """Misuse of a pagedkv call (pagedkv::Error); the call changed nothing. str(e) is the C++ what()."""
    code: Errc
    message: str

class InvalidArgumentError(Error, ValueError):
    code: Errc  # Errc.INVALID_ARGUMENT

class UnknownSequenceError(Error, LookupError):
    code: Errc  # Errc.UNKNOWN_SEQUENCE

class DuplicateSequenceError(Error, ValueError):
    code: Errc  # Errc.DUPLICATE_SEQUENCE

class DoubleFreeError(Error, RuntimeError):
    code: Errc  # Errc.DOUBLE_FREE

class LimitExceededError(Error, ValueError):
    code: Errc  # Errc.LIMIT_EXCEEDED

class BlockOutOfRangeError(Error, IndexError):
    code: Errc  # Errc.BLOCK_OUT_OF_RANGE

class BadShapeError(Error, ValueError):
    code: Errc  # Errc.BAD_SHAPE

class OffloadPolicy(enum.Enum):
    """When cached device blocks are copied to the host tier."""

    NONE = 0

    WRITE_BACK = 1

    WRITE_THROUGH = 2

class PreemptMode(enum.Enum):
    """How preempt() frees a running sequence's device blocks."""

    RECOMPUTE = 0

    SWAP = 1

class AdmitStatus(enum.IntEnum):
    """Outcome of an admission."""

    ADMITTED = 0

    NO_CAPACITY = 1

    NEVER_FITS = 2

    TRANSFER_PENDING = 3

class AppendStatus(enum.IntEnum):
    """
    Outcome of an append or reservation (also the values of append_tokens' status array).
    """

    OK = 0

    NO_CAPACITY = 1

    NEVER_FITS = 2

class CapacityStatus(enum.IntEnum):
    """Outcome of a capacity query."""

    FITS = 0

    NO_CAPACITY = 1

    NEVER_FITS = 2

class KVEventType(enum.Enum):
    """
    Kind of a KV-cache event (vLLM's BlockStored / BlockRemoved / AllBlocksCleared).
    """

    BLOCK_STORED = 0

    BLOCK_REMOVED = 1

    ALL_CLEARED = 2

class Medium(enum.Enum):
    """Memory tier of a block (vLLM's medium)."""

    GPU = 0

    CPU = 1

class AttentionKind(enum.Enum):
    """
    The attention type of a KV-cache group (vLLM's FullAttentionSpec / SlidingWindowSpec / ChunkedLocalAttentionSpec; group_policy.hpp).
    """

    FULL = 0
    """Every earlier key is visible: the group keeps every block."""

    SLIDING_WINDOW = 1
    """
    A query at p sees keys (p - W, p]: W keys, itself included (FlashInfer window_left = W - 1).
    """

    CHUNKED_LOCAL = 2
    """
    Llama 4 chunked-local attention: a query at p sees [floor(p / C) * C, p].
    """

    RECURRENT = 3
    """
    A recurrent state per sequence (Mamba-2, gated delta net; vLLM's MambaSpec) with checkpoints every window_tokens tokens (docs/groups.md, 'Recurrent-state groups').
    """

class MissCause(enum.Enum):
    """
    Why an admission's prefix hit ends where it does (manager_results.hpp).
    """

    NONE = 0
    """Every full block of the prompt is served."""

    PREFIX_CACHING_OFF = 1
    """CacheConfig.enable_prefix_caching is False."""

    SHORT_PROMPT = 2
    """The prompt holds no full block."""

    CAPPED = 3
    """The next block is cached but the cap stops the hit."""

    NOT_CACHED = 4
    """The block is in no tier and the eviction history lacks it."""

    KEY_MISMATCH = 5
    """Cached without this request's salt / adapter / items."""

    LIMITED_BY_GROUP = 6
    """A window group lacks a block its window needs."""

    EVICTED = 7
    """The block was cached and has been evicted (see .eviction)."""

class EvictedTier(enum.Enum):
    """The tier a block was evicted from."""

    DEVICE = 0

    HOST = 1

class EvictionRecord:
    """One remembered eviction (eviction_history.hpp)."""

    @property
    def tier(self) -> EvictedTier: ...

    @property
    def group(self) -> int: ...

    @property
    def eviction_number(self) -> int:
        """That tier's evictions before this one."""

class AdmitExplanation:
    """
    Why an admission's prefix hit ends where it does (KVCacheManager.explain_admit); tokens.
    """

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cap_tokens(self) -> int: ...

    @property
    def hit_tokens(self) -> int: ...

    @property
    def host_hit_tokens(self) -> int: ...

    @property
    def cause(self) -> MissCause: ...

    @property
    def first_miss_block(self) -> int: ...

    @property
    def limiting_group(self) -> int: ...

    @property
    def group_cached_run_tokens(self) -> list[int]: ...

    @property
    def eviction(self) -> EvictionRecord | None: ...

    @property
    def evictions_since(self) -> int: ...

class AttentionWindow:
    """
    Which keys a query sees (kernel_params.hpp): sliding_window_tokens W (0 = none) and attention_chunk_tokens C (0 = none); what a group's kernels and decode plan take.
    """

    def __init__(self, sliding_window_tokens: int = 0, attention_chunk_tokens: int = 0) -> None: ...

    @property
    def sliding_window_tokens(self) -> int: ...

    @sliding_window_tokens.setter
    def sliding_window_tokens(self, arg: int, /) -> None: ...

    @property
    def attention_chunk_tokens(self) -> int: ...

    @attention_chunk_tokens.setter
    def attention_chunk_tokens(self, arg: int, /) -> None: ...

    @property
    def enabled(self) -> bool:
        """Whether some key can be masked (W > 0 or C > 0)."""

    def first_visible(self, pos: int) -> int:
        """
        The first key position a query at `pos` sees (0 when nothing is masked).
        """

    def first_needed_token(self, kv_len_tokens: int, num_queries: int) -> int:
        """
        The first key read for a sequence of kv_len_tokens keys whose last num_queries are queries: pages wholly before it are never read (their page-table entries may be the null block 0).
        """

    def __eq__(self, arg: AttentionWindow, /) -> bool: ...

    def __repr__(self) -> str: ...

class KVCacheGroupSpec:
    """
    One KV-cache group (a set of layers with one attention type): `kind`, `window_tokens` (W for SLIDING_WINDOW, C for CHUNKED_LOCAL, the checkpoint interval for RECURRENT, 0 for FULL), `num_layers` (for byte accounting only), and for RECURRENT `state_bytes` (one layer's state) and `last_checkpoint` (also keep the state at each sequence's last block boundary), `block_size` (tokens per block of this group's pages: 0 = the pool's; a coarser page, a multiple of it, for a FULL group after group 0: docs/groups.md "Coarse pages"), and for RECURRENT `state_in_table` (vLLM's Mamba 'align' layout: the states live in the group's table, one block where each step ends; window_tokens must be the block size) with `prefill_checkpoint_alignment` (0 = off; vLLM's prefill checkpoint block of Mamba-2 layers: docs/groups.md). Checked by KVCacheManager.
    """

    def __init__(self, kind: AttentionKind = AttentionKind.FULL, window_tokens: int = 0, num_layers: int = 1, state_bytes: int = 0, last_checkpoint: bool = False, block_size: int = 0, state_in_table: bool = False, prefill_checkpoint_alignment: int = 0) -> None: ...

    @property
    def kind(self) -> AttentionKind: ...

    @kind.setter
    def kind(self, arg: AttentionKind, /) -> None: ...

    @property
    def window_tokens(self) -> int: ...

    @window_tokens.setter
    def window_tokens(self, arg: int, /) -> None: ...

    @property
    def num_layers(self) -> int: ...

    @num_layers.setter
    def num_layers(self, arg: int, /) -> None: ...

    @property
    def state_bytes(self) -> int: ...

    @state_bytes.setter
    def state_bytes(self, arg: int, /) -> None: ...

    @property
    def last_checkpoint(self) -> bool: ...

    @last_checkpoint.setter
    def last_checkpoint(self, arg: bool, /) -> None: ...

    @property
    def block_size(self) -> int: ...

    @block_size.setter
    def block_size(self, arg: int, /) -> None: ...

    @property
    def state_in_table(self) -> bool: ...

    @state_in_table.setter
    def state_in_table(self, arg: bool, /) -> None: ...

    @property
    def prefill_checkpoint_alignment(self) -> int: ...

    @prefill_checkpoint_alignment.setter
    def prefill_checkpoint_alignment(self, arg: int, /) -> None: ...

    def window(self) -> AttentionWindow:
        """The kernels' AttentionWindow of this group (off for FULL)."""

    def __eq__(self, arg: KVCacheGroupSpec, /) -> bool: ...

    def __repr__(self) -> str: ...

class CacheConfig:
    """Configuration of one KV pool (kv_cache_manager.hpp CacheConfig)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True, hash_seed: int = 0, max_tokens_per_seq: int = 0, enable_events: bool = False, num_host_blocks: int = 0, offload: OffloadPolicy = OffloadPolicy.WRITE_BACK, min_offload_priority: int = 0, groups: Sequence[KVCacheGroupSpec] = [], page_size_bytes: int = 0, eviction_history: int = 0, count_miss_causes: bool = False, release_at_build: bool = True, window_retention_interval: int | None = None, window_retention_alignment: int = 0, deduplicate_blocks: bool = True) -> None:
        """
        num_blocks: pool size in blocks including the null block 0, [2, 2^31]; block_size: tokens per block; max_tokens_per_seq: 0 = 2^31 - 1; num_host_blocks: 0 = no host tier; groups: the KV-cache groups sharing the pool, at most 64 (empty = one full-attention group; group g is index g in every call); page_size_bytes: bytes of one layer's K+V page of block_size tokens (0 = no byte accounting); eviction_history: slots remembering evictions, so a miss can say 'evicted' (0 = off); count_miss_causes: count every admission's miss cause in CacheStats.admissions_by_miss_cause; release_at_build: windowed and recurrent groups drop the blocks no later query needs at each build (False: only at release_skipped_blocks, for a caller that hands the table to its kernels after the build); window_retention_interval: sparse prefix-cache retention of sliding-window groups in tokens (vLLM's prefix_cache_retention_interval: None = every window block, 0 = only each sequence's boundary tails, I = those and the tails at each multiple of I; docs/vllm-swa-retention.md); window_retention_alignment: tokens the boundaries align down to (0 = block_size); deduplicate_blocks: a full block whose content another registered block holds is switched to it at registration (False: block ids stay as handed out, the duplicate unregistered; for engines whose workers keep append-only block tables, as vLLM's). Checked by KVCacheManager.
        """

    @property
    def num_blocks(self) -> int: ...

    @num_blocks.setter
    def num_blocks(self, arg: int, /) -> None: ...

    @property
    def block_size(self) -> int: ...

    @block_size.setter
    def block_size(self, arg: int, /) -> None: ...

    @property
    def enable_prefix_caching(self) -> bool: ...

    @enable_prefix_caching.setter
    def enable_prefix_caching(self, arg: bool, /) -> None: ...

    @property
    def hash_seed(self) -> int: ...

    @hash_seed.setter
    def hash_seed(self, arg: int, /) -> None: ...

    @property
    def max_tokens_per_seq(self) -> int: ...

    @max_tokens_per_seq.setter
    def max_tokens_per_seq(self, arg: int, /) -> None: ...

    @property
    def enable_events(self) -> bool: ...

    @enable_events.setter
    def enable_events(self, arg: bool, /) -> None: ...

    @property
    def num_host_blocks(self) -> int: ...

    @num_host_blocks.setter
    def num_host_blocks(self, arg: int, /) -> None: ...

    @property
    def offload(self) -> OffloadPolicy: ...

    @offload.setter
    def offload(self, arg: OffloadPolicy, /) -> None: ...

    @property
    def min_offload_priority(self) -> int: ...

    @min_offload_priority.setter
    def min_offload_priority(self, arg: int, /) -> None: ...

    @property
    def groups(self) -> list[KVCacheGroupSpec]:
        """The KV-cache groups (a copy: assign a new list to change them)."""

    @groups.setter
    def groups(self, arg: Sequence[KVCacheGroupSpec], /) -> None: ...

    @property
    def page_size_bytes(self) -> int: ...

    @page_size_bytes.setter
    def page_size_bytes(self, arg: int, /) -> None: ...

    @property
    def eviction_history(self) -> int: ...

    @eviction_history.setter
    def eviction_history(self, arg: int, /) -> None: ...

    @property
    def count_miss_causes(self) -> bool: ...

    @count_miss_causes.setter
    def count_miss_causes(self, arg: bool, /) -> None: ...

    @property
    def release_at_build(self) -> bool: ...

    @release_at_build.setter
    def release_at_build(self, arg: bool, /) -> None: ...

    @property
    def window_retention_interval(self) -> int | None: ...

    @window_retention_interval.setter
    def window_retention_interval(self, arg: int | None, /) -> None: ...

    @property
    def window_retention_alignment(self) -> int: ...

    @window_retention_alignment.setter
    def window_retention_alignment(self, arg: int, /) -> None: ...

    @property
    def window_retention_eagle(self) -> bool:
        """
        With window_retention_interval: EAGLE drafts and every sliding-window group is an EAGLE group (vLLM's use_eagle): tails one block longer, ending one block later; EAGLE's two replay boundaries; one block past the alignment horizon examined. Default False.
        """

    @window_retention_eagle.setter
    def window_retention_eagle(self, arg: bool, /) -> None: ...

    @property
    def deduplicate_blocks(self) -> bool: ...

    @deduplicate_blocks.setter
    def deduplicate_blocks(self, arg: bool, /) -> None: ...

    def __repr__(self) -> str: ...

class MultimodalItem:
    """
    A multimodal input at prompt positions [offset_tokens, offset_tokens + length_tokens); item_hash (16 bytes) identifies its content.
    """

    def __init__(self, item_hash: bytes, offset_tokens: int, length_tokens: int) -> None: ...

    @property
    def item_hash(self) -> bytes: ...

    @property
    def offset_tokens(self) -> int: ...

    @property
    def length_tokens(self) -> int: ...

class RequestKeys:
    """
    Per-request extra keys mixed into block hashes (vLLM's extra keys): LoRA adapter id (0 = base model), cache salt (first block only), multimodal items sorted by offset.
    """

    def __init__(self, adapter_id: int = 0, salt: str = '', multimodal: Sequence[MultimodalItem] = []) -> None: ...

    @property
    def adapter_id(self) -> int: ...

    @property
    def salt(self) -> str: ...

    @property
    def multimodal(self) -> list[MultimodalItem]: ...

DEFAULT_RETENTION_PRIORITY: int = 35

MAX_RETENTION_PRIORITY: int = 100

class TokenRangeRetention:
    """
    Retention priority of prompt tokens [begin, end) (TensorRT-LLM's TokenRangeRetentionConfig; retention.hpp): `priority` 0..100 (higher = evicted later; default 35), held for `duration` after the block is cached (None = as long as it stays cached; a timedelta or seconds, on the manager's retention clock).
    """

    def __init__(self, begin: int = 0, end: int | None = None, priority: int = 35, duration: datetime.timedelta | None = None) -> None: ...

    @property
    def begin(self) -> int:
        """First token position of the range."""

    @begin.setter
    def begin(self, arg: int, /) -> None: ...

    @property
    def end(self) -> int | None:
        """One past the last; None = to the end of the prompt."""

    @end.setter
    def end(self, arg: int | None, /) -> None: ...

    @property
    def priority(self) -> int: ...

    @priority.setter
    def priority(self, arg: int, /) -> None: ...

    @property
    def duration(self) -> datetime.timedelta | None: ...

    @duration.setter
    def duration(self, arg: datetime.timedelta | None, /) -> None: ...

    def __repr__(self) -> str: ...

class RetentionConfig:
    """
    A request's retention priorities (TensorRT-LLM's KvCacheRetentionConfig; retention.hpp): prompt token `ranges` (sorted by begin, disjoint; uncovered positions get the default priority) and `decode_priority` / `decode_duration` for blocks holding only generated tokens. A block takes the highest priority among the ranges it overlaps when its last holder releases it. Applies under eviction="priority" only; validated at admission (InvalidArgumentError naming the range).
    """

    def __init__(self, ranges: Sequence[TokenRangeRetention] = [], decode_priority: int = 35, decode_duration: datetime.timedelta | None = None) -> None: ...

    @property
    def ranges(self) -> list[TokenRangeRetention]:
        """The token ranges (a copy: assign a new list to change them)."""

    @ranges.setter
    def ranges(self, arg: Sequence[TokenRangeRetention], /) -> None: ...

    @property
    def decode_priority(self) -> int: ...

    @decode_priority.setter
    def decode_priority(self, arg: int, /) -> None: ...

    @property
    def decode_duration(self) -> datetime.timedelta | None: ...

    @decode_duration.setter
    def decode_duration(self, arg: datetime.timedelta | None, /) -> None: ...

    def validate(self) -> None:
        """
        Raise InvalidArgumentError as an admission with this config would (priority above 100, a duration <= 0, an empty, unsorted or overlapping range).
        """

class PreparedPrompt:
    """
    A prompt validated and hashed once by KVCacheManager.prepare_prompt, for admissions retried step after step while the pool is full (try_admit / query_admit take it without hashing again). Tied to the hasher, seed and block size of the manager that prepared it. Immutable.
    """

    def __len__(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def tokens(self) -> list[int]:
        """The token ids (a new list)."""

    @property
    def keys(self) -> RequestKeys | None:
        """The extra keys (a copy), or None."""

    @property
    def hashes(self) -> list[bytes]:
        """
        The block hashes of its full blocks, [len // block_size] 16-byte bytes (empty without prefix caching).
        """

class AdmitResult:
    """Result of try_admit / try_resume. Only ADMITTED changed state."""

    @property
    def status(self) -> AdmitStatus: ...

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache."""

    @property
    def num_host_cached_tokens(self) -> int:
        """Of which served by the host tier."""

    @property
    def num_new_blocks(self) -> int:
        """Blocks taken from the pool."""

    @property
    def num_missing_blocks(self) -> int:
        """
        NO_CAPACITY: blocks missing now; NEVER_FITS: beyond the pool; 0 when admitted.
        """

    @property
    def admitted(self) -> bool: ...

    def __bool__(self) -> bool: ...

    def __repr__(self) -> str: ...

class AppendResult:
    """
    Result of try_append / try_reserve / try_reserve_lookahead. `slots` are the slots reserved (block * block_size + offset); the build's slot mapping is the authority.
    """

    @property
    def status(self) -> AppendStatus: ...

    @property
    def slots(self) -> list[int]: ...

    @property
    def copy(self) -> tuple[int, int] | None:
        """The copy-on-write (src, dst) this call needs, or None."""

    @property
    def num_missing_blocks(self) -> int: ...

    @property
    def num_new_blocks(self) -> int:
        """
        OK: blocks taken from the pool over all groups (new blocks and copies).
        """

    @property
    def ok(self) -> bool: ...

    def __bool__(self) -> bool: ...

    def __repr__(self) -> str: ...

class CapacityQuery:
    """What an admission or growth would take from the pool now."""

    @property
    def status(self) -> CapacityStatus: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_missing_blocks(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...

    @property
    def fits(self) -> bool: ...

    def __bool__(self) -> bool: ...

class BatchMetadataSizes:
    """What one build wrote: the live extents in the buffers."""

    @property
    def batch_size(self) -> int: ...

    @property
    def num_indices(self) -> int: ...

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def num_copies(self) -> int: ...

    @property
    def num_swap_out(self) -> int: ...

    @property
    def num_swap_in(self) -> int: ...

    @property
    def transfer_token(self) -> int: ...

    @property
    def num_checkpoints(self) -> int: ...

    def __repr__(self) -> str: ...

class BatchMetadataLimits:
    """An engine's fixed limits for one build."""

    def __init__(self, max_batch: int, max_tokens_per_step: int, max_blocks_per_seq: int, max_copies: int = 0, max_swaps: int = 0, max_checkpoints: int = 0) -> None: ...

    @property
    def max_batch(self) -> int: ...

    @max_batch.setter
    def max_batch(self, arg: int, /) -> None: ...

    @property
    def max_tokens_per_step(self) -> int: ...

    @max_tokens_per_step.setter
    def max_tokens_per_step(self, arg: int, /) -> None: ...

    @property
    def max_blocks_per_seq(self) -> int: ...

    @max_blocks_per_seq.setter
    def max_blocks_per_seq(self, arg: int, /) -> None: ...

    @property
    def max_copies(self) -> int: ...

    @max_copies.setter
    def max_copies(self, arg: int, /) -> None: ...

    @property
    def max_swaps(self) -> int: ...

    @max_swaps.setter
    def max_swaps(self, arg: int, /) -> None: ...

    @property
    def max_checkpoints(self) -> int: ...

    @max_checkpoints.setter
    def max_checkpoints(self, arg: int, /) -> None: ...

class BatchMetadataCapacity:
    """
    Entries of each buffer for some limits (copies / swaps: int32 entries, two per pair).
    """

    @property
    def indptr(self) -> int: ...

    @property
    def indices(self) -> int: ...

    @property
    def last_page_len(self) -> int: ...

    @property
    def block_tables(self) -> int: ...

    @property
    def seq_lens(self) -> int: ...

    @property
    def qo_indptr(self) -> int: ...

    @property
    def slot_mapping(self) -> int: ...

    @property
    def copies(self) -> int: ...

    @property
    def swap_out(self) -> int: ...

    @property
    def swap_in(self) -> int: ...

    @property
    def state_in(self) -> int: ...

    @property
    def state_out(self) -> int: ...

    @property
    def checkpoint_indptr(self) -> int: ...

    @property
    def checkpoint_positions(self) -> int: ...

    @property
    def checkpoint_blocks(self) -> int: ...

    @property
    def max_blocks_per_seq(self) -> int: ...

def batch_metadata_capacity(limits: BatchMetadataLimits) -> BatchMetadataCapacity:
    """
    Capacities of the buffers a build writes for an engine with `limits`. Raises InvalidArgumentError (a limit is 0) or LimitExceededError (beyond the int32 metadata).
    """

class CacheStats:
    """Lifetime counters and block counts of a KVCacheManager (stats.hpp)."""

    @property
    def num_usable_blocks(self) -> int: ...

    @property
    def blocks_used(self) -> int: ...

    @property
    def blocks_cached(self) -> int: ...

    @property
    def blocks_free(self) -> int: ...

    @property
    def usage(self) -> float: ...

    @property
    def prefix_query_requests(self) -> int: ...

    @property
    def prefix_hit_requests(self) -> int: ...

    @property
    def prefix_query_tokens(self) -> int: ...

    @property
    def prefix_hit_tokens(self) -> int: ...

    @property
    def readmitted_requests(self) -> int: ...

    @property
    def readmitted_query_tokens(self) -> int: ...

    @property
    def readmitted_hit_tokens(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    @property
    def cow_copies(self) -> int: ...

    @property
    def dedup_blocks(self) -> int: ...

    @property
    def preemptions(self) -> int: ...

    @property
    def block_ops(self) -> int: ...

    @property
    def host_num_usable_blocks(self) -> int: ...

    @property
    def host_blocks_used(self) -> int: ...

    @property
    def host_blocks_cached(self) -> int: ...

    @property
    def host_blocks_free(self) -> int: ...

    @property
    def host_hit_tokens(self) -> int: ...

    @property
    def host_evictions(self) -> int: ...

    @property
    def offloads(self) -> int: ...

    @property
    def offloads_dropped(self) -> int: ...

    @property
    def offloads_below_priority(self) -> int: ...

    @property
    def onboards(self) -> int: ...

    @property
    def swap_outs(self) -> int: ...

    @property
    def swap_ins(self) -> int: ...

    @property
    def transfers_in_flight(self) -> int: ...

    @property
    def transfers_queued(self) -> int: ...

    @property
    def events_lost(self) -> int: ...

    @property
    def admissions_by_miss_cause(self) -> dict:
        """
        Admitted requests per miss cause (label -> count; CacheConfig.count_miss_causes).
        """

    def as_dict(self) -> dict:
        """Every field as a dict (compare two snapshots with ==)."""

class PrefixCacheStats:
    """
    Prefix-cache statistics of one interval, with vLLM's field names (queries / hits are prompt tokens).
    """

    @property
    def reset(self) -> bool: ...

    @property
    def requests(self) -> int: ...

    @property
    def queries(self) -> int: ...

    @property
    def hits(self) -> int: ...

    @property
    def preempted_requests(self) -> int: ...

    @property
    def preempted_queries(self) -> int: ...

    @property
    def preempted_hits(self) -> int: ...

    @property
    def hit_rate(self) -> float: ...

    @property
    def preempted_hit_rate(self) -> float: ...

class KVEvent:
    """One KV-cache event (events.hpp): hashes are 16-byte bytes objects."""

    @property
    def seq_no(self) -> int: ...

    @property
    def type(self) -> KVEventType: ...

    @property
    def hash(self) -> bytes: ...

    @property
    def parent_hash(self) -> bytes | None: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def block_size(self) -> int: ...

    @property
    def block_start(self) -> int: ...

    @property
    def adapter_id(self) -> int: ...

    @property
    def multimodal_items(self) -> list[MultimodalItem]: ...

    @property
    def salt(self) -> str: ...

    @property
    def medium(self) -> Medium: ...

    @property
    def group(self) -> int: ...

class KVEventBatch:
    """The events of one engine step (vLLM's KVEventBatch)."""

    @property
    def seq_no(self) -> int: ...

    @property
    def ts(self) -> float: ...

    @property
    def events(self) -> list[KVEvent]: ...

class KVCacheManager:
    """
    The KV-cache manager a scheduler calls, one per KV pool (kv_cache_manager.hpp). `hasher`: "sha256" (default) or "xxh3"; `eviction`: "lru" (default), "slru" or "priority". Thread-safe in Python: each call holds the manager's lock (the GIL is released while it works).
    """

    def __init__(self, config: CacheConfig, hasher: str = 'sha256', eviction: str = 'lru') -> None:
        """
        Raises InvalidArgumentError (num_blocks < 2, block_size outside [1, 65536], unknown hasher or eviction) or LimitExceededError (num_blocks > 2^31, max_tokens_per_seq > 2^31 - 1).
        """

    @property
    def hasher(self) -> str: ...

    @property
    def eviction(self) -> str: ...

    @property
    def config(self) -> CacheConfig: ...

    @property
    def block_size(self) -> int: ...

    def group_block_size(self, g: int) -> int:
        """
        Tokens per block of group g's pages (its block table, page table and slot mapping count in them).
        """

    @property
    def max_tokens_per_seq(self) -> int: ...

    @overload
    def try_admit(self, seq: int, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None, retention: RetentionConfig | None = None, prompt_retention_tokens: int | None = None, shared_prefix_boundary: int = 0) -> AdmitResult:
        """
        Admit sequence `seq` with `prompt` (int32 token ids), all or nothing. `retention`: the priorities its blocks take when released (copied; eviction="priority" only). `prompt_retention_tokens` (default the prompt's length) and `shared_prefix_boundary` (0 = none): the sequence's boundaries under CacheConfig.window_retention_interval (AdmitOptions). An empty prompt admits a sequence with no token yet (its slots come from try_append or try_reserve_lookahead). Raises DuplicateSequenceError, InvalidArgumentError (bad multimodal item, invalid retention, a boundary past the prompt), LimitExceededError (prompt > max_tokens_per_seq).
        """

    @overload
    def try_admit(self, seq: int, prompt: PreparedPrompt, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None, retention: RetentionConfig | None = None, prompt_retention_tokens: int | None = None, shared_prefix_boundary: int = 0) -> AdmitResult:
        """
        try_admit of a prompt hashed beforehand by prepare_prompt (its keys included): no hashing. Also raises InvalidArgumentError for a prompt prepared by a manager with another hasher, seed or block size.
        """

    def prepare_prompt(self, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None) -> PreparedPrompt:
        """
        Validate `prompt` (with `keys`) and hash its full blocks once (GIL released), for try_admit / query_admit retries. Pure. Raises as try_admit for invalid input.
        """

    def try_append(self, seq: int, tokens: numpy.typing.NDArray[numpy.int32] | Sequence[int]) -> AppendResult:
        """
        Append `tokens` to live sequence `seq`, reserving their slots (copy-on-write of a shared tail first). Raises UnknownSequenceError, LimitExceededError, InvalidArgumentError.
        """

    def append_tokens(self, seq_ids: numpy.typing.NDArray[numpy.int64] | Sequence[int], tokens: numpy.typing.NDArray[numpy.int32] | Sequence[int], out: Annotated[NDArray[numpy.uint8], dict(shape=(None,), order='C', device='cpu')] | None = None) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """
        Decode step in one call: try_append(seq_ids[i], [tokens[i]]) for every i, in order. Returns the uint8 AppendStatus of each (a new array, or a view of the first len(seq_ids) entries of `out` if given). Every id is checked first (live, no prompt tokens without slots, no lookahead, within max_tokens_per_seq), so a raised error changes nothing.
        """

    def try_reserve(self, seq: int, n: int) -> AppendResult:
        """
        Chunked prefill: reserve slots for the next `n` prompt tokens of `seq`, all or nothing.
        """

    def mark_checkpoint(self, seq: int, pos: int) -> AppendStatus:
        """
        Keep the state after the first `pos` tokens of `seq` as a checkpoint of every recurrent group (the end of a chat turn or tool output), besides those of the interval. `pos`: a block boundary in (num_built, num_tokens], not inside lookahead slots. Returns AppendStatus.OK or NO_CAPACITY (nothing changed). Raises UnknownSequenceError, InvalidArgumentError (no recurrent group, prefix caching off, not a block boundary, already built), LimitExceededError (beyond the slotted positions, or inside lookahead slots).
        """

    def try_reserve_lookahead(self, seq: int, k: int) -> AppendResult:
        """
        Speculative decoding: reserve `k` lookahead slots after the last token of `seq`. With a recurrent group, each slot also takes a draft state block in it (the build writes the state after each draft there; commit_lookahead keeps the one after the last accepted draft).
        """

    def commit_lookahead(self, seq: int, accepted: numpy.typing.NDArray[numpy.int32] | Sequence[int]) -> None:
        """
        Keep the accepted draft tokens of the outstanding lookahead, rewind the rest.
        """

    def fork(self, parent: int, child: int) -> None:
        """Share every block of settled `parent` with new sequence `child`."""

    def free(self, seq: int) -> None:
        """
        Free sequence `seq` (live or swapped). Raises UnknownSequenceError (also on a double free).
        """

    def free_many(self, seq_ids: numpy.typing.NDArray[numpy.int64] | Sequence[int]) -> None:
        """
        Free every sequence of `seq_ids` (int64). All are checked first (live or swapped, no repeats), so a raised UnknownSequenceError frees nothing.
        """

    def preempt(self, seq: int, mode: PreemptMode = PreemptMode.RECOMPUTE) -> bool:
        """
        Preempt running sequence `seq`. RECOMPUTE frees it (counted as a preemption); SWAP copies its blocks to the host tier (returns False, changing nothing, when the tier is full).
        """

    def try_resume(self, seq: int) -> AdmitResult:
        """Resume swapped sequence `seq`."""

    def rewind(self, seq: int, n: int) -> None:
        """
        Drop the last `n` tokens of `seq`. Raises UnknownSequenceError, LimitExceededError.
        """

    def lookup(self, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None) -> int:
        """
        Cached prefix length in tokens of `prompt` if it were admitted now (pure).
        """

    def explain_admit(self, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None) -> AdmitExplanation:
        """
        Why the hit of `prompt` would end where it does if admitted now: an AdmitExplanation (pure).
        """

    @overload
    def query_admit(self, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None, retention: RetentionConfig | None = None) -> CapacityQuery:
        """What try_admit would take now (pure)."""

    @overload
    def query_admit(self, prompt: PreparedPrompt, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None, retention: RetentionConfig | None = None) -> CapacityQuery:
        """What try_admit of a prepared prompt would take now (pure, no hashing)."""

    def expire_retention(self, now: datetime.timedelta) -> int:
        """
        Retention clock tick: record `now` (seconds or a timedelta on the steady clock, i.e. time.monotonic(); the clock never goes back) and let every cached block whose retention duration expired by then fall back to the default priority, in both tiers. Durations count from the last `now` recorded: call it once per step. Returns how many cached blocks changed priority (0 unless eviction="priority").
        """

    def retention_now(self) -> datetime.timedelta:
        """
        The retention clock: the latest `now` given to expire_retention (a timedelta since the steady clock's epoch; 0 before the first call).
        """

    def query_append(self, seq: int, n: int) -> CapacityQuery:
        """What growing `seq` by `n` slots would take now (pure)."""

    def __contains__(self, seq: int) -> bool: ...

    def contains(self, seq: int) -> bool:
        """Whether `seq` is live."""

    @property
    def num_sequences(self) -> int: ...

    def __len__(self) -> int: ...

    def num_tokens(self, seq: int) -> int:
        """Tokens of live sequence `seq` (positions with slots)."""

    def block_ids(self, seq: int, group: int = 0) -> Annotated[NDArray[numpy.uint32], dict(shape=(None,))]:
        """
        Group `group`'s block table of live sequence `seq` (a new uint32 array; a windowed group's leading entries may be the null block 0). Raises UnknownSequenceError, InvalidArgumentError (group).
        """

    def token_ids(self, seq: int) -> list[int]:
        """Token ids of live sequence `seq` (a new list)."""

    def pending_slots(self, seq: int, group: int = 0) -> list[int]:
        """
        Slots of the pending (unbuilt) positions of `seq` in group `group`'s blocks; -1 where the block is null (a window group's block an open fill leaves out).
        """

    def is_swapped(self, seq: int) -> bool: ...

    @property
    def num_groups(self) -> int:
        """KV-cache groups (1 for a plain full-attention pool)."""

    @property
    def bytes_per_block(self) -> int:
        """
        Bytes of one pool block: max(page_size_bytes, every recurrent group's state_bytes) x the most layers of any group (0 without either).
        """

    def window(self, group: int) -> AttentionWindow:
        """
        The AttentionWindow of group `group` (off for full attention). Raises InvalidArgumentError.
        """

    def window_block_bound(self, group: int, chunk_tokens: int) -> int | None:
        """
        Most blocks a sequence holds in windowed group `group` growing by at most `chunk_tokens` per build: ceil((W - 1 + chunk) / block_size) + 1 (chunked-local: C - 1 for W - 1); None for a full group. Raises InvalidArgumentError.
        """

    def release_skipped_blocks(self, seq: int) -> int:
        """
        The release rule for `seq` now (CacheConfig.release_at_build False leaves it to this call): blocks of windowed and recurrent groups no query from its computed position on reads leave its tables. Call it before the sequence grows for its next step (vLLM's remove_skipped_blocks), never between a build and the kernels reading it. Returns how many table entries it released (0: the tables did not change). Raises UnknownSequenceError.
        """

    def num_null_blocks(self, seq: int, group: int = 0) -> int:
        """
        Leading null blocks (0) of group `group`'s table of `seq`: blocks released behind a windowed group's window, or before the window at a prefix hit. Raises UnknownSequenceError, InvalidArgumentError.
        """

    def is_recurrent(self, group: int) -> bool:
        """
        Whether group `group` is a recurrent-state group. Raises InvalidArgumentError.
        """

    def state_block(self, seq: int, group: int) -> int:
        """
        The block of `seq`'s working state in recurrent group `group` (held from admission to free; a fork shares it until the next growth of either side copies it). Raises UnknownSequenceError, InvalidArgumentError (not a recurrent group).
        """

    def num_built(self, seq: int) -> int:
        """
        Positions of `seq` whose writes a build issued (or served by prefix hits).
        """

    def held_blocks(self, group: int) -> int:
        """
        Blocks group `group` holds now (refcount > 0, each shared block once). Raises InvalidArgumentError.
        """

    def peak_held_blocks(self, group: int) -> int:
        """
        The most blocks group `group` held at once since construction or reset_peaks().
        """

    def held_bytes(self, group: int) -> int:
        """held_blocks(group) x bytes_per_block."""

    def peak_used_blocks(self) -> int:
        """
        The most blocks all groups held at once since construction or reset_peaks().
        """

    def reset_peaks(self) -> None:
        """Restart the peaks at the current values."""

    def group_of(self, block: int) -> int:
        """
        The group whose table holds (or last held) pool block `block` (0 with one group). Raises BlockOutOfRangeError.
        """

    def num_cached_blocks(self, group: int = 0) -> int:
        """
        Blocks registered in group `group`'s prefix index (cached: held or evictable). Raises InvalidArgumentError.
        """

    def cached_block(self, hash: bytes, group: int = 0) -> int | None:
        """
        The block group `group`'s prefix index holds under `hash` (16 bytes, as in events and PreparedPrompt.hashes), or None: a prefix miss in that group. Raises InvalidArgumentError.
        """

    def block_hash(self, block: int) -> bytes | None:
        """
        The hash block `block` is registered under in its group's prefix index, or None.
        """

    def stats(self) -> CacheStats:
        """Counters now."""

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """
        Prefix-cache statistics since the previous call (vLLM's PrefixCacheStats).
        """

    def reset_prefix_cache(self) -> bool:
        """
        Drop every block hash; False (nothing changed) while a block is referenced.
        """

    def complete_transfers(self, token: int) -> None:
        """
        The copies of the build that returned `token` (transfer_token) have completed.
        """

    def take_event_batch(self, ts: float) -> KVEventBatch | None:
        """
        The events since the last take or drain as the next numbered KVEventBatch, or None.
        """

    def drain_events(self) -> list[KVEvent]:
        """The recorded events (oldest first), unbatched."""

    @overload
    def build_batch_metadata(self, batch: numpy.typing.NDArray[numpy.int64] | Sequence[int], *, indptr: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, indices: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, last_page_len: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, block_tables: Annotated[NDArray[numpy.int32], dict(shape=(None, None), order='C', device='cpu')] | None = None, seq_lens: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, qo_indptr: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, slot_mapping: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu')] | None = None, copies: Annotated[NDArray[numpy.int32], dict(shape=(None, 2), order='C', device='cpu')] | None = None, swap_out: Annotated[NDArray[numpy.int32], dict(shape=(None, 2), order='C', device='cpu')] | None = None, swap_in: Annotated[NDArray[numpy.int32], dict(shape=(None, 2), order='C', device='cpu')] | None = None, num_scheduled_tokens: numpy.typing.NDArray[numpy.uint32] | Sequence[int] | None = None) -> BatchMetadataSizes:
        """
        Write this step's metadata for the sequences `batch` (int64 ids, in order) straight into the given numpy arrays (int32; slot_mapping int64; block_tables [max_batch, max_blocks_per_seq]; copies / swap_out / swap_in [n, 2]); None skips an output. Returns the sizes written. Nothing is copied: the arrays are written in place, so pinned host buffers can be reused step after step. Raises as the C++ call (UnknownSequenceError, InvalidArgumentError, BadShapeError, LimitExceededError; BadShapeError on a manager with several KV-cache groups: pass groups=); then nothing is written and nothing changes.
        """

    @overload
    def build_batch_metadata(self, batch: numpy.typing.NDArray[numpy.int64] | Sequence[int], *, groups: Sequence[object], num_scheduled_tokens: numpy.typing.NDArray[numpy.uint32] | Sequence[int] | None = None) -> list[BatchMetadataSizes]:
        """
        The build of a manager with KV-cache groups: `groups[g]` holds group g's output arrays, as a dict of the one-group call's buffer keywords (BatchMetadataBuffers.kwargs()) or a BatchMetadataBuffers; one entry per group (num_groups). Each group gets its own page table (the null block 0 before a windowed group's window), slot mapping and copy list; seq_lens and qo_indptr are equal in every group; the host tier's swap lists go into group 0's buffers. Returns the sizes written, one per group. Written in place with the GIL released, as the one-group call. Raises TypeError (an unknown key, an array of the wrong dtype, layout or writability), BadShapeError (len(groups) != num_groups, a buffer too small) and as the one-group call; then nothing is written and nothing changes.
        """

    @overload
    def try_admit_external(self, seq: int, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], num_external_tokens: int, keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None, headroom_blocks: int = 0, prompt_retention_tokens: int | None = None, shared_prefix_boundary: int = 0) -> ExternalAdmitResult:
        """
        Admit `seq` as try_admit does (the sparse window retention's boundaries too), taking `num_external_tokens` more prompt tokens (after the local prefix hit) from an external source (vLLM's num_external_computed_tokens), clamped so the last prompt token is computed here. All groups, all or nothing; NO_CAPACITY / NEVER_FITS change nothing. `headroom_blocks`: also NO_CAPACITY unless that many blocks stay available (room for fills in flight). The ticket's blocks are held by the fill until complete_external_fill / abort_sequence; a build refuses the sequence meanwhile. A window group's blocks wholly outside the window of the fill's end are not taken (null, as vLLM pads an external load's skipped blocks); a recurrent group's row ends in the block that receives the state; a coarse group's pages move whole from a page boundary. Raises as try_admit.
        """

    @overload
    def try_admit_external(self, seq: int, prompt: PreparedPrompt, num_external_tokens: int, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None, headroom_blocks: int = 0, prompt_retention_tokens: int | None = None, shared_prefix_boundary: int = 0) -> ExternalAdmitResult:
        """
        try_admit_external of a prompt hashed beforehand by prepare_prompt (its keys included): the admission (its coarse-page hit and headroom check too) hashes nothing, so a KV connector's admission retried while the pool is full hashes each prompt once per request. Also raises InvalidArgumentError for a prompt prepared by a manager with another hasher, seed or block size.
        """

    @overload
    def try_admit_external(self, seq: int, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], plan: ImportPlan, keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None, headroom_blocks: int = 0) -> ExternalAdmitResult:
        """
        Consumer: try_admit_external of the tokens import `plan` (plan_import's, for this prompt and keys) provides; the ticket pairs one to one with plan.remote_blocks. Counts the import's blocks (transferred, skipped) when admitted, never at plan time. Raises InvalidArgumentError, nothing changed, when the local prefix hit changed since the plan (plan again) or the plan does not fit this pool or prompt.
        """

    @overload
    def query_admit_external(self, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], num_external_tokens: int, keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None) -> CapacityQuery:
        """
        What try_admit_external (without headroom) would take now, as query_admit says of try_admit: a window group's blocks the fill leaves out are not counted (pure). Raises as query_admit.
        """

    @overload
    def query_admit_external(self, prompt: PreparedPrompt, num_external_tokens: int, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None) -> CapacityQuery:
        """
        query_admit_external of a prompt hashed by prepare_prompt (pure; no hashing).
        """

    def explain_admit_external(self, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], num_external_tokens: int, keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None) -> ExternalAdmitExplanation:
        """
        explain_admit with the external part named: of `num_external_tokens` offered after the local hit, how many try_admit_external would take, from which token and block, how many blocks per group the fill would hold and skip: an ExternalAdmitExplanation (pure). Raises as explain_admit.
        """

    def complete_external_fill(self, fill_id: int, num_valid_blocks: int | None = None, *, failed_blocks: Sequence[int] | None = None, policy: ExternalFailurePolicy = ExternalFailurePolicy.RECOMPUTE) -> ExternalCompletion:
        """
        The fill is done (vLLM's finished_recving with invalid_block_ids): its first `num_valid_blocks` blocks per group hold the external K/V, or the blocks before the first of `failed_blocks` (indices from the ticket's first_block, any order); neither: every block is valid. The valid prefix counts as computed and its full blocks are registered now (deduplicated, BlockStored events); with failed blocks `policy` applies. A signal for a fill that is not live is counted (LATE, DUPLICATE, UNKNOWN), never raised. Raises InvalidArgumentError (both arguments; a count or index beyond a live fill's blocks): then nothing changes.
        """

    def abort_sequence(self, seq: int, transfer_quiescent: bool) -> None:
        """
        Abort `seq` (live or swapped) as free does. `transfer_quiescent`: no transfer can still write its fill's blocks, so they return at once; otherwise they become an orphan hold (in no table, never reused) until the fill's late signal or reap_external past the orphan timeout. Raises UnknownSequenceError.
        """

    def external_fill_of(self, seq: int) -> int:
        """The fill id `seq` waits for (0: none)."""

    def layout_fingerprint(self, page_layout: str, dtype: str, num_kv_heads: int, head_dim: int, *, convention: BlockIdentityConvention = BlockIdentityConvention.PAGEDKV, vllm_seed: str | None = None) -> KvLayoutFingerprint:
        """
        This pool's KvLayoutFingerprint for a hand-shake: block size, groups, hash algorithm and seed from the configuration; page layout, dtype, KV heads and head_dim from the caller. `vllm_seed`: vLLM's NONE_HASH seed text (VLLM_SHA256_CBOR only; default "vllm-none-hash"). Pure.
        """

    def finish_with_lease(self, seq: int, layout: KvLayoutFingerprint, lease_deadline: float | None = None) -> HandoffDescriptor:
        """
        Producer: finish settled sequence `seq`, keeping its blocks (registered, hit-able, read-only, never evicted or reused) under a lease until release_lease (vLLM's finished_sending) or reap_external past `lease_deadline` (seconds on the reap clock; None: only the release ends it). Returns the HandoffDescriptor. Raises UnknownSequenceError; InvalidArgumentError (layout differs from this pool's, named; the sequence is not settled or waits for a fill) before anything changes.
        """

    def release_lease(self, hold_id: int) -> ExternalSignal:
        """
        The consumer read lease `hold_id`'s blocks: it ends (APPLIED), or the signal is counted.
        """

    def extend_lease(self, hold_id: int, deadline: float | None) -> ExternalSignal:
        """
        Heartbeat: lease (or save pin) `hold_id` now ends at `deadline` (seconds; None: only by its release). Counted when it has ended.
        """

    def pin_for_save(self, seq: int, deadline: float | None = None) -> int:
        """
        Pin the built full blocks of live `seq` for a save to a store (LMCache, vLLM's offloading connector): until end_save, no preemption, free or eviction hands them to another sequence. Returns the pin id. Raises UnknownSequenceError.
        """

    def end_save(self, pin_id: int) -> ExternalSignal:
        """
        The save of pin `pin_id` completed or failed: its blocks are released. Counted when ended.
        """

    def is_current_block(self, block: int, generation: int) -> bool:
        """
        Whether (block, generation) is a reference an external hold keeps now; a stale one is counted (stale_generations) and must be refused by the transfer.
        """

    def check_claim(self, hold_id: int, blocks: Sequence[int], generations: Sequence[int]) -> ClaimCheck:
        """
        Producer: check a consumer's claim in one call (lease or save pin `hold_id`, entries (blocks[i], generations[i]), any subset, any order; a null entry, block 0 with generation 0, is skipped: an import plan's window entries): a ClaimCheck, OK or the first failing entry and why (UNKNOWN_HOLD, NOT_IN_HOLD, STALE_GENERATION: counted in stale_generations). Raises InvalidArgumentError when the lists differ in length.
        """

    def evict_cached_block(self, block: int) -> bool:
        """
        Evict `block`'s hash now (vLLM's evict_blocks after a failed load): it leaves the prefix index (BlockRemoved event); a cached block becomes free, a block still in a table or a hold stays there, never matchable again. Returns whether it was registered. Raises BlockOutOfRangeError.
        """

    def reap_external(self, now: float) -> int:
        """
        External clock tick (seconds): ends every lease, save pin and orphan hold whose deadline is at or before `now`; returns how many ended. Call it every step.
        """

    def set_orphan_timeout(self, seconds: float) -> None:
        """
        How long an orphan hold waits for its late signal after the last reap_external's `now` (default 480 s, vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT). Raises InvalidArgumentError for a negative value.
        """

    def plan_import(self, desc: HandoffDescriptor, ours: KvLayoutFingerprint, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None) -> ImportPlan:
        """
        Consumer: what to transfer of hand-off `desc` for `prompt`: the fingerprints first (a mismatch raises InvalidArgumentError naming the field), then the descriptor's shape from its token count, then the identities against this prompt's. Only the blocks after this pool's own prefix hit are planned, up to importable_tokens. Counts nothing: try_admit_external with the plan counts the blocks transferred and skipped when admitted.
        """

    def external_counters(self) -> ExternalKvCounters:
        """The ExternalKvCounters (lifetime counts, fills and holds now)."""

    def block_refcount(self, block: int) -> int:
        """
        References on device block `block` now (block tables, fills, holds; 0: free or cached). For vLLM's KVCacheBlock.ref_cnt in pagedkv.vllm's connector surface. Raises BlockOutOfRangeError.
        """

class ExternalFailurePolicy(enum.Enum):
    """
    What a fill with failed blocks does to its sequence (vLLM's kv_load_failure_policy; external_kv.hpp).
    """

    RECOMPUTE = 0
    """
    Keep the sequence: the valid prefix counts as computed, the positions from the first failed block on stay pending in their blocks (the scheduler computes them).
    """

    FAIL = 1
    """The sequence is reported failed and freed with its fill."""

class BlockIdentityConvention(enum.Enum):
    """
    How a hand-off's block identities are computed (both sides must agree).
    """

    PAGEDKV = 0
    """
    pagedkv's chain hash (16 bytes, zero-padded to 32) under the pool's hasher and hash_seed.
    """

    VLLM_SHA256_CBOR = 1
    """
    vLLM's sha256_cbor block hash (32 bytes), seeded by vLLM's NONE_HASH seed text.
    """

class ExternalSignal(enum.IntEnum):
    """
    What a fill or hold signal did. Only APPLIED changed anything but counters.
    """

    APPLIED = 0
    """The fill or hold was live; the signal took effect."""

    LATE = 1
    """
    The fill was aborted (an orphan hold ends now, or ended) or the hold expired: counted.
    """

    DUPLICATE = 2
    """Ended by an earlier signal: counted, nothing changes."""

    UNKNOWN = 3
    """No fill or hold with that id was issued: counted."""

class KvLayoutFingerprint:
    """
    What two engines must agree on before one reads the other's blocks (external_kv.hpp): compared once per peer, at hand-shake (first_mismatch), never per request (vLLM #42895). Make one with KVCacheManager.layout_fingerprint.
    """

    def __init__(self) -> None: ...

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @block_size.setter
    def block_size(self, arg: int, /) -> None: ...

    @property
    def page_layout(self) -> str:
        """The pool's page layout, e.g. "nhd"."""

    @page_layout.setter
    def page_layout(self, arg: str, /) -> None: ...

    @property
    def dtype(self) -> str:
        """Storage dtype of K/V, e.g. "bf16"."""

    @dtype.setter
    def dtype(self, arg: str, /) -> None: ...

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer on this rank."""

    @num_kv_heads.setter
    def num_kv_heads(self, arg: int, /) -> None: ...

    @property
    def head_dim(self) -> int:
        """Elements per head."""

    @head_dim.setter
    def head_dim(self, arg: int, /) -> None: ...

    @property
    def groups(self) -> list[KVCacheGroupSpec]:
        """The KV-cache groups (KVCacheGroupSpec), in index order."""

    @groups.setter
    def groups(self, arg: Sequence[KVCacheGroupSpec], /) -> None: ...

    @property
    def hash_algorithm(self) -> BlockIdentityConvention:
        """How identities are computed."""

    @hash_algorithm.setter
    def hash_algorithm(self, arg: BlockIdentityConvention, /) -> None: ...

    @property
    def hash_seed(self) -> int:
        """PAGEDKV: CacheConfig.hash_seed; else 0."""

    @hash_seed.setter
    def hash_seed(self, arg: int, /) -> None: ...

    @property
    def hash_seed_text(self) -> str:
        """VLLM_SHA256_CBOR: vLLM's NONE_HASH seed."""

    @hash_seed_text.setter
    def hash_seed_text(self, arg: str, /) -> None: ...

    def first_mismatch(self, other: KvLayoutFingerprint) -> str | None:
        """
        The first field where this and `other` differ, as "field: ours vs theirs" (e.g. "block_size: 16 vs 32"), or None when they describe the same layout. Pure.
        """

    def check_same_layout(self, theirs: KvLayoutFingerprint) -> None:
        """
        The hand-shake check: raises InvalidArgumentError naming the first differing field unless `theirs` describes this layout.
        """

class FillTicket:
    """
    An admission's external fill: the blocks a transfer must write before the sequence runs (vLLM: allocate_slots(..., num_external_computed_tokens, delay_cache_blocks=True)). Held by the fill: not matchable, registered, evictable or reported until complete_external_fill / abort_sequence.
    """

    @property
    def fill_id(self) -> int:
        """Names the fill in complete signals; never reused (0: no fill)."""

    @property
    def seq(self) -> int:
        """The sequence waiting for it."""

    @property
    def num_groups(self) -> int:
        """KV-cache groups."""

    @property
    def first_block(self) -> int:
        """Logical index of the first filled block (local hit / block_size)."""

    @property
    def first_token(self) -> int:
        """The fill writes positions [first_token, end_token)."""

    @property
    def end_token(self) -> int: ...

    @property
    def blocks(self) -> list[int]:
        """[num_groups x num_blocks] group-major: the pool blocks to write."""

    @property
    def generations(self) -> list[int]:
        """Same shape: each block's generation (is_current_block)."""

    @property
    def num_blocks(self) -> int:
        """Blocks per group."""

    def group_blocks(self, g: int) -> list[int]:
        """
        Group g's blocks (num_blocks of them). Raises InvalidArgumentError for g >= num_groups.
        """

class ExternalAdmitResult:
    """
    Result of try_admit_external: the admission (as try_admit's) and its fill.
    """

    @property
    def admit(self) -> AdmitResult:
        """The AdmitResult; only ADMITTED changed state."""

    @property
    def ticket(self) -> FillTicket | None:
        """
        The FillTicket, or None when nothing is to be transferred (not admitted, or no external token left after the local hit and the clamp to prompt length - 1).
        """

class ExternalCompletion:
    """Result of complete_external_fill."""

    @property
    def signal(self) -> ExternalSignal:
        """APPLIED: the fill was live; else counted, nothing changed."""

    @property
    def seq(self) -> int:
        """APPLIED: the fill's sequence."""

    @property
    def sequence_failed(self) -> bool:
        """
        APPLIED: the policy was FAIL and a block failed: the sequence is freed.
        """

    @property
    def num_valid_blocks(self) -> int:
        """APPLIED: leading blocks kept as computed."""

    @property
    def num_computed_tokens(self) -> int:
        """APPLIED, not failed: the sequence's computed (built) positions now."""

class HandoffDescriptor:
    """
    What a producer exports so that a consumer can read a finished sequence's blocks (vLLM NixlConnector's kv_transfer_params without the transport part). Valid while its lease lives. Constructible, so that a consumer can rebuild one received over a wire; plan_import checks its shape against num_tokens (never trusted: vLLM #50558).
    """

    def __init__(self) -> None: ...

    @property
    def hold_id(self) -> int:
        """The producer's lease (0: none)."""

    @hold_id.setter
    def hold_id(self, arg: int, /) -> None: ...

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V the blocks hold: [0, num_tokens)."""

    @num_tokens.setter
    def num_tokens(self, arg: int, /) -> None: ...

    @property
    def num_groups(self) -> int:
        """KV-cache groups."""

    @num_groups.setter
    def num_groups(self, arg: int, /) -> None: ...

    @property
    def blocks(self) -> list[int]:
        """[num_groups x ceil(num_tokens / block_size)] group-major."""

    @blocks.setter
    def blocks(self, arg: Sequence[int], /) -> None: ...

    @property
    def generations(self) -> list[int]:
        """Same shape: each block's generation at export."""

    @generations.setter
    def generations(self, arg: Sequence[int], /) -> None: ...

    @property
    def identities(self) -> list[bytes]:
        """
        [num_tokens // block_size] 32-byte identities of the full blocks under layout.hash_algorithm. Setting raises InvalidArgumentError for an entry that is not 32 bytes.
        """

    @identities.setter
    def identities(self, arg: Sequence[bytes], /) -> None: ...

    @property
    def tail_tokens(self) -> list[int]:
        """
        [num_tokens % block_size] token ids of the last, partial block (no identity convention hashes a partial block): plan_import refuses a prompt whose tokens there differ.
        """

    @tail_tokens.setter
    def tail_tokens(self, arg: Sequence[int], /) -> None: ...

    @property
    def layout(self) -> KvLayoutFingerprint:
        """The producer's KvLayoutFingerprint."""

    @layout.setter
    def layout(self, arg: KvLayoutFingerprint, /) -> None: ...

    @property
    def num_blocks(self) -> int:
        """Blocks per group."""

class ImportPlan:
    """
    What a consumer transfers of a hand-off: only the blocks it lacks (its own prefix hit is not transferred again). The destination is the FillTicket of try_admit_external with end_token - first_token external tokens (its blocks pair one to one with remote_blocks when its first_block equals this plan's).
    """

    @property
    def first_block(self) -> int:
        """Logical index of the first block to transfer."""

    @property
    def num_blocks(self) -> int:
        """Blocks to transfer per group."""

    @property
    def first_token(self) -> int:
        """Tokens the transfer provides: [first_token, end_token)."""

    @property
    def end_token(self) -> int: ...

    @property
    def skipped_blocks(self) -> int:
        """Leading blocks served by the consumer's own prefix hit."""

    @property
    def num_groups(self) -> int: ...

    @property
    def remote_blocks(self) -> list[int]:
        """[num_groups x num_blocks] the producer's blocks to read."""

    @property
    def remote_generations(self) -> list[int]:
        """Same shape: their generations."""

class ExternalKvCounters:
    """
    Lifetime counters of external KV (stats.hpp), and the fills and holds now.
    """

    @property
    def fills_started(self) -> int:
        """Admissions with external tokens."""

    @property
    def fills_completed(self) -> int:
        """Completed with every block valid."""

    @property
    def fills_partial(self) -> int:
        """Completed with some blocks failed."""

    @property
    def fills_failed(self) -> int:
        """
        Sequences failed: by the FAIL policy, or a recompute the pool had no blocks for.
        """

    @property
    def fills_aborted(self) -> int:
        """Fills whose sequence ended while in flight."""

    @property
    def fill_blocks(self) -> int:
        """Blocks (all groups) of the fills started."""

    @property
    def fill_blocks_valid(self) -> int:
        """Of which completed valid and kept."""

    @property
    def orphan_holds(self) -> int:
        """Aborts while the transfer was not quiescent."""

    @property
    def orphans_released(self) -> int:
        """Orphan holds ended by the late signal."""

    @property
    def orphans_expired(self) -> int:
        """Orphan holds ended by their deadline."""

    @property
    def leases_started(self) -> int: ...

    @property
    def leases_released(self) -> int: ...

    @property
    def leases_extended(self) -> int: ...

    @property
    def leases_expired(self) -> int: ...

    @property
    def save_pins_started(self) -> int: ...

    @property
    def save_pins_ended(self) -> int: ...

    @property
    def late_signals(self) -> int: ...

    @property
    def duplicate_signals(self) -> int: ...

    @property
    def unknown_signals(self) -> int: ...

    @property
    def stale_generations(self) -> int:
        """Block references refused by is_current_block."""

    @property
    def blocks_transferred(self) -> int:
        """Admitted imports: blocks to transfer."""

    @property
    def blocks_skipped(self) -> int:
        """Admitted imports: blocks served by the local hit."""

    @property
    def fills_in_flight(self) -> int:
        """Now: fills not yet completed."""

    @property
    def holds_active(self) -> int:
        """Now: leases, save pins and orphan holds."""

    @property
    def blocks_held(self) -> int:
        """Now: distinct blocks with an external reference."""

class ClaimStatus(enum.IntEnum):
    """Why a consumer's claim on a producer hold is refused (check_claim)."""

    OK = 0
    """Every entry names a block of the hold at its current generation."""

    UNKNOWN_HOLD = 1
    """
    No live lease or save pin has that id (never issued, released, expired, or an orphan hold).
    """

    NOT_IN_HOLD = 2
    """The entry's block is not one of the hold's blocks."""

    STALE_GENERATION = 3
    """
    The entry's block is in the hold at another generation (a reference from an earlier hold).
    """

class ClaimCheck:
    """Result of check_claim: the first failing entry and why."""

    @property
    def status(self) -> ClaimStatus:
        """OK, or why the claim is refused."""

    @property
    def entry(self) -> int:
        """
        The first failing entry's index (0 for UNKNOWN_HOLD; the number of entries when OK).
        """

    @property
    def current_generation(self) -> int:
        """STALE_GENERATION: the block's generation now."""

    @property
    def ok(self) -> bool:
        """Whether the claim holds."""

    def __repr__(self) -> str: ...

class ExternalAdmitExplanation:
    """
    KVCacheManager.explain_admit_external: an admission's prefix hit explained with its external part (how many tokens a fill would provide, from where).
    """

    @property
    def local(self) -> AdmitExplanation:
        """explain_admit's answer: the local hit and why it ends."""

    @property
    def external_tokens(self) -> int:
        """
        Tokens the external source provides: positions [first_external_token, first_external_token + external_tokens).
        """

    @property
    def clamped_tokens(self) -> int:
        """
        External tokens offered but not taken: under the local hit, or the last prompt token (computed here).
        """

    @property
    def first_external_token(self) -> int:
        """
        Where the external tokens start: the local hit (lowered to a page boundary with coarse pages).
        """

    @property
    def first_external_block(self) -> int:
        """first_external_token / block_size: the first block a fill writes."""

    @property
    def external_blocks(self) -> int:
        """
        Blocks per group of the fill's ticket (a window group's entries outside the window are null).
        """

    @property
    def skipped_blocks(self) -> int:
        """Blocks per group not transferred thanks to the local hit."""

    @property
    def computed_tokens(self) -> int:
        """
        Positions computed before the first step: first_external_token + external_tokens.
        """

def importable_tokens(producer_tokens: int, prompt_len: int, local_hit_tokens: int) -> int:
    """
    The external tokens an import may provide after a local hit: min(producer_tokens, prompt_len - 1) - local_hit_tokens, at least 0 (the last prompt token is computed here, for its logits). Pure.
    """
