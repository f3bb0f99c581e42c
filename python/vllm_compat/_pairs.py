"""Shared steps of the adapter's differential tests (test_adapter*.py, run by scripts/vllm-tests.sh): pagedkv.vllm's
KVCacheManager ("ours") and vLLM's own ("theirs") driven with the same requests, kept in pairs (ra, rb, ...) in a
dict `live` by request id; and the vLLM objects every one of them builds."""

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request


def make_config(num_blocks: int, specs) -> KVCacheConfig:
    """A KVCacheConfig of `num_blocks` blocks with one KV-cache group per spec (layer names layer0, layer1, ...)."""
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)])


def make_request(rid: str, tokens, block_size: int) -> Request:
    """A vLLM Request with prompt `tokens` and the block hasher the engine gives it (sha256, `block_size` tokens)."""
    sp = SamplingParams(max_tokens=1000)
    sp.update_from_generation_config({}, eos_token_id=None)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def lookup_pair(ours, theirs, rid: str, tokens, block_size: int) -> tuple:
    """A new request pair (ra, rb) with prompt `tokens` and each manager's lookup of it: (ra, rb, ca, ha, cb, hb),
    the cached blocks and hit length of ours (ca, ha) and of theirs (cb, hb), as vLLM's scheduler looks a waiting
    request up before admitting it (each test asserts its own rule on them)."""
    ra, rb = make_request(rid, tokens, block_size), make_request(rid, tokens, block_size)
    ca, ha, _ = ours.get_computed_blocks(ra)
    cb, hb, _ = theirs.get_computed_blocks(rb)
    return ra, rb, ca, ha, cb, hb


def next_tokens(rng, ra, rb, max_len: int, vocab: int) -> int | None:
    """The tokens request pair (ra, rb) schedules next: a chunk of 1..remaining prompt tokens, or, with its prompt
    computed, one decode token (the same random id below `vocab` appended to both); None when the request holds
    `max_len` tokens already (nothing to schedule)."""
    remaining = ra.num_tokens - ra.num_computed_tokens
    if remaining:
        return rng.randrange(1, remaining + 1)
    if ra.num_tokens >= max_len:
        return None
    t = rng.randrange(vocab)
    ra.append_output_token_ids([t])
    rb.append_output_token_ids([t])
    return 1


def free_pair(ours, theirs, live: dict, rid: str) -> tuple:
    """Free request `rid` on both managers and drop it from `live` (a preemption or a finish, freed as vLLM's
    scheduler frees); returns its entry."""
    entry = live.pop(rid)
    ours.free(entry[0])
    theirs.free(entry[1])
    return entry


def free_random(rng, ours, theirs, live: dict) -> tuple:
    """free_pair of a random live request (a finished request)."""
    return free_pair(ours, theirs, live, rng.choice(sorted(live)))


def kept_duplicates(ours, rids) -> int:
    """The blocks pagedkv.vllm holds for requests `rids` that duplicate a registered block (a full block, not
    registered, whose chain hash another block is registered under), in the groups at the match unit: pagedkv keeps
    them, as handed out, where an admission's build would have switched them (CacheConfig.deduplicate_blocks is on
    only for admissions). vLLM registers both copies, and which one a later hit takes differs, so pagedkv may hold up
    to this many blocks more than vLLM."""
    dups = set()
    for rid in rids:
        seq = ours._seqs[rid].seq
        for p, table in enumerate(ours._pk._vllm_tables(seq)):
            g = ours._order[p] if ours._order is not None else p
            if ours._group_bs[g] != ours.block_size:
                continue
            for i, b in enumerate(table):
                if not b or ours._pk.block_hash(b) is not None:
                    continue
                h = ours._pk._vllm_seq_hash(seq, i)
                if h is not None and ours._pk.cached_block(h, p) not in (None, b):
                    dups.add(b)
    return len(dups)


class EventCheck:
    """Both managers' KV events, compared after each operation as a router indexes them (llm-d's and Dynamo's
    indexers key a store by its block hashes): every BlockStored / BlockRemoved record has the same group, kind,
    block size, tokens and parent on both sides, each hash names the same prefix (the two managers hash with
    different functions, so a hash is compared by the tokens it names), and the index a router builds from each
    stream (the (group, prefix) pairs stored and not removed since) is the same. One difference is allowed: vLLM
    lists the hash of a duplicate block again (it registers both copies); pagedkv keeps the duplicate unregistered
    and lists it once. Such a hash must already be in the router's index (counted in `relisted`); and vLLM's removal
    of a duplicate repeats the record of the other copy's removal, where the test evicts both copies at once
    (`reremoved=True`; counted in `reremoved`)."""

    def __init__(self, ours, theirs, block_size: int, reremoved: bool = False):
        self.ours, self.theirs, self.bs = ours, theirs, block_size
        self.allow_reremoved = reremoved  # a test that evicts a key's duplicate blocks on vLLM's side at once
        self.names = ({}, {})  # per side: hash -> the prefix (token tuple) it names
        self.index = (set(), set())  # per side: the router's (group, prefix) pairs
        self.records = self.listed = self.relisted = self.empty = self.keyed = self.removed = self.reremoved = 0

    def learn(self, pairs) -> None:
        """Name the block hashes of request pairs (ra, rb, ...) (their current tokens) on both sides."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        for entry in pairs:
            ra, rb = entry[0], entry[1]
            toks = tuple(ra.all_token_ids)
            for i, h in enumerate(self.ours._pk.prepare_prompt(list(toks), self.ours._keys(ra)).hashes):
                self.names[0][h] = toks[:(i + 1) * self.bs]
            for i, h in enumerate(rb.block_hashes):
                self.names[1][maybe_convert_block_hash(h)] = toks[:(i + 1) * self.bs]

    def _norm(self, side: int, e):
        name = self.names[side]
        kind = type(e).__name__
        if kind == "BlockStored":
            parent = None if e.parent_block_hash is None else len(name[e.parent_block_hash])
            # a hash with its extra keys (vLLM lists one entry per hash, None for a block without any)
            keys = e.extra_keys if e.extra_keys is not None else [None] * len(e.block_hashes)
            assert len(keys) == len(e.block_hashes), f"side {side}: {len(keys)} extra keys, {len(e.block_hashes)} hashes"
            return ("stored", e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size,
                    tuple(e.token_ids), parent), [(name[h], k) for h, k in zip(e.block_hashes, keys)]
        if kind == "BlockRemoved":
            return ("removed", e.group_idx), [name[h] for h in e.block_hashes]
        return ("cleared",), []

    def compare(self, pairs, where: str) -> None:
        """Take both managers' events since the last call and compare them (request pairs `pairs` are the live
        ones, whose hashes are learnt first)."""
        self.learn(pairs)
        got = [[self._norm(side, e) for e in m.take_events()] for side, m in enumerate((self.ours, self.theirs))]
        # vLLM removes each of a key's duplicate blocks apart (evict_blocks of both): one record per block, the same
        # key twice in a row; pagedkv holds one block a key.
        if self.allow_reremoved:
            theirs = got[1]
            got[1] = [r for i, r in enumerate(theirs) if not (i and r[0][0] == "removed" and r == theirs[i - 1])]
            self.reremoved += len(theirs) - len(got[1])
        heads = [[h for h, _ in side] for side in got]
        assert heads[0] == heads[1], f"{where}: event records differ:\n pagedkv {heads[0]}\n vLLM    {heads[1]}"
        for (head, ours), (_, theirs) in zip(*got):
            if head[0] == "stored":
                self.records += 1
                self.listed += len(theirs)
                self.empty += not theirs
                self.keyed += sum(k is not None for _, k in theirs)
                extra = [p for p in theirs if p not in ours]
                assert [p for p in theirs if p in ours] == ours, f"{where}: {head[:2]}: pagedkv lists other hashes"
                for p in extra:  # a duplicate vLLM registers again: already indexed on both sides
                    assert (head[1], p[0]) in self.index[0], f"{where}: {head[:2]}: pagedkv leaves out a new block"
                self.relisted += len(extra)
            self.removed += head[0] == "removed"
            for side, hashes in enumerate((ours, theirs)):
                idx = self.index[side]
                hashes = [p[0] for p in hashes] if head[0] == "stored" else hashes
                if head[0] == "stored":
                    idx.update((head[1], p) for p in hashes)
                elif head[0] == "removed":
                    idx.difference_update((head[1], p) for p in hashes)
                else:
                    idx.clear()
        assert self.index[0] == self.index[1], f"{where}: the routers' indexes differ"
        assert self.ours.event_records_mended == 0, f"{where}: a record was widened or trimmed"
