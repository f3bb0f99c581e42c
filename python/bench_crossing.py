#!/usr/bin/env python3
"""Per-step host cost of pagedkv from Python beside the same work in C++ (docs/python.md "Crossing cost").

  decode step: 256 running sequences (prompts of 1000-4000 tokens, block size 16, a pool of 2^17 blocks), one step =
               append_tokens (one token each, one call) + build_batch_metadata into preallocated numpy buffers
               (CSR page table, padded block table of 512 blocks per sequence, seq_lens, qo_indptr, slot mapping,
               copy list). As benchmarks/bench_decode_step.cpp BM_DecodeStep/batch:256/pool_blocks:131072: lengths
               are reset every 256 steps (free + re-admit, untimed).
  admission:   a 2048-token prompt whose first half is cached (64 prefixes, fresh suffixes): try_admit +
               build_batch_metadata of the prefill + free, three calls. As benchmarks/bench_prefix_cache.cpp
               BM_AdmitFree/prompt_tokens:2048.
Each case is timed per iteration, wall (perf_counter_ns) and thread CPU time (thread_time_ns); the table gives the
medians (and the wall 10th / 90th percentiles) over all iterations of --repeats runs. With --cpp-bench-dir the C++
benchmarks are run (median of --repeats repetitions of Google Benchmark's per-iteration mean, wall and CPU) and the
ratio Python / C++ of the CPU times is printed: on a shared machine the CPU times are the comparable pair (a mean
of wall time absorbs every preemption, a median of single iterations mostly skips them).

With --vllm (vLLM 0.32.0 importable: the venv of scripts/install-deps.sh) the same two cases also run, in the same
process, on vLLM's own Python KVCacheManager (vllm.v1.core.kv_cache_manager) and on pagedkv.vllm.KVCacheManager (the
adapter with vLLM's interface): a decode step = per request, append the sampled token (vLLM hashes a block when it
fills) and allocate_slots(request, 1), 256 requests; an admission = Request construction (vLLM hashes the prompt's
blocks there) + get_computed_blocks + allocate_slots + free. vLLM's manager builds no page table (its worker keeps
the block table), so its decode row does less than pagedkv's append_tokens + build.

With --vllm-scheduler (only that) vLLM 0.32.0's real Scheduler (schedule + update_from_output with a stand-in
model output, one sampled token per request) runs on vLLM's own manager and on pagedkv.vllm.Scheduler, requests made
as the engine core makes them (with the block hasher the engine gives: vLLM's on vLLM's manager, none under the
adapter), in three workloads: "decode" (256 requests of 1000-4000 prompt tokens decoding, one token each per step),
"admission" (each step admits one 2048-token prompt whose first 1024 tokens are a cached prefix, 1 output token:
Request + add_request + schedule + update), "mixed" (both at once). Rounds interleave the managers (order
alternating), each a fresh Scheduler; step_us is the step's wall median, in_manager_us the median time inside the
manager's public methods (each wrapped alike); pagedkv's rows add the median per-round ratios. --json prints one
JSON row per workload and manager. With --kv-events both run with KV events on (KVEventsConfig with the "null"
publisher: each step's events are built and taken, published nowhere), as on a KV-aware router's pods.

With --vllm-eagle-window (only that) the admission case of --vllm runs on full attention + a 128-token sliding window
under EAGLE (gpt-oss with an EAGLE-3 drafter: the hit is proven by the block after it, matched then dropped), vLLM's
manager and pagedkv.vllm's in interleaved runs of the same seed; it prints both medians and the per-run ratios.

Usage: PYTHONPATH=build-py/python python python/bench_crossing.py [--cpp-bench-dir build-bench/benchmarks] [--vllm]
       PYTHONPATH=build-py/python <vLLM venv>/bin/python python/bench_crossing.py --vllm-scheduler --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import sys

import numpy as np

# This script lives beside the source package python/pagedkv (no extension in it): import the built or installed one.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
import pagedkv  # noqa: E402

BS = 16
MAX_SEQ = 8192
MAX_BLOCKS = MAX_SEQ // BS


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_decode(hasher: str, batch: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1000, 4001, size=batch)
    prompts = [rng.integers(1, 128000, size=n, dtype=np.int32) for n in lens]
    ids = rng.integers(1, 2**62, size=batch, dtype=np.int64)
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=1 << 17, block_size=BS, hash_seed=seed,
                                                   max_tokens_per_seq=MAX_SEQ), hasher=hasher)
    limits = pagedkv.BatchMetadataLimits(max_batch=batch, max_tokens_per_step=batch * 4000,
                                         max_blocks_per_seq=MAX_BLOCKS)
    prefill = pagedkv.BatchMetadataBuffers(limits)
    step_buf = pagedkv.BatchMetadataBuffers(pagedkv.BatchMetadataLimits(max_batch=batch, max_tokens_per_step=batch,
                                                                        max_blocks_per_seq=MAX_BLOCKS))
    kw = step_buf.kwargs()

    def admit_all():
        for s, p in zip(ids, prompts):
            assert m.try_admit(int(s), p).admitted
        m.build_batch_metadata(ids, **prefill.kwargs())

    admit_all()
    tokens = rng.integers(1, 128000, size=(steps, batch), dtype=np.int32)
    out = np.empty(batch, np.uint8)
    times = []
    for k in range(steps):
        if k and k % 256 == 0:
            m.free_many(ids)
            admit_all()
        tok = tokens[k]
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        m.append_tokens(ids, tok, out=out)
        m.build_batch_metadata(ids, **kw)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        times.append((t1 - t0, c1 - c0))
        if out.any():
            raise RuntimeError("an append failed")
    return times


def bench_admit(hasher: str, prompt_tokens: int, iters: int, seed: int):
    rng = np.random.default_rng(seed)
    prefix = prompt_tokens // 2
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=1 << 16, block_size=BS, hash_seed=seed), hasher=hasher)
    prompts = [rng.integers(1, 128000, size=prompt_tokens, dtype=np.int32) for _ in range(64)]
    slots = np.empty(prompt_tokens, np.int64)
    kw = dict(indptr=np.empty(2, np.int32), indices=np.empty(MAX_BLOCKS, np.int32),
              last_page_len=np.empty(1, np.int32), seq_lens=np.empty(1, np.int32), qo_indptr=np.empty(2, np.int32),
              slot_mapping=slots, copies=np.empty((1, 2), np.int32))
    seq = 1
    for p in prompts:
        assert m.try_admit(seq, p[:prefix + 1]).admitted
        m.build_batch_metadata([seq], **kw)
        m.free(seq)
        seq += 1
    unique = 1
    times = []
    cached = 0
    for k in range(iters):
        p = prompts[k % 64]
        p[prefix] = 1 + (unique % 2_000_000_000)
        unique += 1
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        r = m.try_admit(seq, p)
        m.build_batch_metadata([seq], **kw)
        m.free(seq)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        times.append((t1 - t0, c1 - c0))
        cached += r.num_cached_tokens
        seq += 1
    if cached != iters * prefix:
        raise RuntimeError("admission did not hit exactly the shared prefix")
    return times


def _vllm_env():
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)

    def config(num_blocks):
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float16))])

    def request(rid, tokens):
        sp = SamplingParams(max_tokens=1 << 20)
        sp.update_from_generation_config({}, eos_token_id=None)
        return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                       block_hasher=hasher)

    return config, request


def _vllm_managers():
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Vllm

    import pagedkv.vllm as pv
    return (("vLLM's KVCacheManager", Vllm), ("pagedkv.vllm.KVCacheManager", pv.KVCacheManager))


def bench_vllm_decode(cls, batch: int, steps: int, seed: int):
    config, request = _vllm_env()
    rng = np.random.default_rng(seed)
    lens = rng.integers(1000, 4001, size=batch)
    prompts = [rng.integers(1, 128000, size=n).tolist() for n in lens]
    m = cls(config(1 << 17), max_model_len=MAX_SEQ, scheduler_block_size=BS, hash_block_size=BS)
    reqs = []

    def admit_all():
        reqs.clear()
        for i, p in enumerate(prompts):
            r = request(f"{seed}-{len(reqs)}-{rng.integers(1 << 30)}", p)
            assert m.allocate_slots(r, len(p)) is not None
            r.num_computed_tokens = len(p)
            reqs.append(r)

    admit_all()
    tokens = rng.integers(1, 128000, size=(steps, batch)).tolist()
    times = []
    for k in range(steps):
        if k and k % 256 == 0:
            for r in reqs:
                m.free(r)
            admit_all()
        tok = tokens[k]
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        for r, t in zip(reqs, tok):
            r.append_output_token_ids(t)
            if m.allocate_slots(r, 1) is None:
                raise RuntimeError("an allocation failed")
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        for r in reqs:
            r.num_computed_tokens += 1
        times.append((t1 - t0, c1 - c0))
    return times


def _eagle_window_config(num_blocks: int, window: int = 128):
    """A KVCacheConfig of full attention + a sliding window of `window` tokens at block size BS (gpt-oss's layout)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    kw = dict(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full"], FullAttentionSpec(**kw)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(sliding_window=window, **kw))])


def bench_vllm_admit(cls, prompt_tokens: int, iters: int, seed: int, eagle_window: bool = False):
    """Admissions of a `prompt_tokens` prompt half cached (Request + get_computed_blocks + allocate_slots + free):
    one full-attention group, or (`eagle_window`) full attention + a 128-token window under EAGLE, whose hit is one
    block shorter (the block after it is matched, then dropped)."""
    config, request = _vllm_env()
    rng = np.random.default_rng(seed)
    prefix = prompt_tokens // 2
    cfg = _eagle_window_config(1 << 16) if eagle_window else config(1 << 16)
    m = cls(cfg, max_model_len=MAX_SEQ, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True,
            use_eagle=eagle_window)
    prompts = [rng.integers(1, 128000, size=prompt_tokens).tolist() for _ in range(64)]
    for i, p in enumerate(prompts):
        r = request(f"warm{i}", p[:prefix + 1])
        assert m.allocate_slots(r, prefix + 1) is not None
        m.free(r)
    times = []
    cached = 0
    for k in range(iters):
        p = prompts[k % 64]
        p[prefix] = 1 + (k % 2_000_000_000)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        r = request(f"r{k}", p)
        blocks, hit, _ = m.get_computed_blocks(r)
        if m.allocate_slots(r, prompt_tokens - hit, hit, blocks) is None:
            raise RuntimeError("an admission failed")
        m.free(r)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        times.append((t1 - t0, c1 - c0))
        cached += hit
    want = iters * (prefix - BS if eagle_window else prefix)
    if cached != want:
        raise RuntimeError(f"admission did not hit exactly the shared prefix ({cached} != {want})")
    return times


# -- vLLM's real Scheduler on both managers (--vllm-scheduler) ---------------------------------------------------------

_SCHED_WORKLOADS = ("decode", "admission", "mixed")


def _offline_opt125m_cache() -> None:
    """facebook/opt-125m's config.json (python/vllm_compat/hf: architecture facts only) as an offline Hugging Face
    cache in a temporary directory, for vLLM's ModelConfig; nothing is downloaded."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="pagedkv-bench-hf-")
    repo = os.path.join(root, "hub", "models--facebook--opt-125m")
    snap = os.path.join(repo, "snapshots", "0" * 40)
    os.makedirs(snap)
    os.makedirs(os.path.join(repo, "refs"))
    shutil.copy(os.path.join(_here, "vllm_compat", "hf", "opt-125m", "config.json"), snap)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0" * 40)
    os.environ.update(HF_HOME=root, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # opt-125m says 2048; the scheduler never runs the model


class _Timed:
    """Wraps every public method of a KVCacheManager instance to add its time to .ns (both managers alike)."""

    def __init__(self, manager):
        self.ns = 0
        for name in dir(type(manager)):
            if name.startswith("_"):
                continue
            fn = getattr(manager, name, None)
            if not callable(fn) or isinstance(getattr(type(manager), name, None), property):
                continue
            setattr(manager, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.ns += time.perf_counter_ns() - t0
        return timed


class _SchedulerRun:
    """One vLLM 0.32.0 Scheduler (facebook/opt-125m's config, block size 16, 2^17 blocks, prefix caching on) on
    `manager` ("vllm" or "pagedkv"), with requests made as vLLM's engine core makes them: Request(...,
    block_hasher=) the hasher the engine gives (vLLM's per-block sha256 hasher on vLLM's manager; None on pagedkv's,
    whose engine turns it off)."""

    def __init__(self, manager: str, seed: int, kv_events: bool = False):
        import torch
        from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        import pagedkv.vllm as pv

        self.Request, self.ModelRunnerOutput = Request, ModelRunnerOutput
        init_none_hash(sha256)
        cls = pv.Scheduler if manager == "pagedkv" else VllmScheduler
        self.hasher = None if manager == "pagedkv" else get_request_block_hasher(BS, sha256)
        model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0, max_model_len=MAX_SEQ)
        sched = SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=MAX_SEQ,
                                is_encoder_decoder=False)
        vc = VllmConfig(model_config=model, scheduler_config=sched,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                        if kv_events else None)
        kv = KVCacheConfig(num_blocks=1 << 17, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float16))],
            prefix_cache_retention_interval=vc.cache_config.prefix_cache_retention_interval)
        vc.cache_config.num_gpu_blocks = kv.num_blocks  # as the engine core records it
        self.s = cls(vllm_config=vc, kv_cache_config=kv, block_size=BS, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc))
        self.timer = _Timed(self.s.kv_cache_manager)
        self.rng = np.random.default_rng(seed)
        self.sp_long = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
        self.sp_one = SamplingParams(max_tokens=1, ignore_eos=True)
        for sp in (self.sp_long, self.sp_one):
            sp.update_from_generation_config({}, eos_token_id=None)
        self.next_id = 0
        self.short_hits = 0
        self.prefixes = [self.rng.integers(1, 128000, size=1024).tolist() for _ in range(64)]

    def request(self, tokens, sp):
        self.next_id += 1
        return self.Request(request_id=f"r{self.next_id}", prompt_token_ids=tokens, sampling_params=sp,
                            pooling_params=None, block_hasher=self.hasher)

    def step(self):
        out = self.s.schedule()
        ids = list(out.num_scheduled_tokens)
        toks = self.rng.integers(1, 128000, size=len(ids)).tolist()
        runner = self.ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                        sampled_token_ids=[[t] for t in toks], logprobs=None,
                                        prompt_logprobs_dict={}, pooler_output=[])
        self.s.update_from_output(out, runner)
        return out

    def admission_request(self):
        """A 2048-token prompt whose first 1024 tokens are one of 64 cached prefixes (1 output token)."""
        p = self.prefixes[self.next_id % 64]
        return self.request(p + self.rng.integers(1, 128000, size=1024).tolist(), self.sp_one)

    def setup(self, workload):
        # The admission prefixes are cached (they count as their first requests' prefill, untimed).
        for p in self.prefixes:
            self.s.add_request(self.request(p + [1], self.sp_one))
        while self.s.get_num_unfinished_requests():
            self.step()
        if workload in ("decode", "mixed"):
            lens = self.rng.integers(1000, 4001, size=256)
            for n in lens:
                self.s.add_request(self.request(self.rng.integers(1, 128000, size=int(n)).tolist(), self.sp_long))
            while len(self.s.running) < 256 or self.s.waiting:
                self.step()
            self.step()  # every request is decoding now

    def timed_step(self, workload):
        t_in = self.timer.ns
        t0 = time.perf_counter_ns()
        if workload != "decode":
            self.s.add_request(self.admission_request())  # the engine core's add_request: Request + scheduler
        out = self.step()
        t1 = time.perf_counter_ns()
        want = {"decode": 256, "admission": 1, "mixed": 257}[workload]
        if len(out.num_scheduled_tokens) != want:
            raise RuntimeError(f"{workload}: {len(out.num_scheduled_tokens)} requests scheduled, not {want}")
        if workload != "decode" and out.num_scheduled_tokens[f"r{self.next_id}"] != 1024:
            self.short_hits += 1  # the admission did not hit exactly its 1024-token prefix (reported)
        return t1 - t0, self.timer.ns - t_in


def bench_vllm_scheduler(rounds: int, steps: int, seed: int = 7, kv_events: bool = False):
    """Per workload, `rounds` interleaved rounds (vLLM's manager, then pagedkv's; the order alternates), each a fresh
    Scheduler timed over `steps` steps. Returns rows: workload, manager, step_us and in_manager_us (medians of all
    steps), and for pagedkv the median of the per-round ratios pagedkv / vLLM (step_ratio, in_manager_ratio)."""
    _offline_opt125m_cache()
    rows = []
    for workload in _SCHED_WORKLOADS:
        per = {"vllm": [], "pagedkv": []}
        med = {"vllm": [], "pagedkv": []}
        short = {"vllm": 0, "pagedkv": 0}
        for r in range(rounds):
            order = ("vllm", "pagedkv") if r % 2 == 0 else ("pagedkv", "vllm")
            for manager in order:
                run = _SchedulerRun(manager, seed + r, kv_events)
                run.setup(workload)
                xs = [run.timed_step(workload) for _ in range(steps)]
                per[manager] += xs
                short[manager] += run.short_hits
                med[manager].append((statistics.median(w for w, _ in xs), statistics.median(i for _, i in xs)))
        for manager in ("vllm", "pagedkv"):
            xs = per[manager]
            row = {"workload": workload, "manager": manager, "step_us": statistics.median(w for w, _ in xs) / 1e3,
                   "in_manager_us": statistics.median(i for _, i in xs) / 1e3, "rounds": rounds,
                   "steps_per_round": steps, "admissions_missing_prefix_blocks": short[manager],
                   "kv_events": kv_events}
            if manager == "pagedkv":
                row["step_ratio"] = statistics.median(p[0] / v[0] for p, v in zip(med["pagedkv"], med["vllm"]))
                row["in_manager_ratio"] = statistics.median(p[1] / v[1]
                                                            for p, v in zip(med["pagedkv"], med["vllm"]))
            rows.append(row)
    return rows


def bench_call_floor(iters: int):
    """The cheapest bound call (num_tokens of a live sequence): nanobind's crossing alone."""
    m = pagedkv.KVCacheManager(pagedkv.CacheConfig(num_blocks=16, block_size=BS))
    m.try_admit(1, [1, 2, 3])
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        m.num_tokens(1)
        times.append(time.perf_counter_ns() - t0)
    return times


def run_cpp(bench_dir: str, exe: str, filt: str, repeats: int):
    path = os.path.join(bench_dir, exe)
    if not os.access(path, os.X_OK):
        return None
    out = subprocess.run([path, f"--benchmark_filter={filt}", f"--benchmark_repetitions={repeats}",
                          "--benchmark_format=json", "--benchmark_min_time=0.5"],
                         check=True, capture_output=True, text=True).stdout
    rows = [b for b in json.loads(out)["benchmarks"] if b.get("aggregate_name") == "median"]
    if not rows:
        return None
    b = rows[0]
    scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[b["time_unit"]]
    return b["real_time"] * scale, b["cpu_time"] * scale, b["name"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpp-bench-dir", default="", help="directory holding bench_decode_step and bench_prefix_cache")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1024, help="decode steps per run")
    ap.add_argument("--admits", type=int, default=2000, help="admissions per run")
    ap.add_argument("--hasher", default="sha256")
    ap.add_argument("--vllm", action="store_true", help="also time vLLM's KVCacheManager and pagedkv.vllm's")
    ap.add_argument("--vllm-scheduler", action="store_true",
                    help="only: vLLM's real Scheduler on vLLM's manager and on pagedkv.vllm's, interleaved rounds")
    ap.add_argument("--rounds", type=int, default=12, help="--vllm-scheduler: interleaved rounds per workload")
    ap.add_argument("--sched-steps", type=int, default=40, help="--vllm-scheduler: timed steps per round")
    ap.add_argument("--json", action="store_true", help="--vllm-scheduler: one JSON row per workload and manager")
    ap.add_argument("--kv-events", action="store_true", help="--vllm-scheduler: KV events on (null publisher)")
    ap.add_argument("--vllm-eagle-window", action="store_true",
                    help="only: admissions (2048 tokens, half cached) on full attention + a 128-token window under "
                         "EAGLE, vLLM's manager and pagedkv.vllm's, interleaved runs")
    args = ap.parse_args()

    if args.vllm_eagle_window:
        (vname, vcls), (pname, pcls) = _vllm_managers()
        va, pa, ratios = [], [], []
        for r in range(args.repeats):  # interleaved: a run of each, same seed
            a = bench_vllm_admit(vcls, 2048, args.admits, seed=21 + r, eagle_window=True)
            b = bench_vllm_admit(pcls, 2048, args.admits, seed=21 + r, eagle_window=True)
            va += a
            pa += b
            ratios.append(statistics.median(w for w, _ in b) / statistics.median(w for w, _ in a))
        print(f"Admissions of a 2048-token prompt half cached, full attention + a 128-token window, EAGLE "
              f"({args.admits} per run, {args.repeats} interleaved runs)")
        print("| manager | wall median (p10-p90) | CPU median |")
        print("|---|---|---|")
        for name, xs in ((vname, va), (pname, pa)):
            wall = [w for w, _ in xs]
            print(f"| {name} | {statistics.median(wall) / 1e3:.1f} us ({pct(wall, 0.1) / 1e3:.1f}-"
                  f"{pct(wall, 0.9) / 1e3:.1f}) | {statistics.median(c for _, c in xs) / 1e3:.1f} us |")
        print(f"pagedkv.vllm / vLLM, per run (wall medians): {', '.join(f'{x:.2f}' for x in ratios)}")
        print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", file=sys.stderr)
        return

    if args.vllm_scheduler:
        rows = bench_vllm_scheduler(args.rounds, args.sched_steps, kv_events=args.kv_events)
        if args.json:
            for row in rows:
                print(json.dumps(row))
        else:
            print(f"vLLM 0.32.0's Scheduler, {args.rounds} interleaved rounds x {args.sched_steps} steps"
                  + (", KV events on" if args.kv_events else ""))
            print("| workload | manager | step median | in manager median | step ratio | in-manager ratio |")
            print("|---|---|---|---|---|---|")
            for row in rows:
                ratio = (f"{row['step_ratio']:.2f} | {row['in_manager_ratio']:.2f}" if "step_ratio" in row
                         else "- | -")
                print(f"| {row['workload']} | {row['manager']} | {row['step_us']:.1f} us | "
                      f"{row['in_manager_us']:.1f} us | {ratio} |")
        print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", file=sys.stderr)
        return

    dec, adm = [], []
    for r in range(args.repeats):
        dec += bench_decode(args.hasher, 256, args.steps, seed=11 + r)
        adm += bench_admit(args.hasher, 2048, args.admits, seed=21 + r)
    floor = bench_call_floor(20000)
    tmpl = "Sha256Hasher" if args.hasher == "sha256" else "Xxh3Hasher"
    dec_filter = ("BM_DecodeStep/batch:256/pool_blocks:131072$" if args.hasher == "sha256"
                  else "BM_DecodeStepXxh3/batch:256/pool_blocks:131072$")
    cpp = {}
    if args.cpp_bench_dir:
        cpp["decode"] = run_cpp(args.cpp_bench_dir, "bench_decode_step", dec_filter, args.repeats)
        cpp["admit"] = run_cpp(args.cpp_bench_dir, "bench_prefix_cache",
                               f"BM_AdmitFree<{tmpl}>/prompt_tokens:2048$", args.repeats)

    print(f"pagedkv {pagedkv.__version__}, hasher {args.hasher}, {args.repeats} runs")
    print("| case | Python wall median (p10-p90) | Python CPU median | C++ wall median | C++ CPU median "
          "| Python / C++ (CPU) |")
    print("|---|---|---|---|---|---|")
    for key, name, xs in (("decode", "decode step, 256 sequences (append_tokens + build into numpy)", dec),
                          ("admit", "admission, 2048-token prompt half cached (try_admit + build + free)", adm)):
        wall = [w for w, _ in xs]
        cpu = [c for _, c in xs]
        med, cmed = statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3
        c = cpp.get(key)
        cw = f"{c[0] / 1e3:.1f} us" if c else "-"
        cc = f"{c[1] / 1e3:.1f} us" if c else "-"
        ratio = f"{cmed / (c[1] / 1e3):.2f}" if c else "-"
        print(f"| {name} | {med:.1f} us ({pct(wall, 0.1) / 1e3:.1f}-{pct(wall, 0.9) / 1e3:.1f}) | {cmed:.1f} us "
              f"| {cw} | {cc} | {ratio} |")
    print(f"| one trivial bound call (num_tokens), wall | {statistics.median(floor):.0f} ns | | | | |")
    if args.vllm:
        steps = max(args.steps // 4, 64)
        print()
        print(f"Beside vLLM 0.32.0 in the same process ({steps} decode steps and {args.admits} admissions per run, "
              f"{args.repeats} runs; pagedkv row: the bindings as above)")
        print("| manager | decode step, 256 requests: wall median (p10-p90) | CPU median "
              "| admission, 2048 tokens half cached: wall median (p10-p90) | CPU median |")
        print("|---|---|---|---|---|")

        def cells(xs):
            wall = [w for w, _ in xs]
            cpu = [c for _, c in xs]
            return (f"{statistics.median(wall) / 1e3:.1f} us ({pct(wall, 0.1) / 1e3:.1f}-{pct(wall, 0.9) / 1e3:.1f})"
                    f" | {statistics.median(cpu) / 1e3:.1f} us")

        print(f"| pagedkv (append_tokens + build; try_admit + build + free) | {cells(dec)} | {cells(adm)} |")
        for name, cls in _vllm_managers():
            vd, va = [], []
            for r in range(args.repeats):
                vd += bench_vllm_decode(cls, 256, steps, seed=11 + r)
                va += bench_vllm_admit(cls, 2048, args.admits, seed=21 + r)
            print(f"| {name} (per request: append + allocate_slots; Request + get_computed_blocks + "
                  f"allocate_slots + free) | {cells(vd)} | {cells(va)} |")
    for key in ("decode", "admit"):
        if cpp.get(key):
            print(f"C++ {key}: {cpp[key][2]} (Google Benchmark: mean per iteration; median of the repetitions)")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
