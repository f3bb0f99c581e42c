"""
pagedkv: paged KV-cache management (block tables, prefix caching, eviction, events) for LLM serving schedulers. See docs/python.md.
"""

from collections.abc import Sequence
import enum
from typing import Annotated

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

class CacheConfig:
    """Configuration of one KV pool (kv_cache_manager.hpp CacheConfig)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True, hash_seed: int = 0, max_tokens_per_seq: int = 0, enable_events: bool = False, num_host_blocks: int = 0, offload: OffloadPolicy = OffloadPolicy.WRITE_BACK, min_offload_priority: int = 0) -> None:
        """
        num_blocks: pool size in blocks including the null block 0, [2, 2^31]; block_size: tokens per block; max_tokens_per_seq: 0 = 2^31 - 1; num_host_blocks: 0 = no host tier. Checked by KVCacheManager.
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

    def __repr__(self) -> str: ...

class BatchMetadataLimits:
    """An engine's fixed limits for one build."""

    def __init__(self, max_batch: int, max_tokens_per_step: int, max_blocks_per_seq: int, max_copies: int = 0, max_swaps: int = 0) -> None: ...

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

    @property
    def max_tokens_per_seq(self) -> int: ...

    def try_admit(self, seq: int, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None) -> AdmitResult:
        """
        Admit sequence `seq` with `prompt` (int32 token ids), all or nothing. Raises DuplicateSequenceError, InvalidArgumentError (empty prompt, bad multimodal item), LimitExceededError (prompt > max_tokens_per_seq).
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

    def try_reserve_lookahead(self, seq: int, k: int) -> AppendResult:
        """
        Speculative decoding: reserve `k` lookahead slots after the last token of `seq`.
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

    def query_admit(self, prompt: numpy.typing.NDArray[numpy.int32] | Sequence[int], keys: RequestKeys | None = None, *, max_cached_tokens: int | None = None, num_reserved_tokens: int | None = None) -> CapacityQuery:
        """What try_admit would take now (pure)."""

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

    def block_ids(self, seq: int) -> Annotated[NDArray[numpy.uint32], dict(shape=(None,))]:
        """Block ids of live sequence `seq` (a new uint32 array)."""

    def token_ids(self, seq: int) -> list[int]:
        """Token ids of live sequence `seq` (a new list)."""

    def pending_slots(self, seq: int) -> list[int]:
        """Slots of the pending (unbuilt) positions of `seq`."""

    def is_swapped(self, seq: int) -> bool: ...

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

    def build_batch_metadata(self, batch: numpy.typing.NDArray[numpy.int64] | Sequence[int], *, indptr: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, indices: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, last_page_len: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, block_tables: Annotated[NDArray[numpy.int32], dict(shape=(None, None), order='C', device='cpu')] | None = None, seq_lens: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, qo_indptr: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')] | None = None, slot_mapping: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu')] | None = None, copies: Annotated[NDArray[numpy.int32], dict(shape=(None, 2), order='C', device='cpu')] | None = None, swap_out: Annotated[NDArray[numpy.int32], dict(shape=(None, 2), order='C', device='cpu')] | None = None, swap_in: Annotated[NDArray[numpy.int32], dict(shape=(None, 2), order='C', device='cpu')] | None = None, num_scheduled_tokens: numpy.typing.NDArray[numpy.uint32] | Sequence[int] | None = None) -> BatchMetadataSizes:
        """
        Write this step's metadata for the sequences `batch` (int64 ids, in order) straight into the given numpy arrays (int32; slot_mapping int64; block_tables [max_batch, max_blocks_per_seq]; copies / swap_out / swap_in [n, 2]); None skips an output. Returns the sizes written. Nothing is copied: the arrays are written in place, so pinned host buffers can be reused step after step. Raises as the C++ call (UnknownSequenceError, InvalidArgumentError, BadShapeError, LimitExceededError); then nothing is written and nothing changes.
        """
