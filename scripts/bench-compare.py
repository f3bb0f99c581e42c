#!/usr/bin/env python3
"""scripts/bench-compare.py: two bench_kernels JSON files (same device, same run), row by row.

    scripts/bench-compare.py BASE.json NEW.json [--names-like SUBSTRING]

Prints, for every row name present in both, the median time of each (us), new / base time, and each one's
fraction of the copy bandwidth measured in its own run. Rows only in one file are listed after the table.
Used by the GPU issue's A/B calls (the previous build's bench_kernels against this one, in one device call).
"""
import json
import sys


def rows(path):
    with open(path) as f:
        d = json.load(f)
    return d, {r["name"]: r for r in d["results"]}


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    like = argv[argv.index("--names-like") + 1] if "--names-like" in argv else ""
    bd, base = rows(argv[1])
    nd, new = rows(argv[2])
    print(f"copy bandwidth: base {bd['copy_bandwidth_gbps']:.1f} GB/s, new {nd['copy_bandwidth_gbps']:.1f} GB/s "
          f"({bd.get('device', '?')})")
    print(f"{'kernel':<60} {'base us':>10} {'new us':>10} {'new/base':>9} {'base %cp':>9} {'new %cp':>8}")
    for name, n in new.items():
        b = base.get(name)
        if b is None or like not in name or "median_us" not in n or "median_us" not in b:
            continue
        print(f"{name[:60]:<60} {b['median_us']:>10.1f} {n['median_us']:>10.1f} {n['median_us'] / b['median_us']:>9.3f} "
              f"{100 * b['fraction_of_copy']:>8.1f}% {100 * n['fraction_of_copy']:>7.1f}%")
    only = sorted(set(base) ^ set(new))
    if only:
        print("rows in one file only: " + "; ".join(only))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
