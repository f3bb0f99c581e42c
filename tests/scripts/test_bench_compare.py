#!/usr/bin/env python3
"""tests/scripts/test_bench_compare.py: scripts/bench-compare.py refuses a file with a repeated row name.

Crafted bench_kernels JSON files: (1) two stream rows with one name -> exit 2 and an error naming the row and both
indexes, nothing printed as a comparison; (2) the pre-issue-36 naming (the graph row named like its stream row,
mode "graph") -> both rows compared, the graph one as "<name> graph"; (3) unique names -> exit 0, every row.
Run by CTest (`bench_compare.duplicate_names`); exits non-zero on the first failed expectation.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench-compare.py")
NAME = "decode b64 kv4096 qo32/kv8 d128 bs16"


def row(name, us, mode="stream"):
    return {"name": name, "mode": mode, "median_us": us, "fraction_of_copy": 0.8}


def write(d, rows):
    path = os.path.join(d, f"f{len(os.listdir(d))}.json")
    with open(path, "w") as f:
        json.dump({"device": "crafted", "copy_bandwidth_gbps": 3000.0, "results": rows}, f)
    return path


def run(*args):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def expect(cond, what, out):
    if not cond:
        print(f"FAILED: {what}\n--- output ---\n{out}")
        sys.exit(1)


def main():
    with tempfile.TemporaryDirectory() as d:
        good = write(d, [row(NAME, 400.0), row(NAME + " graph", 390.0, "graph")])
        dup = write(d, [row(NAME, 403.9), row("decode b1 kv4096 qo32/kv8 d128 bs16", 30.0), row(NAME, 395.1)])
        rc, out, err = run(good, dup)
        expect(rc == 2, f"a repeated name must exit 2 (got {rc})", out + err)
        expect(f'rows 0 and 2 are both named "{NAME}"' in err and dup in err,
               "the error names the file, the repeated name and both row indexes", err)
        expect("new/base" not in out, "nothing is compared when a file is refused", out)
        rc, out, err = run(dup, good)
        expect(rc == 2, "a repeated name in BASE is refused too", out + err)

        legacy = write(d, [row(NAME, 403.9), row(NAME, 395.1, "graph")])
        rc, out, err = run(good, legacy)
        expect(rc == 0, f"the old graph-row naming is read, not refused (got {rc}: {err})", out + err)
        expect("403.9" in out and "395.1" in out, "both the stream and the graph row are compared", out)

        rc, out, err = run(good, good)
        expect(rc == 0 and out.count(NAME) == 2, "unique names: every row compared", out + err)
    print("bench-compare duplicate-name refusal: ok")


if __name__ == "__main__":
    main()
