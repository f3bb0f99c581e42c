"""vLLM's real engine on pagedkv.vllm, end to end (scripts/vllm-e2e.sh; issue 35 item 3).

  python e2e.py make MODEL_DIR [WINDOW|gdn]    a tiny random-weight Llama and a word-level tokenizer, made locally
                                               (WINDOW: its first layer a sliding window of WINDOW tokens; gdn: a
                                               Qwen3-Next, a gated-delta-net layer then a full-attention one)
  python e2e.py run MODEL_DIR MANAGER OUT.json [NUM_BLOCKS [RETENTION]]   (RETENTION: none or tokens)
                                               vLLM's LLM on CPU (prefix caching, greedy, a small pool) with
                                               MANAGER = vllm (vLLM's own KVCacheManager), pagedkv
                                               (scheduler_cls="pagedkv.vllm.Scheduler") or planted (pagedkv with a
                                               wrong block table planted: the check must catch it); writes each
                                               request's output token ids and num_cached_tokens, the engine's
                                               prefix-cache counters and its preemption count
  python e2e.py compare BASE.json RUN.json [--expect-mismatch] [--label=TEXT]

The workload: three phases of requests whose prompts share prefixes (a system prompt, per-conversation histories,
resends of earlier prompts with their outputs), greedy sampling, 16 new tokens each, on a pool small enough that
cached blocks are evicted and running requests are preempted. Nothing is downloaded.
"""

import json
import os
import sys

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
NUM_BLOCKS = 48
VOCAB = 512


def make(model_dir: str, window: int = 0) -> None:
    """The model: a Llama, or with `window` > 0 a hybrid of a sliding-window layer (that many tokens) and a
    full-attention one, as gpt-oss and Gemma 2/3 alternate them (vLLM's Llama reads config.layer_types); with
    `window` = "gdn" the recurrent hybrid of make_gdn."""
    if window == "gdn":
        make_gdn(model_dir)
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(model_dir, exist_ok=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,  # head_dim 64: CPU attention has kernels for it
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    if window:
        cfg.layer_types = ["sliding_attention", "full_attention"]
        cfg.sliding_window = window
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: logits far apart, so greedy ties cannot flip
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(model_dir, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(model_dir)


def make_gdn(model_dir: str) -> None:
    """A tiny random-weight Qwen3-Next (Qwen3NextForCausalLM: a gated-delta-net layer, then a full-attention one;
    mixture-of-experts MLPs) in bfloat16, which vLLM's CPU gated-delta-net kernel needs (its value and key heads of
    128). vLLM runs it with a Mamba KV-cache group in mode 'align' (prefix caching on) and, its state page padded to
    the attention page, 32-token blocks: the attention page per token (4 KV heads x 256 x 2 x bf16) is sized so."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    make(model_dir)  # the tokenizer (the Llama's weights and config are replaced below)
    for f in os.listdir(model_dir):
        if f.startswith("model") or f == "config.json":
            os.remove(os.path.join(model_dir, f))
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, head_dim=256,
                          layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
                          linear_num_value_heads=1, linear_key_head_dim=128, linear_value_head_dim=128,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=128, mlp_only_layers=[], decoder_sparse_step=1,
                          max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)


def _dtype(model_dir: str) -> str:
    """The model's dtype as its config names it (float32 for the Llamas, bfloat16 for the gated-delta-net hybrid)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


def _prompts():
    """Three phases of token-id prompts sharing prefixes (deterministic)."""
    import random

    rng = random.Random(35)
    word = lambda: rng.randrange(3, VOCAB)  # noqa: E731
    system = [word() for _ in range(72)]
    phase1 = []
    for c in range(24):  # conversations: the system prompt, a history, a question
        history = [word() for _ in range(rng.randrange(8, 80))]
        phase1.append(system + history + [word() for _ in range(rng.randrange(1, 12))])
    phase2 = [list(p) + [word() for _ in range(rng.randrange(1, 20))] for p in phase1]  # follow-ups
    phase3 = [list(p) for p in rng.sample(phase1, 12)] + [system + [word() for _ in range(40)] for _ in range(12)]
    return [phase1, phase2, phase3]


def run(model_dir: str, manager: str, out_path: str, num_blocks: int = NUM_BLOCKS, retention: str = "") -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if manager == "pagedkv":
        kw["scheduler_cls"] = "pagedkv.vllm.Scheduler"
    elif manager == "planted":
        kw["scheduler_cls"] = "e2e_planted.PlantedScheduler"
    if retention:  # vLLM's prefix_cache_retention_interval ("none" or tokens); default: vLLM's (0)
        kw["prefix_cache_retention_interval"] = None if retention == "none" else int(retention)
    if os.environ.get("PAGEDKV_E2E_EVENTS") == "1":  # KV events on (published nowhere), as a KV-aware router's pods
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    llm = LLM(model=model_dir, tokenizer=model_dir, dtype=_dtype(model_dir), block_size=BLOCK, enforce_eager=True,
              enable_prefix_caching=True, num_gpu_blocks_override=num_blocks, max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=512, seed=0, disable_log_stats=False, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = []
    for phase, prompts in enumerate(_prompts()):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        for p, o in zip(prompts, outs):
            requests.append({"phase": phase, "prompt_len": len(p), "tokens": list(o.outputs[0].token_ids),
                             "num_cached_tokens": o.num_cached_tokens})
    counters = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
            counters[m.name] = getattr(m, "value", None)
    with open(out_path, "w") as f:
        json.dump({"manager": manager, "requests": requests, "counters": counters}, f)


def compare(base_path: str, run_path: str, expect_mismatch: bool, label: str = "") -> int:
    base, run_ = (json.load(open(p)) for p in (base_path, run_path))
    a, b = base["requests"], run_["requests"]
    identical = sum(1 for x, y in zip(a, b) if x == y) if len(a) == len(b) else 0
    # The prefix-cache counters must be equal; preemptions are reported (not compared: which request is preempted
    # when depends on block ids, and the planted run shows the count moving with them).
    keys = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    counters_equal = all(base["counters"].get(k) == run_["counters"].get(k) for k in keys)
    ok = len(a) == len(b) and identical == len(a) and counters_equal
    cached = sum(r["num_cached_tokens"] or 0 for r in b)
    pre = f"{run_['counters'].get('vllm:num_preemptions')} (vLLM {base['counters'].get('vllm:num_preemptions')})"
    summary = (f"requests={len(a)} identical={identical} cached_tokens={cached} "
               f"prefix_cache_queries={run_['counters'].get('vllm:prefix_cache_queries')} "
               f"prefix_cache_hits={run_['counters'].get('vllm:prefix_cache_hits')} preemptions={pre} "
               f"counters_equal={counters_equal}")
    if expect_mismatch:
        print(f"vllm-e2e: planted wrong block table {'CAUGHT' if not ok else 'MISSED'}: {summary}")
        return 0 if not ok else 1
    if not ok:
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                print(f"vllm-e2e: request {i} differs: vLLM {x} pagedkv {y}")
                break
        print(f"vllm-e2e: vLLM counters {base['counters']} pagedkv {run_['counters']}")
    print(f"vllm-e2e: {label}{'PASS' if ok else 'FAIL'} {summary}")
    return 0 if ok else 1


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        kind = sys.argv[3] if len(sys.argv) > 3 else "0"
        make(sys.argv[2], kind if kind == "gdn" else int(kind))
    elif cmd == "run":
        run(sys.argv[2], sys.argv[3], sys.argv[4], *(int(a) for a in sys.argv[5:6]), *sys.argv[6:7])
    elif cmd == "compare":
        label = next((a.split("=", 1)[1] + ": " for a in sys.argv if a.startswith("--label=")), "")
        sys.exit(compare(sys.argv[2], sys.argv[3], "--expect-mismatch" in sys.argv, label))
    else:
        sys.exit(__doc__)
