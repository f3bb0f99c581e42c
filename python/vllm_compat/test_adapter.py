"""Tests of pagedkv.vllm itself (run by scripts/vllm-tests.sh in the vLLM venv; need vllm 0.32.0 and pagedkv).

- every public member of vLLM's KVCacheManager exists on the adapter with the same inspect.signature (so a vLLM
  release whose interface moved fails here first);
- vLLM internals are refused by name (NotProvided), configurations pagedkv lacks by reason (Unsupported);
- a speculative-decoding round trip (lookahead slots, drafts accepted in part) keeps pagedkv's tokens equal to the
  request's and makes the committed blocks hits for the next request;
- a differential run against vLLM's own KVCacheManager on random workloads (shared prefixes, prompts copying a
  live request's generated tokens, chunked prefill, decode, speculative decoding with drafts accepted in part,
  frees): on a 40-block pool without drafts, the same hit lengths, the same admission / growth decisions and the
  same free-block counts, step by step; with drafts (a pool that never runs out), the same hits, and at least
  vLLM's free blocks (pagedkv releases the blocks that rejected drafts leave empty, vLLM keeps them).
"""

import inspect
import random

import pytest
import torch

import pagedkv.vllm as pv
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request

from _pairs import EventCheck, free_pair, free_random, lookup_pair, make_request

init_none_hash(sha256)


def _public(cls):
    return sorted(n for n in dir(cls) if not n.startswith("_") or n == "__init__")


def test_every_public_member_has_vllms_signature():
    names = [n for n in _public(VllmKVCacheManager) if n not in dir(object) or n == "__init__"]
    assert "allocate_slots" in names and "get_computed_blocks" in names and "take_events" in names
    for name in names:
        theirs = inspect.getattr_static(VllmKVCacheManager, name)
        ours = inspect.getattr_static(pv.KVCacheManager, name, None)
        assert ours is not None, f"pagedkv.vllm.KVCacheManager lacks {name}"
        if isinstance(theirs, property):
            assert isinstance(ours, property), name
            continue
        assert inspect.signature(ours) == inspect.signature(theirs), (
            f"{name}: {inspect.signature(ours)} != vLLM's {inspect.signature(theirs)}")


def _config(num_blocks, block_size=4):
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])


def _request(rid, tokens, block_size=4):
    return make_request(rid, tokens, block_size)


def _manager(cls, num_blocks, block_size=4, **kw):
    return cls(_config(num_blocks, block_size), max_model_len=4096, scheduler_block_size=block_size,
               hash_block_size=block_size, **kw)


def test_internals_are_refused_by_name():
    m = _manager(pv.KVCacheManager, 16)
    with pytest.raises(pv.NotProvided) as e:
        m.block_pool.free_block_queue.popleft  # noqa: B018  (its size is a read-only view: KV-connector leak checks)
    assert e.value.object_name == "block_pool.free_block_queue.popleft"
    with pytest.raises(pv.NotProvided, match="KVCacheManager.req_to_blocks"):
        m.req_to_blocks  # noqa: B018
    r = _request("a", range(10))
    blocks = m.allocate_slots(r, 10)
    with pytest.raises(pv.NotProvided, match="KVCacheBlock.ref_cnt"):
        blocks.blocks[0][0].ref_cnt  # noqa: B018
    # What the scheduler reads is there, and the read-only views vLLM's KV-connector tests read for leaks.
    assert m.block_pool.get_num_free_blocks() == 15 - 3 == m.block_pool.free_block_queue.num_free_blocks
    assert [b.ref_cnt for b in m.coordinator.single_type_managers[0].req_to_blocks["a"]] == [1, 1, 1]
    assert m.block_pool.blocks[blocks.blocks[0][0].block_id].ref_cnt == 1 and m.block_pool.blocks[0].ref_cnt == 0
    m.free(r)
    assert len(m.coordinator.single_type_managers[0].req_to_blocks) == 0
    assert sum(b.ref_cnt for b in m.block_pool.blocks) == 0
    assert [g.block_size for g in m.coordinator.single_type_managers] == [4]


def test_connector_fill_lifecycle_and_evict_blocks():
    """A KV connector's async load on the adapter (allocate_slots with external tokens and delay_cache_blocks, then
    cache_blocks with a failed block), a sync load, and evict_blocks: nothing of a fill is a hit before its
    completion, exactly its valid prefix after, and an evicted block is not served until its content changes."""
    import numpy as np

    rng = np.random.default_rng(33)
    toks = rng.integers(1, 5000, size=22).tolist()  # 5 full blocks of 4 + 2
    m = _manager(pv.KVCacheManager, 32)
    r = _request("a", toks)
    blocks = m.allocate_slots(r, 0, num_external_computed_tokens=20, delay_cache_blocks=True)
    assert [len(g) for g in blocks.get_block_ids()] == [5]
    ids = blocks.get_block_ids()[0]
    assert all(m.block_pool.blocks[b].ref_cnt == 1 for b in ids)  # the request's; the fill's own is not counted
    assert m.get_computed_blocks(_request("probe", toks))[1] == 0  # filling: not matchable
    r.num_computed_tokens = 12  # the worker reported block 3 invalid: vLLM truncates at it
    m.cache_blocks(r, 12)
    assert m.get_computed_blocks(_request("probe", toks))[1] == 12
    # The scheduler computes the rest: its blocks register as they are scheduled.
    assert m.allocate_slots(r, 10) is not None
    assert m.get_computed_blocks(_request("probe", toks))[1] == 20
    m.free(r)
    assert sum(b.ref_cnt for b in m.block_pool.blocks) == 0
    # A sync load registers at allocation; evict_blocks then stops serving from the named block on.
    toks2 = rng.integers(5000, 9000, size=17).tolist()
    r2 = _request("b", toks2)
    assert m.allocate_slots(r2, 1, num_external_computed_tokens=16) is not None
    assert m.get_computed_blocks(_request("probe", toks2))[1] == 16
    b2 = m.get_block_ids("b")[0]
    m.evict_blocks({b2[2], b2[3]})
    assert m.get_computed_blocks(_request("probe", toks2))[1] == 8
    assert m.block_pool.blocks[b2[2]].block_hash is None and m.block_pool.blocks[b2[1]].block_hash is not None
    m.free(r2)
    assert m.get_computed_blocks(_request("probe", toks2))[1] == 8


def test_mamba_is_refused_with_the_reason():
    spec = MambaSpec(block_size=4, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align",
                     num_prefill_checkpoint_blocks=2, prefill_checkpoint_alignment=1)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)),
        KVCacheGroupSpec(["m"], spec)])
    with pytest.raises(pv.Unsupported, match="num_prefill_checkpoint_blocks = 2, prefill_checkpoint_alignment = 1: pagedkv keeps one"):
        pv.KVCacheManager(cfg, max_model_len=64, scheduler_block_size=4, hash_block_size=4)


def test_speculative_decoding_round_trip():
    m = _manager(pv.KVCacheManager, 64, enable_kv_cache_events=True)
    r = _request("a", range(100, 110))  # 10 prompt tokens, block size 4
    blocks = m.allocate_slots(r, 10, num_lookahead_tokens=3)  # 13 slots: 4 blocks
    assert [len(g) for g in blocks.get_block_ids()] == [4]
    r.num_computed_tokens = 10
    # The first output token; then 1 + 2 drafts scheduled with 2 lookahead slots.
    r.append_output_token_ids([7])
    assert m.allocate_slots(r, 3, num_lookahead_tokens=2) is not None  # slots up to 10 + 3 + 2 = 15
    # One draft accepted plus the bonus token: 2 new known tokens, 11 + 2 = 13 computed... the rest rewound.
    r.num_computed_tokens = 11 + 1
    r.append_output_token_ids([8, 9])
    assert m.allocate_slots(r, 1) is not None
    seq = m._seqs["a"].seq
    assert m._pk.token_ids(seq) == list(range(100, 110)) + [7, 8, 9]
    assert m._pk.num_tokens(seq) == 13
    # Blocks full of known, built tokens are hits for a request with the same prefix: 12 tokens = 3 blocks.
    r2 = _request("b", list(range(100, 110)) + [7, 8, 9, 5])
    _, hit, _ = m.get_computed_blocks(r2)
    assert hit == 12
    stored = [h for e in m.take_events() if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert len(stored) == 3


def test_kv_events_extra_keys_and_full_report_as_vllms():
    """KV events carry each listed block's extra keys as vLLM's (a LoRA name, the cache salt of block 0: a router
    rebuilding the hashes reads them), and a request whose kv_cache_report_mode is 'full' gets its hit's blocks
    reported as stored at the lookup, as vLLM's manager reports them (EventCheck compares every record)."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    def req(rid, tokens, **kw):
        extra = kw.pop("extra_args", None)
        sp = SamplingParams(max_tokens=100, extra_args=extra)
        sp.update_from_generation_config({}, eos_token_id=None)
        return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                       block_hasher=get_request_block_hasher(4, sha256), **kw)

    ours = _manager(pv.KVCacheManager, 64, enable_kv_cache_events=True)
    theirs = _manager(VllmKVCacheManager, 64, enable_kv_cache_events=True)
    ev = EventCheck(ours, theirs, 4)
    lora = LoRARequest("adapter-a", 3, "/nonexistent")
    pairs = []
    for rid, kw in (("salted", {"cache_salt": "tenant-1"}), ("lora", {"lora_request": lora}),
                    ("plain", {}), ("full", {"extra_args": {"kv_cache_report_mode": "full"}})):
        toks = list(range(100, 117))  # 4 full blocks + 1 token
        ra, rb = req(rid, toks, **kw), req(rid, toks, **kw)
        ca, ha, _ = ours.get_computed_blocks(ra)
        cb, hb, _ = theirs.get_computed_blocks(rb)
        assert ha == hb == (16 if rid == "full" else 0)  # "full" hits "plain"'s blocks
        ev.compare(pairs + [(ra, rb)], f"{rid}: lookup")
        assert ours.allocate_slots(ra, 17 - ha, ha, ca) is not None
        assert theirs.allocate_slots(rb, 17 - hb, hb, cb) is not None
        pairs.append((ra, rb))
        ev.compare(pairs, f"{rid}: allocation")
    # One store per allocation (the last takes no new full block) and the report; the salt keys block 0, the LoRA
    # name every block of its request.
    assert ev.records == 4 and ev.listed == 16 and ev.keyed == 1 + 4


@pytest.mark.parametrize("case", ["past", "before"])
def test_kv_event_record_mended_not_raised(case, monkeypatch):
    """A block registered outside the range vLLM would cache in the call (never seen in the differentials) widens
    that call's record to it: a router still learns it. Counted in event_records_mended, warned once, never raised
    in the engine."""
    m = _manager(pv.KVCacheManager, 64, enable_kv_cache_events=True)
    orig = pv.KVCacheManager._convert_call

    def skewed(self, request, s, cache_to):
        if case == "past":  # the call's end said to be one block: blocks 1 and 2 lie past it
            return orig(self, request, s, 4)
        s.cached[0] = 2  # the record said to start at block 2: blocks 0 and 1 lie before it
        return orig(self, request, s, cache_to)

    monkeypatch.setattr(pv.KVCacheManager, "_convert_call", skewed)
    r = _request("a", range(100, 113))  # 13 tokens: 3 full blocks registered
    with pytest.warns(RuntimeWarning, match="widened or trimmed"):
        assert m.allocate_slots(r, 13) is not None
    (e,) = m.take_events()
    assert m.event_records_mended == 1
    assert len(e.block_hashes) == 3 and list(e.token_ids) == list(range(100, 112)) and e.parent_block_hash is None


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_differential_against_vllms_own_manager(seed, spec):
    rng = random.Random(seed)
    bs, nblocks = 4, (4000 if spec else 40)
    ours = _manager(pv.KVCacheManager, nblocks, bs, enable_kv_cache_events=True)
    theirs = _manager(VllmKVCacheManager, nblocks, bs, enable_kv_cache_events=True)
    ev = EventCheck(ours, theirs, bs)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    live = {}  # rid -> (request for ours, request for theirs)
    next_id = 0
    for step in range(300):
        op = rng.random()
        if op < 0.35 or not live:
            if live and rng.random() < 0.4:  # a prompt sharing a live request's tokens, generated ones included
                src = live[rng.choice(sorted(live))][0].all_token_ids
                toks = list(src[:rng.randrange(1, len(src) + 1)])
            else:
                toks = list(rng.choice(prefixes))
            toks += [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
            rid = str(next_id)
            next_id += 1
            ra, rb, ca, ha, cb, hb = lookup_pair(ours, theirs, rid, toks, bs)
            assert ha == hb, f"step {step}: hit {ha} != vLLM's {hb}"
            chunk = rng.randrange(1, len(toks) - ha + 1)
            a = ours.allocate_slots(ra, chunk, ha, ca)
            b = theirs.allocate_slots(rb, chunk, hb, cb)
            assert (a is None) == (b is None), f"step {step}: admission {a} vs vLLM's {b}"
            if a is not None:
                ra.num_computed_tokens = rb.num_computed_tokens = ha + chunk
                live[rid] = (ra, rb)
        elif op < 0.75:
            rid = rng.choice(sorted(live))
            ra, rb = live[rid]
            remaining = ra.num_tokens - ra.num_computed_tokens
            drafts, accepted = 0, 0
            if remaining == 0:  # decode: a sampled token, then its slot (and k draft slots, speculative decoding)
                t = rng.randrange(1000)
                ra.append_output_token_ids([t])
                rb.append_output_token_ids([t])
                n = 1
                if spec and rng.random() < 0.5:
                    drafts = rng.randrange(1, 5)
                    accepted = rng.randrange(0, drafts + 1)
            else:  # the next prefill chunk
                n = rng.randrange(1, remaining + 1)
            a = ours.allocate_slots(ra, n + drafts)
            b = theirs.allocate_slots(rb, n + drafts)
            assert (a is None) == (b is None), f"step {step}: growth {a} vs vLLM's {b}"
            if a is not None:
                ra.num_computed_tokens += n
                rb.num_computed_tokens += n
                if drafts:  # the verification step: `accepted` drafts kept (their K/V computed), the rest rejected
                    acc = [rng.randrange(1000) for _ in range(accepted)]
                    ra.append_output_token_ids(acc)
                    rb.append_output_token_ids(acc)
                    ra.num_computed_tokens += accepted
                    rb.num_computed_tokens += accepted
            else:  # preempt, as the scheduler does
                free_pair(ours, theirs, live, rid)
        else:
            free_random(rng, ours, theirs, live)
        if spec:
            assert ours.block_pool.get_num_free_blocks() >= theirs.block_pool.get_num_free_blocks(), f"step {step}"
        else:
            assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks(), f"step {step}"
        ev.compare(list(live.values()), f"step {step}")
    assert ev.records > 50 and ev.listed > 50


# -- default engine arguments, the scheduler_cls route ----------------------------------------------------------------


def _engine_config(scheduler_cls=None, enable_prefix_caching=True, block_size=16):
    """A VllmConfig as vLLM's engine arguments build it by default (facebook/opt-125m's config: the offline Hugging
    Face cache scripts/vllm-tests.sh lays out), with vLLM's default CacheConfig."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0, max_model_len=2048)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048,
                            is_encoder_decoder=False, scheduler_cls=scheduler_cls)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)


def _engine_kv_cache_config(vllm_config, num_blocks=64):
    """The KVCacheConfig vLLM's engine derives (get_kv_cache_config_from_groups: prefix_cache_retention_interval
    copied from the CacheConfig), for one full-attention layer."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    bs = vllm_config.cache_config.block_size
    if vllm_config.cache_config.kv_cache_layout is None:
        vllm_config.cache_config.kv_cache_layout = "NHD"  # what the engine core resolves before this (CPU backend)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)
    cfg = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(["layer"], spec)],
                                          available_memory=num_blocks * spec.page_size_bytes)
    assert cfg.num_blocks == num_blocks
    vllm_config.cache_config.num_gpu_blocks = num_blocks  # as the engine core records it
    return cfg


def test_default_engine_arguments_construct():
    """vLLM's default CacheConfig sets prefix_cache_retention_interval = 0 and the engine copies it into the
    KVCacheConfig: the adapter accepts it (issue 35: it used to refuse every value but None)."""
    from vllm.config import CacheConfig

    assert CacheConfig().prefix_cache_retention_interval == 0
    vc = _engine_config()
    cfg = _engine_kv_cache_config(vc)
    assert cfg.prefix_cache_retention_interval == 0
    m = pv.KVCacheManager(cfg, max_model_len=2048, scheduler_block_size=16, hash_block_size=16)
    assert m.coordinator.retention_interval == 0
    r = _request("a", range(40), 16)
    assert [len(g) for g in m.allocate_slots(r, 40).get_block_ids()] == [3]


def test_retention_interval_accepted_as_vllms_validator():
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    full = _config(16, 4)
    for value in (None, 0):
        m = pv.KVCacheManager(replace(full, prefix_cache_retention_interval=value), max_model_len=64,
                              scheduler_block_size=4, hash_block_size=4)
        assert m.coordinator.retention_interval == value
        # vLLM's own manager accepts the same values.
        VllmKVCacheManager(replace(full, prefix_cache_retention_interval=value), max_model_len=64,
                           scheduler_block_size=4, hash_block_size=4)
    # A positive value without a sliding-window or Mamba group: vLLM's ValueError, from both.
    for cls in (pv.KVCacheManager, VllmKVCacheManager):
        with pytest.raises(ValueError, match="no sliding-window or Mamba"):
            cls(replace(full, prefix_cache_retention_interval=16), max_model_len=64, scheduler_block_size=4,
                hash_block_size=4)
    swa = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)),
        KVCacheGroupSpec(["w"], SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                                  sliding_window=8))])
    pv.KVCacheManager(swa, max_model_len=64, scheduler_block_size=4, hash_block_size=4)  # None: dense, served
    with pytest.raises(ValueError, match="multiple of scheduler_block_size"):
        pv.KVCacheManager(replace(swa, prefix_cache_retention_interval=6), max_model_len=64, scheduler_block_size=4,
                          hash_block_size=4)
    for value in (0, 8):  # sparse retention of window blocks: mapped (test_adapter_swa_retention.py)
        m = pv.KVCacheManager(replace(swa, prefix_cache_retention_interval=value), max_model_len=64,
                              scheduler_block_size=4, hash_block_size=4)
        assert m.coordinator.retention_interval == value
        assert m._pk.config.window_retention_interval == value


def _schedule_round(sched, requests):
    """One engine step without a model: schedule, then every scheduled request gets one sampled token (7)."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                               pooler_output=[])
    sched.update_from_output(out, runner)
    return out


def test_scheduler_cls_route_with_default_engine_arguments():
    """LLM(..., scheduler_cls="pagedkv.vllm.Scheduler"): vLLM resolves the name (in the engine-core process) to
    vLLM's Scheduler on pagedkv.vllm.KVCacheManager, with the engine's default KVCacheConfig; vLLM's own Scheduler
    built afterwards still gets vLLM's manager; the engine gives requests no block hasher under pagedkv only."""
    import vllm.v1.core.sched.scheduler as sched_mod
    import vllm.v1.engine.core as core
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc = _engine_config(scheduler_cls="pagedkv.vllm.Scheduler")
    cls = vc.scheduler_config.get_scheduler_cls()
    assert cls is pv.Scheduler and issubclass(cls, VllmScheduler)
    cfg = _engine_kv_cache_config(vc)
    sched = cls(vllm_config=vc, kv_cache_config=cfg, block_size=16, log_stats=True,
                structured_output_manager=StructuredOutputManager(vc))
    assert type(sched.kv_cache_manager) is pv.KVCacheManager
    assert sched_mod.KVCacheManager is VllmKVCacheManager  # bound for the construction only
    vc2 = _engine_config()
    plain = VllmScheduler(vllm_config=vc2, kv_cache_config=_engine_kv_cache_config(vc2), block_size=16,
                          log_stats=True, structured_output_manager=StructuredOutputManager(vc2))
    assert type(plain.kv_cache_manager) is VllmKVCacheManager

    class _Core:  # what EngineCore.__init__ does after building its scheduler
        def __init__(self, scheduler):
            self.scheduler = scheduler
            self.request_block_hasher = core.get_request_block_hasher(16, sha256)

    assert _Core(sched).request_block_hasher is None
    assert callable(_Core(plain).request_block_hasher)

    # Requests sharing a 32-token prefix, as the engine makes them (no hasher): the second one hits it.
    sp = SamplingParams(max_tokens=3)
    sp.update_from_generation_config({}, eos_token_id=None)
    shared = list(range(1000, 1032))
    a = Request(request_id="a", prompt_token_ids=shared + [1, 2, 3], sampling_params=sp, pooling_params=None)
    sched.add_request(a)
    for _ in range(4):
        _schedule_round(sched, [a])
    assert a.is_finished() and a.block_hashes == []
    b = Request(request_id="b", prompt_token_ids=shared + [4, 5], sampling_params=sp, pooling_params=None)
    sched.add_request(b)
    out = _schedule_round(sched, [b])
    assert out.num_scheduled_tokens["b"] == 2 and out.scheduled_new_reqs[0].num_computed_tokens == 32


def test_install_warns_when_the_engine_is_out_of_reach():
    """install() from a build tree (no entry point) with vLLM's multiprocessing on warns: the spawned engine would
    run vLLM's own manager; in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) it does not. Run in a fresh process
    (install() patches vLLM's modules)."""
    import subprocess
    import sys

    code = ("import os, warnings\n"
            "import pagedkv.vllm as pv\n"
            "from importlib.metadata import entry_points\n"
            "assert not [e for e in entry_points(group='vllm.general_plugins') if e.value.startswith('pagedkv.')]\n"
            "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    pv.install()\n"
            "assert not w, [str(x.message) for x in w]\n"
            "assert os.environ['PAGEDKV_VLLM'] == '1'\n"
            "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '1'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    pv.install()\n"
            "assert len(w) == 1 and issubclass(w[0].category, RuntimeWarning), w\n"
            "assert 'scheduler_cls' in str(w[0].message)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_decode_fast_path_lags_and_catches_up():
    """A decode token that needs no block and fills none is answered from the mirror alone (no crossing, pagedkv
    unchanged, also across new_step_starts); the request's next growth (the token that fills the block) hands the
    lagging tokens to pagedkv with its own, registers the block (a hit for the next request, as vLLM caches it at
    allocation); a call that reads the sequence first takes the lag out of the mirror; free drops it."""
    m = _manager(pv.KVCacheManager, 64)
    r = _request("a", range(100, 106))  # 6 prompt tokens, block size 4
    assert m.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    s = m._seqs["a"]
    seq = s.seq
    r.append_output_token_ids([7])  # position 6: inside block 1, fills nothing
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks
    assert m._pk.num_tokens(seq) == 6 and s.lag == 1 and s.slotted == s.known == 7  # not in pagedkv yet
    m.new_step_starts()
    assert m._pk.num_tokens(seq) == 6 and s.lag == 1
    r.num_computed_tokens = 7
    r.append_output_token_ids([8])  # position 7 fills block 1: the full path carries both tokens, registered at once
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks
    assert s.lag == 0 and m._pk.num_tokens(seq) == 8 and list(m._pk.token_ids(seq)[-3:]) == [105, 7, 8]
    _, hit, _ = m.get_computed_blocks(_request("b", list(range(100, 106)) + [7, 8, 1]))
    assert hit == 8
    r.num_computed_tokens = 8
    r.append_output_token_ids([9])  # position 8: a new block, the full path
    blocks = m.allocate_slots(r, 1)
    assert [len(g) for g in blocks.get_block_ids()] == [1]
    r.num_computed_tokens = 9
    r.append_output_token_ids([10])  # position 9: lags
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks and s.lag == 1
    assert m.coordinator.get_num_blocks_to_allocate("a", 13, (), 0, 9, 9, 13) == 1  # reads pagedkv: lag out first
    assert s.lag == 0 and s.slotted == s.known == 9 == m._pk.num_tokens(seq)
    r.num_computed_tokens = 10
    r.append_output_token_ids([11])  # position 10 after the lag left the mirror: the full path carries 9 and 10
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks
    assert m._pk.num_tokens(seq) == 11 and list(m._pk.token_ids(seq)[-3:]) == [9, 10, 11]
    r.num_computed_tokens = 11
    r.append_output_token_ids([12])  # position 11 fills block 2: full path
    m.allocate_slots(r, 1)
    r.num_computed_tokens = 12
    r.append_output_token_ids([13])  # position 12: a new block
    m.allocate_slots(r, 1)
    r.num_computed_tokens = 13
    r.append_output_token_ids([14])  # position 13: lags, then freed
    assert m.allocate_slots(r, 1) is m.empty_kv_cache_blocks and s.lag == 1
    m.free(r)
    assert seq not in m._pk and "a" not in m._seqs


@pytest.mark.parametrize("layout", ["full", "full+swa", "full+mamba-align"])
def test_block_ids_handed_out_never_change(layout):
    """vLLM's worker keeps its own append-only copy of each request's block table: a new request's row is
    get_block_ids at its admission, a running one's grows by the ids allocate_slots returns. Requests computing the
    same prompt at once (chunked prefill of identical prompts) must keep every id handed out (pagedkv's build would
    otherwise switch a duplicate to the registered copy and release it: CacheConfig.deduplicate_blocks is off), so
    each non-null entry of the manager's rows equals the worker's."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from _pairs import make_config

    specs = [FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)]
    if layout == "full+swa":
        specs.append(SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                       sliding_window=8))
    if layout == "full+mamba-align":
        specs.append(MambaSpec(block_size=4, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"))
    m = pv.KVCacheManager(make_config(400, specs), max_model_len=400, scheduler_block_size=4, hash_block_size=4)
    rng = random.Random(7)
    prompts = [[rng.randrange(30) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    live, rows, next_id, checked, admitted = {}, {}, 0, 0, 0
    for step in range(300):
        m.new_step_starts()  # a scheduler step per operation
        if len(live) < 6 and rng.random() < 0.4:
            rid = str(next_id)
            next_id += 1
            r = _request(rid, rng.choice(prompts))
            blocks, hit, _ = m.get_computed_blocks(r)
            n = 4 * rng.randrange(1, 4)  # whole blocks, as align mode's scheduler cuts chunks
            if m.allocate_slots(r, min(n, r.num_tokens - hit), hit, blocks) is None:
                continue
            r.num_computed_tokens = hit + min(n, r.num_tokens - hit)
            live[rid] = r
            admitted += 1
            rows[rid] = [list(x) for x in m.get_block_ids(rid)]
        elif live:
            rid = rng.choice(sorted(live))
            r = live[rid]
            if r.num_computed_tokens == r.num_tokens:
                if r.num_tokens > r.num_prompt_tokens + 6:
                    m.free(r)
                    del live[rid], rows[rid]
                    continue
                r.append_output_token_ids([rng.randrange(30)])
            left = r.num_tokens - r.num_computed_tokens
            n = min(left, 4 * rng.randrange(1, 4)) if left > 1 else 1
            got = m.allocate_slots(r, n)
            assert got is not None
            for g, new in enumerate(got.get_block_ids()):
                rows[rid][g].extend(new)
            r.num_computed_tokens += n
        for rid in live:
            for g, (worker, ours) in enumerate(zip(rows[rid], m.get_block_ids(rid))):
                assert len(worker) == len(ours), f"step {step}: request {rid} group {g}"
                for i, b in enumerate(ours):
                    if b:
                        assert worker[i] == b, f"step {step}: request {rid} group {g} entry {i}: {worker[i]} -> {b}"
                        checked += 1
    assert admitted > 20 and checked > 500
