"""Shared steps of the adapter's differential tests (test_adapter*.py, run by scripts/vllm-tests.sh): pagedkv.vllm's
KVCacheManager ("ours") and vLLM's own ("theirs") driven with the same requests, kept in pairs (ra, rb, ...) in a
dict `live` by request id."""


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
