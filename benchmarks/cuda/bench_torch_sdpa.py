#!/usr/bin/env python3
"""benchmarks/cuda/bench_torch_sdpa.py: torch scaled_dot_product_attention on the shapes of bench_kernels' rows.

Run by scripts/gpu-check.sh right after bench_kernels, on the same GPU in the same call: reads bench.json (the
kernel rows and the device-to-device copy bandwidth measured in that run), times
torch.nn.functional.scaled_dot_product_attention (flash backend when it takes the shape, else whichever backend
torch picks, named per row) on dense bf16 tensors of the same shapes, and writes the rows back into bench.json under
"torch_sdpa" (every repetition, the median, GB/s, fraction of the copy bandwidth, TFLOP/s for prefill). Without torch
(or without CUDA in torch) it writes {"skipped": "<why>"} there instead and exits 0.

Shapes: decode q [b, hq, 1, 128] against contiguous K/V [b, hkv, len, 128] (enable_gqa), for the uniform bf16
decode rows whose K/V fit in 40% of free memory; prefill q [8, 32, 512, 128] against K/V [8, 8, 2560, 128] with no
mask (torch's is_causal aligns the mask to the top-left corner, which is not "new tokens after a cached prefix"),
so its TFLOP/s counts its own, larger, work: 4 * 128 * 32 * 512 * 2560 * 8 flops.

Usage: bench_torch_sdpa.py --bench-json PATH [--seed N] [--reps N]
The last line printed starts with "torch_sdpa:" and summarizes what happened.
"""
import argparse
import json
import re
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-json", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with open(args.bench_json) as f:
        bench = json.load(f)

    def done(obj, summary):
        bench["torch_sdpa"] = obj
        with open(args.bench_json, "w") as f:
            json.dump(bench, f, indent=1)
        print("torch_sdpa: " + summary)
        return 0

    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        return done({"skipped": f"torch not importable: {e}"}, f"skipped (torch not importable: {e})")
    if not torch.cuda.is_available():
        return done({"skipped": "torch has no CUDA device"}, "skipped (torch.cuda.is_available() is False)")

    torch.manual_seed(args.seed)
    copy_gbps = float(bench.get("copy_bandwidth_gbps") or 0)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001
        SDPBackend = sdpa_kernel = None

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        one = max(start.elapsed_time(stop), 1e-3)
        n = max(1, min(1000, int(2.0 / one + 0.999)))
        reps = []
        for _ in range(args.reps):
            start.record()
            for _ in range(n):
                fn()
            stop.record()
            stop.synchronize()
            reps.append(start.elapsed_time(stop) / n)
        return reps, n

    def run(q, k, v, gqa, causal=False):
        """(reps_ms, n, backend): flash first, then torch's own choice."""
        kw = {"enable_gqa": True} if gqa else {}
        tries = []
        if sdpa_kernel is not None:
            tries.append(("flash", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])))
        tries.append(("default", None))
        last_err = None
        for name, ctx in tries:
            try:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)  # noqa: E731
                if ctx is None:
                    reps, n = timed(fn)
                else:
                    with ctx():
                        reps, n = timed(fn)
                return reps, n, name
            except Exception as e:  # noqa: BLE001 - a backend refusing the shape: try the next
                last_err = e
        raise RuntimeError(f"no SDPA backend ran: {last_err}")

    rows = []
    free, _ = torch.cuda.mem_get_info()
    pat = re.compile(r"^decode b(\d+) kv(\d+) qo(\d+)/kv(\d+) d(\d+) bs16$")
    for r in bench.get("results", []):
        m = pat.match(r.get("name", ""))
        if not m:
            continue
        b, length, hq, hkv, hd = (int(x) for x in m.groups())
        kv_bytes = 2 * b * hkv * length * hd * 2
        row = {"name": "torch sdpa " + r["name"][len("decode "):], "kernel_row": r["name"]}
        if kv_bytes > 0.4 * free:
            row["skipped"] = f"needs {kv_bytes / 2**30:.1f} GiB of dense K/V, {free / 2**30:.1f} GiB free"
            rows.append(row)
            continue
        try:
            q = torch.rand(b, hq, 1, hd, device="cuda", dtype=torch.bfloat16) * 2 - 1
            k = torch.rand(b, hkv, length, hd, device="cuda", dtype=torch.bfloat16) * 2 - 1
            v = torch.rand(b, hkv, length, hd, device="cuda", dtype=torch.bfloat16) * 2 - 1
            reps, n, backend = run(q, k, v, hq != hkv)
            med = sorted(reps)[len(reps) // 2]
            nbytes = kv_bytes + 2 * q.numel() * 2
            gbps = nbytes / (med * 1e-3) / 1e9
            row.update({"backend": backend, "launches_per_event_pair": n, "median_us": med * 1e3,
                        "reps_us": [x * 1e3 for x in reps], "bytes": nbytes, "gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps if copy_gbps else None})
            if "gbps" in r and r.get("gbps"):
                row["pagedkv_over_torch"] = r["gbps"] / gbps
            del q, k, v
        except Exception as e:  # noqa: BLE001 - record, keep going
            row["error"] = str(e)[:300]
        rows.append(row)
        torch.cuda.empty_cache()

    # Prefill: batch 8, 2048 cached + 512 new, 32 / 8 heads, d128 (no mask: see the module doc).
    b, cached, new, hq, hkv, hd = 8, 2048, 512, 32, 8, 128
    row = {"name": "torch sdpa prefill b8 q512 kv2560 (no mask) qo32/kv8 d128",
           "kernel_row": "prefill b8 cached2048+new512 causal qo32/kv8 d128 bs16"}
    try:
        q = torch.rand(b, hq, new, hd, device="cuda", dtype=torch.bfloat16) * 2 - 1
        k = torch.rand(b, hkv, cached + new, hd, device="cuda", dtype=torch.bfloat16) * 2 - 1
        v = torch.rand(b, hkv, cached + new, hd, device="cuda", dtype=torch.bfloat16) * 2 - 1
        reps, n, backend = run(q, k, v, True)
        med = sorted(reps)[len(reps) // 2]
        flops = 4.0 * hd * hq * new * (cached + new) * b
        row.update({"backend": backend, "launches_per_event_pair": n, "median_us": med * 1e3,
                    "reps_us": [x * 1e3 for x in reps], "flops": flops, "tflops": flops / (med * 1e-3) / 1e12})
    except Exception as e:  # noqa: BLE001
        row["error"] = str(e)[:300]
    rows.append(row)

    ran = sum(1 for r in rows if "median_us" in r)
    return done({"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "seed": args.seed,
                 "reps": args.reps, "rows": rows},
                f"{ran} of {len(rows)} rows ran (torch {torch.__version__})")


if __name__ == "__main__":
    sys.exit(main())
