#!/usr/bin/env python3
"""scripts/bench-compare.py: two bench_kernels JSON files (same device, same run), row by row.

    scripts/bench-compare.py BASE.json NEW.json [--names-like SUBSTRING]

Prints, for every row name present in both, the median time of each (us), new / base time, and each one's
fraction of the copy bandwidth measured in its own run. Rows only in one file are listed after the table.
Used by the GPU issue's A/B calls (the previous build's bench_kernels against this one, in one device call).

Rows are keyed by name, so every name in a file must be unique. bench_kernels before issue 36 named the graph row
of the contract shape like its stream row ("decode b64 kv4096 qo32/kv8 d128 bs16", mode "graph"); such a row
(mode "graph", name not ending in " graph") is read as "<name> graph", the name bench_kernels gives it now. Any
other repeated name is an error (exit 2, naming the file, the name and the row indexes): a dictionary keyed by
name would keep the last row and hide the first (it hid the stream row's 403.9 us behind the graph row's 395.1).
"""
import json
import sys


class DuplicateRowError(Exception):
    pass


def row_key(r):
    name = r["name"]
    if r.get("mode") == "graph" and not name.endswith(" graph"):
        return name + " graph"
    return name


def rows(path):
    with open(path) as f:
        d = json.load(f)
    keyed = {}
    first_index = {}
    for i, r in enumerate(d["results"]):
        k = row_key(r)
        if k in keyed:
            raise DuplicateRowError(f"{path}: rows {first_index[k]} and {i} are both named \"{k}\"; row names must be "
                                    "unique (bench_kernels names each row once; refusing to keep one and drop the other)")
        keyed[k] = r
        first_index[k] = i
    return d, keyed


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    like = argv[argv.index("--names-like") + 1] if "--names-like" in argv else ""
    try:
        bd, base = rows(argv[1])
        nd, new = rows(argv[2])
    except DuplicateRowError as e:
        print(f"bench-compare: {e}", file=sys.stderr)
        return 2
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
