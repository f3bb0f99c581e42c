"""Test setup: import pagedkv from PAGEDKV_PYTHON_DIR (a build tree's <build>/python) when set, else as installed."""
import os
import sys

_dir = os.environ.get("PAGEDKV_PYTHON_DIR")
if _dir:
    sys.path.insert(0, os.path.abspath(_dir))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pagedkv  # noqa: E402


def prompt(n, start=1000):
    """n distinct int32 token ids starting at `start`."""
    return np.arange(start, start + n, dtype=np.int32)


@pytest.fixture
def mgr():
    return pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=64, block_size=4))


def state(m, seqs=()):
    """A comparable snapshot: every counter, and each sequence's block ids, tokens and pending slots."""
    per_seq = {}
    for s in seqs:
        if s in m:
            per_seq[s] = (m.block_ids(s).tolist(), m.token_ids(s), m.num_tokens(s), m.pending_slots(s))
        else:
            per_seq[s] = None
    return m.stats().as_dict(), per_seq
