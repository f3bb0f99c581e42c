"""Check the emulator rule of docs/vllm-swa-retention.md section 4 against vLLM 0.32.0 (CPU, no scheduler needed).

Research tool (session 44), not run by the tests: the oracle for mapping vLLM's sparse retention of
sliding-window blocks onto pagedkv (issue 35).

Part 1: the closed-form mask R(P, J, I, W, bs, A, eagle) == SlidingWindowManager.reachable_block_mask over a grid,
        and the mask of any [start, end) sub-range == the slice of the full mask (position-absolute).
Part 2: end-to-end on vLLM's real KVCacheManager (no eviction: a large pool): random prompts sharing random prefixes
        of earlier ones, random chunk sizes, a few decode steps, requests freed in sequence. For every request the set
        of SWA block indexes that got a hash (fresh blocks only) must equal  R ∩ [h/bs, cacheable(n_last)/bs), and the
        hit h and shared_prefix_boundary J must equal an emulator that keeps only {group: set of registered prefix
        keys} (full attention dense, SWA per R) and re-implements the two lookups.
Run: ~/.cache/pagedkv/vllm-0.32.0-venv/bin/python python/vllm_compat/research/swa_retention_rule.py [N_TRIALS [SEED]]
(the venv scripts/install-deps.sh installs; about 30 s for 900 trials).
"""
import random, sys, itertools
from dataclasses import replace
import torch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams

init_none_hash(sha256)
cdiv = lambda a, b: -(-a // b)


# ---------------------------------------------------------------- the rule (spec section 4)
def boundaries(P, J, sbs, eagle):
    """replay_boundaries (kv_cache_coordinator.py) + the junction."""
    if not eagle:
        b = [P - 1]
    else:
        b = sorted({max((P - 1) // sbs * sbs - sbs, 0), max(P // sbs * sbs - sbs, 0)})
    return b + ([J] if J else [])


def R(i, P, J, I, W, bs, A, eagle, sbs):
    """Is SWA block index i (tokens [i*bs, (i+1)*bs)) registered when it becomes full and cacheable?"""
    if A % bs:
        return True                               # sub-block alignment: dense
    need = cdiv(W - 1, bs) + (1 if eagle else 0)
    shift = 1 if eagle else 0
    seg = A if I is None else (I or None)         # None -> A; 0 -> no segment tails; I>0 -> I
    if seg is not None:
        per = seg // bs
        if need >= per:
            return True                           # every block reachable: dense
        if i >= shift and (i - shift) % per >= per - need:
            return True
    if I is not None:
        for b in boundaries(P, J, sbs, eagle):
            e = b // A * A // bs + shift
            if e - need <= i < e:
                return True
    return False


# ---------------------------------------------------------------- part 1
def part1():
    n = 0
    for bs, W, Am, I, eagle, P, J in itertools.product(
            (4, 16), (4, 16, 17, 32, 48, 100), (1, 2, 4), (None, 0, 1, 2, 4, 8), (False, True),
            (1, 2, 15, 16, 17, 63, 64, 65, 100, 255, 256), (0, 16, 32, 48, 64)):
        A = bs * Am
        I = None if I is None else I * A
        if J >= P:
            continue
        spec = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=W)
        bnd = list(replay_boundaries(P, A, eagle)) + ([J] if J else [])
        assert bnd == boundaries(P, J, A, eagle)
        end = 70
        full = SlidingWindowManager.reachable_block_mask(start_block=0, end_block=end, alignment_tokens=A,
                                                         kv_cache_spec=spec, use_eagle=eagle, retention_interval=I,
                                                         reachable_boundaries=bnd)
        got = [True] * end if full is None else full
        exp = [R(i, P, J, I, W, bs, A, eagle, A) for i in range(end)]
        assert got == exp, (bs, W, A, I, eagle, P, J, got, exp)
        for s, e in ((3, 9), (10, 11), (17, 40)):
            sub = SlidingWindowManager.reachable_block_mask(start_block=s, end_block=e, alignment_tokens=A,
                                                            kv_cache_spec=spec, use_eagle=eagle,
                                                            retention_interval=I, reachable_boundaries=bnd)
            assert ([True] * (e - s) if sub is None else sub) == got[s:e]
        n += 1
    print(f"part 1: {n} (bs, W, A, I, eagle, P, J) cases: closed form == reachable_block_mask, sub-ranges == slices")


# ---------------------------------------------------------------- part 2
def swa_lookup(cached, max_length, bs, A, W, drop_eagle):
    """SlidingWindowManager.find_longest_cache_hit on a predicate cached(i) -> hit tokens."""
    need = cdiv(W - 1, bs) + (1 if drop_eagle else 0)
    nmax = max_length // bs
    run = 0
    for i in range(nmax - 1, -1, -1):
        if cached(i):
            if run == 0 and bs != A:
                post = i if drop_eagle else i + 1
                if post * bs % A:
                    continue
            run += 1
            if run >= need:
                n = i + run
                break
        else:
            run = 0
    else:
        n = run
        while bs != A and n * bs % A:
            n -= 1
    if drop_eagle and n:
        n -= 1
        while bs != A and n * bs % A:
            n -= 1
    return n * bs


def part2(trials, seed=0):
    rng = random.Random(seed)
    configs = []
    for pure, fa_mult, bs, W, I_mult, eagle in itertools.product(
            (False, True), (1, 2), (4, 8), (4, 8, 13, 24, 40), (None, 0, 1, 2, 3), (False, True)):
        if pure and fa_mult != 1:
            continue
        configs.append((pure, fa_mult, bs, W, I_mult, eagle))
    ncheck = 0
    stats = dict(hit=0, junction=0, sparse=0, dense=0, decode_reg=0, dead=0)
    for t in range(trials):
        pure, fa_mult, bs, W, I_mult, eagle = configs[t % len(configs)]
        A = bs * fa_mult  # scheduler block size = lcm(fa, swa)
        I = None if I_mult is None else I_mult * A
        groups = ([] if pure else [KVCacheGroupSpec(["fa"], FullAttentionSpec(block_size=A, num_kv_heads=1,
                                                                               head_size=1, dtype=torch.float32))])
        groups.append(KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                                                  dtype=torch.float32, sliding_window=W),
                                       is_eagle_group=eagle))
        SG = len(groups) - 1
        cfg = KVCacheConfig(num_blocks=4000, kv_cache_tensors=[], kv_cache_groups=groups,
                            prefix_cache_retention_interval=I)
        kvm = KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=A, hash_block_size=bs,
                             enable_caching=True, use_eagle=eagle)
        sm = kvm.coordinator.single_type_managers[SG]
        fa_keys, swa_keys = set(), set()   # emulator state: registered prefixes (as token tuples)
        prompts = []
        for r in range(8):
            if prompts and rng.random() < 0.8:
                base = rng.choice(prompts)
                L = rng.randint(0, len(base))
                toks = base[:L] + [rng.randint(1000, 10**6) for _ in range(rng.randint(0, 60))]
            else:
                toks = [rng.randint(1000, 10**6) for _ in range(rng.randint(1, 150))]
            if not toks:
                toks = [5]
            prompts.append(toks)
            P = len(toks)
            sp = SamplingParams(max_tokens=100); sp.update_from_generation_config({}, 0)
            req = Request(request_id=f"r{r}", prompt_token_ids=list(toks), sampling_params=sp, pooling_params=None,
                          block_hasher=get_request_block_hasher(bs, sha256))
            # --- emulator lookup
            key = lambda n: tuple(toks[:n])
            if pure:
                h_e = swa_lookup(lambda i: key((i + 1) * bs) in swa_keys, P - 1, bs, A, W, eagle)
                J_e = 0
            else:
                k = 0
                while (k + 1) * A <= P - 1 and key((k + 1) * A) in fa_keys:
                    k += 1
                h_fa = k * A
                mx = min(h_fa + bs, len(req.block_hashes) * bs) if eagle else h_fa
                h_swa = swa_lookup(lambda i: key((i + 1) * bs) in swa_keys, mx, bs, A, W, eagle)
                h_e = h_swa
                longest = max(h_fa, h_swa)
                J_e = longest if longest - h_e else 0
            # --- vLLM
            blocks, h, J = kvm.get_computed_blocks(req)
            assert (h, J) == (h_e, J_e), (configs[t % len(configs)], r, P, h, J, h_e, J_e)
            req.shared_prefix_boundary = J       # what the scheduler does (scheduler.py, waiting branch)
            # --- run: random chunks, then decode steps
            registered, dead = set(), set()
            orig = kvm.block_pool.cache_full_blocks
            def spy(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                    block_mask=None):
                before = [b.block_hash is None and not b.is_null for b in blocks[num_cached_blocks:num_full_blocks]]
                orig(request=request, blocks=blocks, num_cached_blocks=num_cached_blocks,
                     num_full_blocks=num_full_blocks, block_size=block_size, kv_cache_group_id=kv_cache_group_id,
                     block_mask=block_mask)
                if kv_cache_group_id == SG:
                    for j, b in enumerate(blocks[num_cached_blocks:num_full_blocks]):
                        if before[j] and b.block_hash is not None:
                            registered.add(num_cached_blocks + j)
                        if b.is_null:
                            dead.add(num_cached_blocks + j)
            kvm.block_pool.cache_full_blocks = spy
            first = True
            n_last = h
            while req.num_computed_tokens < req.num_tokens:
                todo = req.num_tokens - req.num_computed_tokens - (h if first else 0)
                c = min(todo, rng.choice((1, 3, bs, 2 * bs, 37, 500)))
                if first:
                    out = kvm.allocate_slots(req, c, h, blocks)
                    req.num_computed_tokens = h
                    first = False
                else:
                    out = kvm.allocate_slots(req, c)
                assert out is not None
                req.num_computed_tokens += c
                n_last = req.num_computed_tokens
                if req.num_computed_tokens == req.num_tokens and len(req.output_token_ids) < 4:
                    req.append_output_token_ids(rng.randint(1000, 10**6))
            kvm.block_pool.cache_full_blocks = orig
            # --- the rule
            def cacheable(n):
                if pure:
                    return n
                c = n // A * A
                return min(n, c + bs) if (eagle and c > 0) else c
            hi = cacheable(n_last) // bs
            lo = h // bs
            exp = {i for i in range(lo, hi) if R(i, P, J, I, W, bs, A, eagle, A)}
            # Blocks the window freed before the cacheable horizon reached them: only in a dense branch (mask None)
            # and never inside a reachable tail (the need blocks ending at an A-aligned boundary, + shift).
            need = cdiv(W - 1, bs) + eagle; shift = int(eagle)
            tail = lambda i: any(L // bs + shift - need <= i < L // bs + shift for L in range(A, (i + need + 2) * bs, A))
            dead &= exp
            if dead:
                seg = A if I is None else (I or None)
                dense = seg is not None and need >= seg // bs
                # or EAGLE's clamped replay boundary 0 (P < 2A): its 'proof' block 0 is cacheable only from n >= A
                assert A > bs and (dense or (eagle and dead == {0})), (configs[t % len(configs)], sorted(dead))
                assert not any(tail(i) for i in dead), (configs[t % len(configs)], sorted(dead))
                stats['dead'] += 1
            exp -= dead
            assert registered == exp, (configs[t % len(configs)], r, P, h, J, n_last, sorted(registered),
                                       sorted(exp))
            all_toks = req.all_token_ids
            for i in exp:
                swa_keys.add(tuple(all_toks[:(i + 1) * bs]))
            if not pure:
                for k in range(1, cacheable(n_last) // A + 1):
                    fa_keys.add(tuple(all_toks[:k * A]))
            kvm.free(req)
            ncheck += 1
            stats['hit'] += h > 0; stats['junction'] += J > 0
            stats['sparse'] += len(exp) < hi - lo; stats['dense'] += len(exp) == hi - lo > 0
            stats['decode_reg'] += any((i + 1) * bs > P for i in exp)
    print(f"part 2: {trials} trials ({len(configs)} configurations cycled) x 8 requests = {ncheck} requests: registered SWA indexes, hit and "
          f"junction == the rule; requests with a hit {stats['hit']}, with a junction {stats['junction']}, sparse "
          f"{stats['sparse']}, dense {stats['dense']}, registering a block past the prompt {stats['decode_reg']}, with a rule block freed by the window before it became cacheable (dense branch, or EAGLE's block 0) {stats['dead']}")


part1()
part2(int(sys.argv[1]) if len(sys.argv) > 1 else 400, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
