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
