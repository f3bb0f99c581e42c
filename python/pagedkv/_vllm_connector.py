"""The KV-connector surface of pagedkv.vllm.KVCacheManager (vLLM 0.32.0's scheduler with a KV connector: P/D
disaggregation, KV stores; docs/python.md "KV connectors").

vLLM's scheduler drives a connector's loads through its KVCacheManager; this mixin serves those calls with pagedkv's
external-KV lifecycle (issue 33: ``try_admit_external``, ``complete_external_fill``, ``abort_sequence``):

- ``allocate_slots(..., num_external_computed_tokens=n, delay_cache_blocks=...)`` of a new request
  (``_admit_external``): one ``try_admit_external`` taking the local hit the scheduler accepted and ``n`` external
  tokens after it, all or nothing, with vLLM's margins (``reserved_blocks``, the watermark, ``full_sequence_must_fit``)
  checked first. The fill's blocks are held by pagedkv: not matchable, not registered, no events. With
  ``delay_cache_blocks`` (an async load: the request waits in WAITING_FOR_REMOTE_KVS) the fill stays open until
  ``cache_blocks``; without it (a sync load: the worker loads in this step's forward pass) it completes at once, as
  vLLM caches those blocks at allocation;
- ``cache_blocks(request, num_computed_tokens)`` of a request whose fill is open (``_complete_fill``): the load
  finished; the blocks below ``num_computed_tokens`` are valid (vLLM truncates it at the first invalid block), the
  fill completes with that many blocks (the recompute policy: the rest stays pending for the scheduler);
- ``free`` / ``block_pool.free_blocks`` of a request whose fill is open (``_free_seq``): ``abort_sequence(seq,
  transfer_quiescent=True)``: vLLM frees a receiving request only after its worker reported the receive finished
  (``finished_recving``) or failed, so no transfer writes its blocks any more;
- ``evict_blocks(block_ids)`` (sync load failures under the fail policy): the blocks' hashes must not be served.
  ``evict_cached_block`` per block: the hash leaves pagedkv's prefix index at once (a BlockRemoved event); a block
  still in a table stays there, never matchable again.

Groups: full attention (and MLA; at larger block sizes too: coarse pages, whose loads move whole pages from a page
boundary, where vLLM's scheduler aligns its hits), sliding window and chunked-local (vLLM's hybrid models with SWA
or local layers). A window group's fill leaves out the blocks wholly before the window of the first query the load
leaves to compute (vLLM's SlidingWindowManager pads them with its null block): ``get_blocks`` lists the null block
there, as vLLM does, so a connector transfers none; pagedkv does not take the new ones (null in its own table, and
the admission's capacity check counts as vLLM's: ``query_admit_external``) and keeps the local hit's there (cached
blocks, which a recompute after a failed load reads) until the fill completes. When the load covers the whole
prompt, pagedkv's first query is the last prompt token (recomputed for its logits) and vLLM's one past it, so vLLM
nulls up to one window step more (and its recomputed token reads the null block there). With a single window group
vLLM reports block-level failures; a valid prefix whose next query would read a left-out block keeps no block (the
positions after the local hit are recomputed) and ``cache_blocks`` lowers ``request.num_computed_tokens`` to
pagedkv's count. A Mamba group in mode 'none' without prefix caching (vLLM's hybrid models with caching off) takes
part too: the fill's ticket row for it ends in the request's working state, the one state block vLLM lists (checked
at admission), which receives the state after the ticket's end_token tokens (vLLM's N-1 prefill when the load covers
the whole prompt, vllm#37310). Refused by name (``Unsupported``): a Mamba group with prefix caching (a state at a
checkpoint position is received into that checkpoint's block, which vLLM's mode-'none' listing does not show).

The rest of the connector-facing interface was there already: ``get_computed_blocks_for_connector``,
``get_block_ids`` / ``get_blocks`` (update_state_after_alloc), ``get_block_ids_for_computed_tokens``
(request_finished), ``pop_blocks_for_free`` / ``block_pool.free_blocks`` (delayed frees while a producer sends).
"""

import numpy as _np

from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

# The vLLM KV-cache specs whose groups take part in a KV connector's loads on the adapter.
_CONNECTOR_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")


def _pk_copy(src: int, dst: int) -> KVCacheBlockCopy:
    return KVCacheBlockCopy(src_block_id=src, dst_block_id=dst)


class ConnectorMixin:
    """Mixin of pagedkv.vllm.KVCacheManager: the calls vLLM's scheduler makes for a KV connector's loads."""

    def _connector_init(self) -> None:
        self._fill_of_seq: dict[int, tuple[int, int, int]] = {}  # seq -> (fill id, the ticket's token range)
        self._fill_built: dict[int, int] = {}  # seq -> positions built (a completed fill's end), more pending
        self._fill_blocks: dict[int, list[int]] = {}  # seq -> its open fill's blocks (each holds a reference)
        # seq -> {vLLM window group: blocks listed as null while its fill is open} (_hide_out_of_window)
        self._fill_hidden: dict[int, dict[int, int]] = {}
        self._window_groups = any(isinstance(grp.kv_cache_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec))
                                  for grp in self.kv_cache_config.kv_cache_groups)
        attach_views(self)

    # -- admission with external tokens ------------------------------------------------------------------------

    def _require_connector_groups(self) -> None:
        """Unsupported unless every group is one pagedkv's external KV serves through this adapter: full attention
        (and MLA, also at larger block sizes: coarse pages, whose loads move whole pages from a page boundary, where
        vLLM's scheduler aligns its hits), sliding window or chunked-local attention, and Mamba (mode 'none') without
        prefix caching."""
        from .vllm import Unsupported

        for g, grp in enumerate(self.kv_cache_config.kv_cache_groups):
            name = type(grp.kv_cache_spec).__name__
            if name == "MambaSpec" and self.enable_caching:
                # Without prefix caching the ticket's last entry is the working state, the one block vLLM lists in
                # mode 'none'. With it, pagedkv receives a state at a checkpoint position into the table's
                # checkpoint block there (RecurrentGroup::fills_checkpoint), a block the adapter does not list.
                raise Unsupported(f"KV connector loads with group {g} a MambaSpec and prefix caching: pagedkv "
                                  "receives a state that ends at a checkpoint position into that checkpoint's block, "
                                  "which vLLM's mode 'none' listing (one state block) does not show (issue 33)")
            if name == "MambaSpec" and getattr(grp.kv_cache_spec, "mamba_cache_mode", "none") == "align":
                raise Unsupported(f"KV connector loads with group {g} a MambaSpec in mode 'align': pagedkv's external "
                                  "KV does not take states kept in a group's table yet (try_admit_external refuses "
                                  "state_in_table groups; docs/vllm-mamba-align.md)")
            if name == "MambaSpec":
                continue
            if name not in _CONNECTOR_SPECS:
                raise Unsupported(f"KV connector loads with group {g} a {name}: pagedkv.vllm serves KV connector "
                                  "loads with full-attention, sliding-window and chunked-local groups only (issue 33)")

    def _window_first_kept(self, end_token: int) -> dict[int, int]:
        """{vLLM group: its first block inside the window of the query at `end_token`} for the window groups (the
        blocks before it are wholly outside every later query's window: pagedkv's first_kept_block, vLLM's
        get_num_skipped_tokens(end_token) // block_size)."""
        out = {}
        bs = self.block_size
        for g, grp in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = grp.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                out[g] = max(end_token - spec.sliding_window + 1, 0) // bs
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                out[g] = end_token // spec.attention_chunk_size * spec.attention_chunk_size // bs
        return out

    def _admit_external(self, request, num_new_tokens: int, hit: int, num_lookahead_tokens: int, num_external: int,
                        delay_cache_blocks: bool, reserved_blocks: int, has_scheduled_reqs: bool,
                        full_sequence_must_fit: bool, skip_zeroing=()):
        """allocate_slots of a new request with `num_external` tokens from a KV connector after the `hit`-token
        local prefix: the newly allocated blocks per group, or None (nothing changed). `skip_zeroing`: vLLM's
        skip_zeroing_group_ids (groups whose external blocks the load writes: not recorded for zeroing)."""
        from . import _pagedkv as _pk

        self._require_connector_groups()
        if request.request_id in self._seqs:
            raise ValueError(f"allocate_slots: request {request.request_id} is running; external tokens "
                             f"({num_external}) are only taken at admission")
        if hit % self.block_size:
            raise ValueError(f"allocate_slots: prefix hit {hit} is not a multiple of the block size")
        n_known = request.num_tokens
        need_end = min(hit + num_external + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        prompt_end = min(need_end, n_known)
        # Hashed once per request: the prompt get_computed_blocks prepared, or this call's first attempt.
        prepared = self._prepare(request, n_known)
        reserved = max(prompt_end - hit, 0)
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        if watermark or reserved_blocks or full_sequence_must_fit:
            free_now = self._num_free_blocks()
            # vLLM's count: a window group's blocks the load leaves out are not taken (nor counted).
            q = self._pk.query_admit_external(prepared, num_external, max_cached_tokens=hit,
                                              num_reserved_tokens=reserved)
            if not q.fits or q.num_blocks > free_now - reserved_blocks - watermark:
                return None
            if full_sequence_must_fit:  # the whole known sequence, every group (vLLM's full_num_tokens check)
                w = self._pk.query_admit_external(prepared, num_external, max_cached_tokens=hit)
                if not w.fits or w.num_blocks + watermark > free_now:
                    return None
        seq = next(self._next_seq)
        retain, junction = self._boundaries(request, n_known)
        r = self._pk.try_admit_external(seq, prepared, num_external, max_cached_tokens=hit,
                                        num_reserved_tokens=reserved, prompt_retention_tokens=retain,
                                        shared_prefix_boundary=junction)
        if r.admit.status != _pk.AdmitStatus.ADMITTED:
            return None
        if r.admit.num_cached_tokens != hit:
            self._pk.abort_sequence(seq, True)
            raise AssertionError(f"pagedkv.vllm: request {request.request_id}: the scheduler took a {hit}-token "
                                 f"hit, pagedkv finds {r.admit.num_cached_tokens} now")
        lookahead = max(need_end - n_known, 0)
        if lookahead:
            if self._pk.try_reserve_lookahead(seq, lookahead).status != _pk.AppendStatus.OK:
                self._pk.abort_sequence(seq, True)
                return None
        t = r.ticket
        hidden = self._check_ticket(request, seq, t) if t is not None else None
        self._prepared.pop(request.request_id, None)
        s = self._new_seq_mirror(request, seq, n_known, lookahead)
        if t is not None:
            self._fill_of_seq[seq] = (t.fill_id, t.first_token, t.end_token)
            self._fill_blocks[seq] = list(t.blocks)
            if hidden:
                self._fill_hidden[seq] = hidden
            if not delay_cache_blocks:  # a sync load: written in this step's forward pass, cached at allocation
                self._complete_fill(s, request, hit + num_external)
                self._build_upto(s, request, need_end)
        else:
            self._build(seq, request)
        first = hit // self.block_size
        table = self._hide_out_of_window(seq, self._table(seq)) if self._fill_hidden else self._table(seq)
        ids = [grp[first:] for grp in table]
        if self._state_groups:
            # The Mamba groups' one state block (it receives the loaded state); the attention blocks to zero as
            # vLLM records them: the new ones, and the external ones of groups the connector does not load.
            ext_end = -(-min(hit + num_external, need_end) // self.block_size) - first
            self._zero_ids.extend(b for g, grp in enumerate(ids) if g not in self._state_groups
                                  for j, b in enumerate(grp) if b and (j >= ext_end or g not in skip_zeroing))
            ids = self._state_ids(seq, ids, True)
        return self._blocks_of(ids)

    def _check_ticket(self, request, seq: int, t) -> dict[int, int]:
        """Check fill ticket `t` of `seq` against what the adapter lists, and return {vLLM window group: its blocks
        listed as null while the fill is open}. A window group's fill leaves out the blocks before the window of the
        query at t.end_token (null in the ticket: never transferred), as vLLM's SlidingWindowManager /
        ChunkedLocalAttentionManager skip them for an external load; so get_blocks lists the null block there (a
        connector reading the request's blocks, update_state_after_alloc, transfers none of them). pagedkv does not
        take the new ones (null in its table too); it keeps the local hit's blocks there (cached blocks, which a
        recompute after a failed load reads), listed as null until the fill completes. A Mamba group's ticket row
        receives the state after t.end_token tokens into its last entry: the working state, the one block the
        adapter lists (vLLM's state block in mode 'none'). On a disagreement the admission is undone
        (abort_sequence, quiescent: no transfer has the ticket yet) and AssertionError raised."""
        hidden = {}
        bad = None
        for g, k in self._window_first_kept(t.end_token).items():
            row = list(t.group_blocks(self._pk_group[g]))
            if any((b == 0) != (t.first_block + j < k) for j, b in enumerate(row)):
                bad = f"group {g}'s ticket row {row} from block {t.first_block} disagrees with the window's first " \
                      f"kept block {k} at token {t.end_token}"
            elif k:
                hidden[g] = k
        for g in self._state_groups:
            row = list(t.group_blocks(self._pk_group[g]))
            state = self._pk.state_block(seq, self._pk_group[g])
            if not row or row[-1] != state or any(row[:-1]):
                bad = f"Mamba group {g}'s ticket row {row} does not end in its state block {state}"
        if bad is not None:
            self._pk.abort_sequence(seq, True)
            raise AssertionError(f"pagedkv.vllm: request {request.request_id}: {bad}")
        return hidden

    def _hide_out_of_window(self, seq: int, ids):
        """`ids` (block ids per group, vLLM's order) with the blocks _check_ticket recorded for `seq` as null."""
        hidden = self._fill_hidden.get(seq)
        if not hidden:
            return ids
        ids = list(ids)
        for g, k in hidden.items():
            ids[g] = [0] * min(k, len(ids[g])) + list(ids[g][k:])
        return ids

    def _new_seq_mirror(self, request, seq: int, n_known: int, lookahead: int):
        from .vllm import _Seq

        s = self._seqs[request.request_id] = self._seq_of[seq] = _Seq(seq, n_known)
        s.lookahead = lookahead
        s.slotted = self._pk.num_tokens(seq)
        return s

    # -- completion, abort -------------------------------------------------------------------------------------

    def _complete_fill(self, s, request, num_computed_tokens: int) -> bool:
        """The connector's load for `s` finished with its first `num_computed_tokens` tokens valid: complete the
        fill (recompute policy for the rest; with a window group pagedkv may keep fewer valid blocks, and
        request.num_computed_tokens is lowered to its count). False when `s` has no open fill."""
        got = self._fill_of_seq.pop(s.seq, None)
        if got is None:
            return False
        self._fill_blocks.pop(s.seq, None)
        self._fill_hidden.pop(s.seq, None)
        fill_id, first_token, end_token = got
        if num_computed_tokens >= end_token:
            done = self._pk.complete_external_fill(fill_id)  # every block valid
        else:
            valid = max(num_computed_tokens - first_token, 0) // self.block_size
            done = self._pk.complete_external_fill(fill_id, valid)
        if done.signal != done.signal.APPLIED:
            raise AssertionError(f"pagedkv.vllm: request {request.request_id}: its fill {fill_id} was not live "
                                 f"({done.signal.name})")
        if done.num_computed_tokens < min(num_computed_tokens, end_token):
            # A window group's next query would read a block the transfer left out (pagedkv's window_valid_blocks):
            # the positions after the local hit are all recomputed, so the scheduler's computed count goes back
            # to pagedkv's (vLLM's manager would keep the truncated count and read the null block there).
            request.num_computed_tokens = done.num_computed_tokens
        s.built_full = -1  # the fill's blocks count as built now: the next grow builds from there
        s.blocks = None
        if done.num_computed_tokens < s.slotted:  # positions after the fill wait for the scheduler (_build_upto)
            self._fill_built[s.seq] = done.num_computed_tokens
        if self.enable_kv_cache_events:
            self._convert_events(request)
        return True

    def _build_upto(self, s, request, need_end: int) -> None:
        """Issue the writes of `s`'s positions up to `need_end` (those the scheduler computes this step) after a
        completed fill: pagedkv registers the blocks they fill, as vLLM caches them at allocation, and none after
        them (their K/V is not written yet)."""
        from . import _pagedkv as _pk

        built = self._fill_built.get(s.seq)
        if built is None:
            return
        self._flush(s)
        n = min(need_end, s.slotted) - built
        if n <= 0:
            return
        copies = _np.empty((self.num_kv_cache_groups * 2 + 2, 2), dtype=_np.int32)
        slots = _np.empty(n, dtype=_np.int64)
        if self.num_kv_cache_groups == 1:
            size = self._pk.build_batch_metadata([s.seq], num_scheduled_tokens=_np.array([n], dtype=_np.uint32),
                                                 slot_mapping=slots, copies=copies)
            sizes = [size]
            bufs = [copies]
        else:
            bufs = [_np.empty_like(copies) for _ in range(self.num_kv_cache_groups)]
            groups = [{"slot_mapping": _np.empty(n, dtype=_np.int64), "copies": c} for c in bufs]
            for g in self._state_groups:  # a recurrent group's state outputs: scratch (vLLM's worker reads the
                # state block from the table it is given); checkpoints: at most two per position
                groups[self._pk_group[g]].update(
                    state_in=_np.empty(1, dtype=_np.int32), state_out=_np.empty(1, dtype=_np.int32),
                    checkpoint_indptr=_np.empty(2, dtype=_np.int32),
                    checkpoint_positions=_np.empty(2 * n + 2, dtype=_np.int32),
                    checkpoint_blocks=_np.empty(2 * n + 2, dtype=_np.int32))
            sizes = self._pk.build_batch_metadata([s.seq], groups=groups,
                                                  num_scheduled_tokens=_np.array([n], dtype=_np.uint32))
        for size, c in zip(sizes, bufs):
            for src, dst in c[:size.num_copies].tolist():
                self._copies.append(_pk_copy(src, dst))
        if self.enable_kv_cache_events:
            self._convert_events(request)
        if built + n >= s.slotted:
            del self._fill_built[s.seq]
        else:
            self._fill_built[s.seq] = built + n
        s.built_full = -1
        s.blocks = None

    def _free_seq(self, seq: int) -> None:
        """Free pagedkv sequence `seq`; one whose fill is open is aborted as quiescent (see the module doc)."""
        self._fill_built.pop(seq, None)
        self._fill_blocks.pop(seq, None)
        self._fill_hidden.pop(seq, None)
        if self._fill_of_seq.pop(seq, None) is not None:
            self._pk.abort_sequence(seq, True)
        else:
            self._pk.free(seq)

    # -- evict_blocks ------------------------------------------------------------------------------------------

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Stop serving the cached content of `block_ids` (vLLM: failed sync KV loads under the fail policy, the
        invalid blocks and those after them): each block's hash leaves the prefix index now
        (``evict_cached_block``, a BlockRemoved event); a block still in a table stays there, unmatchable. Blocks
        without a hash, and ids outside the pool, are ignored, as vLLM's block pool ignores them."""
        for b in block_ids:
            b = int(b)
            if 0 < b < len(self._blocks):
                self._pk.evict_cached_block(b)


# -- read-only views of vLLM internals the KV-connector tests read (leak checks) -----------------------------------
# vLLM's connector tests check that a request's lifecycle leaks nothing (tests/v1/kv_connector/unit/utils.py
# assert_scheduler_empty) by reading its block pool and single-type managers. These views answer those reads from
# pagedkv's state; they are read-only and every other internal stays NotProvided.


class _ReqToBlocksView:
    """coordinator.single_type_managers[g].req_to_blocks: request id -> its blocks in group g (live requests)."""

    def __init__(self, owner, g: int):
        self._owner, self._g = owner, g

    def __len__(self):
        return len(self._owner._seqs)

    def __iter__(self):
        return iter(list(self._owner._seqs))

    def __contains__(self, request_id):
        return request_id in self._owner._seqs

    def __getitem__(self, request_id):
        if request_id not in self._owner._seqs:
            raise KeyError(request_id)
        cls = _block_state_class()
        return [cls(b.block_id, self._owner) for b in self._owner.get_blocks(request_id).blocks[self._g]]

    def keys(self):
        return list(self._owner._seqs)


class _NumCachedBlockView(_ReqToBlocksView):
    """coordinator.single_type_managers[g].num_cached_block: request id -> its leading blocks in group g that are
    registered in the prefix index (live requests)."""

    def __getitem__(self, request_id):
        s = self._owner._seqs.get(request_id)
        if s is None:
            raise KeyError(request_id)
        self._owner._flush(s)
        return self._owner._pk._vllm_cached_prefix_blocks(s.seq)[self._owner._pk_group[self._g]]


class _FreeQueueView:
    """block_pool.free_block_queue: only its size (blocks nobody references, cached ones included); its order and
    links are NotProvided."""

    def __init__(self, owner):
        self._owner = owner

    def __getattr__(self, name):
        from .vllm import NotProvided

        if name.startswith("__"):
            raise AttributeError(name)
        raise NotProvided(f"block_pool.free_block_queue.{name}")

    @property
    def num_free_blocks(self) -> int:
        return self._owner._num_free_blocks()


def _block_state_class():
    """_BlockState: a vLLM KVCacheBlock (pagedkv.vllm._Block, equal to the adapter's block of the same id) whose
    ref_cnt is answered. Made on first use: pagedkv.vllm imports this module before it defines _Block."""
    global _BlockState
    if _BlockState is not None:
        return _BlockState
    from .vllm import _Block

    class BlockState(_Block):
        """block_pool.blocks[i] as vLLM's leak checks read it: ref_cnt (the block's references by requests:
        pagedkv's block_refcount less an open fill's own; the null block 0 has none) and block_hash (pagedkv's,
        None when not registered or named by evict_blocks)."""

        __slots__ = ()

        @property
        def ref_cnt(self) -> int:
            if self.block_id == 0:
                return 0
            n = self._owner._pk.block_refcount(self.block_id)
            for blocks in self._owner._fill_blocks.values():
                n -= blocks.count(self.block_id)
            return n

        @property
        def block_hash(self):
            if self.block_id == 0:
                return None
            return self._owner._pk.block_hash(self.block_id)

        @property
        def _block_hash(self):
            return self.block_hash

    _BlockState = BlockState
    return BlockState


_BlockState = None


class _BlocksView:
    """block_pool.blocks: one _BlockState per pool block (made on access)."""

    def __init__(self, owner):
        self._owner = owner

    def __len__(self):
        return len(self._owner._blocks)

    def __getitem__(self, i):
        cls = _block_state_class()
        if isinstance(i, slice):
            return [cls(b, self._owner) for b in range(len(self))[i]]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return cls(i % len(self), self._owner)

    def __iter__(self):
        cls = _block_state_class()
        return (cls(b, self._owner) for b in range(len(self)))


class _CachedHashesView:
    """block_pool.cached_block_hash_to_block: only its size (blocks registered in the prefix index); its entries
    are NotProvided."""

    def __init__(self, owner):
        self._owner = owner

    def __getattr__(self, name):
        from .vllm import NotProvided

        if name.startswith("__"):
            raise AttributeError(name)
        raise NotProvided(f"block_pool.cached_block_hash_to_block.{name}")

    def __len__(self):
        pk = self._owner._pk
        return sum(1 for b in range(1, len(self._owner._blocks)) if pk.block_hash(b) is not None)


def attach_views(owner) -> None:
    """Give `owner`'s block_pool and coordinator views the read-only internals above."""
    bp = owner.block_pool
    bp.free_block_queue = _FreeQueueView(owner)
    bp.num_gpu_blocks = len(owner._blocks)
    bp.blocks = _BlocksView(owner)
    bp.cached_block_hash_to_block = _CachedHashesView(owner)
    for g, view in enumerate(owner.coordinator.single_type_managers):
        view.req_to_blocks = _ReqToBlocksView(owner, g)
        view.num_cached_block = _NumCachedBlockView(owner, g)
