"""Recurrent-state groups from Python (issue 20 sec. 1, docs/groups.md "Recurrent-state groups"): a toy recurrence
plays the SSM kernel over the state outputs of the per-group build, and a prompt sharing a prefix resumes from the
latest checkpoint inside it."""
import numpy as np
import pytest

import pagedkv
from pagedkv import AttentionKind, KVCacheGroupSpec

BS = 4
MASK = (1 << 64) - 1


def _scan(state, tokens, start):
    for i, t in enumerate(tokens):
        state = (state * 6364136223846793005 + (int(t) + 1) * 0x9E3779B97F4A7C15 + start + i) & MASK
    return state


class _Engine:
    """The engine side: per-group buffers, a state per block, a build that runs the toy recurrence."""

    def __init__(self, m):
        lim = pagedkv.BatchMetadataLimits(max_batch=4, max_tokens_per_step=256, max_blocks_per_seq=64)
        self.m = m
        self.bufs = [pagedkv.BatchMetadataBuffers(lim) for _ in range(m.num_groups)]
        self.mem = {}

    def build(self, seqs, tokens_of):
        sizes = self.m.build_batch_metadata(np.array(seqs, np.int64), groups=self.bufs)
        b = self.bufs[1]
        for j in range(sizes[1].num_copies):
            src, dst = b.copies[j]
            self.mem[int(dst)] = self.mem[int(src)]
        for r, seq in enumerate(seqs):
            end = int(b.seq_lens[r])
            first = end - int(b.qo_indptr[r + 1] - b.qo_indptr[r])
            state = 0 if b.state_in[r] == -1 else self.mem[int(b.state_in[r])]
            ck = {}  # position -> blocks (a position may name two: a checkpoint and a draft state)
            for c in range(b.checkpoint_indptr[r], b.checkpoint_indptr[r + 1]):
                ck.setdefault(int(b.checkpoint_positions[c]), []).append(int(b.checkpoint_blocks[c]))
            toks = tokens_of[seq]  # known tokens, then the drafts of lookahead slots (the GPU's)
            for p in range(first, end):
                state = _scan(state, toks[p:p + 1], p)
                for blk in ck.get(p + 1, []):
                    self.mem[blk] = state
            if end <= len(self.m.token_ids(seq)):
                assert int(b.state_out[r]) == self.m.state_block(seq, 1)
                self.mem[int(b.state_out[r])] = state
            else:  # a row computing lookahead positions: the states are checkpoint entries
                assert int(b.state_out[r]) == -1
        return sizes


def test_recurrent_group_config_and_errors():
    spec = KVCacheGroupSpec(AttentionKind.RECURRENT, window_tokens=8, num_layers=2, state_bytes=4096,
                            last_checkpoint=True)
    assert "RECURRENT" in repr(spec) and spec.state_bytes == 4096 and spec.last_checkpoint
    cfg = pagedkv.CacheConfig(num_blocks=64, block_size=BS, page_size_bytes=512,
                              groups=[KVCacheGroupSpec(num_layers=2), spec])
    m = pagedkv.KVCacheManager(cfg, hasher="xxh3")
    assert m.is_recurrent(1) and not m.is_recurrent(0)
    assert m.bytes_per_block == 4096 * 2
    with pytest.raises(pagedkv.InvalidArgumentError, match="multiple of the block size"):
        pagedkv.KVCacheManager(pagedkv.CacheConfig(
            num_blocks=64, block_size=BS,
            groups=[KVCacheGroupSpec(), KVCacheGroupSpec(AttentionKind.RECURRENT, window_tokens=6)]))
    with pytest.raises(pagedkv.InvalidArgumentError, match="group 0 must be an attention group"):
        pagedkv.KVCacheManager(pagedkv.CacheConfig(
            num_blocks=64, block_size=BS,
            groups=[KVCacheGroupSpec(AttentionKind.RECURRENT, window_tokens=8), KVCacheGroupSpec()]))
    assert m.try_admit(1, list(range(5))).admitted
    assert m.held_blocks(1) == 2  # its working state and its last checkpoint
    with pytest.raises(pagedkv.InvalidArgumentError, match="not a recurrent group"):
        m.state_block(1, 0)


def _attention_and_recurrent(num_blocks):
    """A manager of a full-attention group and a recurrent group with a checkpoint every 8 tokens, and its engine."""
    cfg = pagedkv.CacheConfig(num_blocks=num_blocks, block_size=BS,
                              groups=[KVCacheGroupSpec(), KVCacheGroupSpec(AttentionKind.RECURRENT, window_tokens=8)])
    m = pagedkv.KVCacheManager(cfg, hasher="xxh3")
    return m, _Engine(m)


def test_toy_recurrence_resumes_from_the_latest_checkpoint():
    m, e = _attention_and_recurrent(128)
    a = list(range(100, 130))
    assert m.try_admit(1, a).admitted
    sizes = e.build([1], {1: a})
    assert sizes[1].num_checkpoints == 3  # after 8, 16 and 24 tokens
    assert list(e.bufs[1].checkpoint_positions[:3]) == [8, 16, 24] and e.bufs[1].state_in[0] == -1
    assert e.mem[m.state_block(1, 1)] == _scan(0, a, 0)
    b = a[:22] + [7] * 9  # shares 22 tokens: the checkpoint at 16 is the latest inside
    r = m.try_admit(2, b)
    assert r.admitted and r.num_cached_tokens == 16
    x = m.explain_admit(b)
    assert x.cause == pagedkv.MissCause.LIMITED_BY_GROUP and x.limiting_group == 1
    e.build([2], {2: b})
    assert e.bufs[1].state_in[0] not in (-1, m.state_block(2, 1))  # read from the checkpoint
    assert e.mem[m.state_block(2, 1)] == _scan(0, b, 0)
    # A fork shares the state; the child's first append copies it (one copy in the recurrent group's list).
    m.fork(2, 3)
    assert m.state_block(3, 1) == m.state_block(2, 1)
    assert m.try_append(3, [5]).ok
    assert m.state_block(3, 1) != m.state_block(2, 1)
    sizes = e.build([3], {3: b + [5]})
    assert sizes[1].num_copies == 1
    assert e.mem[m.state_block(3, 1)] == _scan(0, b + [5], 0)
    with pytest.raises(pagedkv.LimitExceededError, match="cannot be rewound"):
        m.rewind(3, 1)


def test_mark_checkpoint_serves_a_shared_system_prompt():
    cfg = pagedkv.CacheConfig(num_blocks=128, block_size=BS,
                              groups=[KVCacheGroupSpec(), KVCacheGroupSpec(AttentionKind.RECURRENT, window_tokens=64)])
    m = pagedkv.KVCacheManager(cfg, hasher="xxh3")
    e = _Engine(m)
    a = list(range(40, 70))  # a 20-token system prompt, then a question
    assert m.try_admit(1, a).admitted
    assert m.mark_checkpoint(1, 20) == pagedkv.AppendStatus.OK
    with pytest.raises(pagedkv.InvalidArgumentError, match="multiple of the block size"):
        m.mark_checkpoint(1, 21)
    with pytest.raises(pagedkv.LimitExceededError, match="beyond"):
        m.mark_checkpoint(1, 32)
    e.build([1], {1: a})
    assert list(e.bufs[1].checkpoint_positions[:e.bufs[1].checkpoint_indptr[1]]) == [20]
    m.free(1)
    b = a[:20] + [900 + i for i in range(12)]
    assert m.try_admit(2, b).num_cached_tokens == 20
    e.build([2], {2: b})
    assert e.mem[m.state_block(2, 1)] == _scan(0, b, 0)


def test_speculative_decoding_keeps_the_state_after_the_accepted_drafts():
    m, e = _attention_and_recurrent(64)
    prompt = list(range(20, 30))
    assert m.try_admit(1, prompt).admitted
    e.build([1], {1: prompt})
    assert m.try_append(1, [7]).ok
    drafts = [50, 51, 52, 53]
    held = m.held_blocks(1)
    assert m.try_reserve_lookahead(1, 4).ok
    assert m.held_blocks(1) - held == 4  # a draft state per lookahead slot (no checkpoint boundary inside)
    e.build([1], {1: prompt + [7] + drafts})  # the verification step: the sampled token and the drafts
    m.commit_lookahead(1, drafts[:2])  # two drafts accepted
    tokens = prompt + [7] + drafts[:2]
    assert list(m.token_ids(1)) == tokens and m.num_built(1) == len(tokens)
    assert e.mem[m.state_block(1, 1)] == _scan(0, tokens, 0)
    assert m.try_append(1, [9]).ok  # the bonus token
    e.build([1], {1: tokens + [9]})
    assert e.mem[m.state_block(1, 1)] == _scan(0, tokens + [9], 0)
