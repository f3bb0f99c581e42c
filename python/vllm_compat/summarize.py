"""Classify each vLLM test of a run with pagedkv's adapter, against a baseline run with vLLM's own manager.

    python summarize.py BASELINE.jsonl PAGEDKV.jsonl [--tsv OUT.tsv] [--markdown OUT.md] [--expected EXPECTED.tsv]

Both inputs are pagedkv_vllm_plugin.py records (PAGEDKV_VLLM_RESULTS). Each test gets one status:
  pass          passed, and constructed the adapter (so it ran on pagedkv);
  fail          failed with the adapter, passed with vLLM's manager (a bug here, or a semantic difference that
                docs/python.md lists);
  n/a-internal  failed reading a vLLM-internal object the adapter does not have (named in the reason);
  n/a-config    refused by the adapter: a configuration pagedkv cannot serve (the reason says which);
  n/a-no-manager passed without constructing any KVCacheManager: it tests vLLM's own BlockPool, single-type
                managers or helpers directly, so it says nothing about pagedkv;
  baseline-fail fails with vLLM's own manager too in this environment (reason: its error), so it is not counted;
  skipped       skipped by vLLM's own markers.
With --expected: exit status 1 when a test expected `pass` is anything else now, or an expected test is missing
(a regression); new passes are listed (update the expected file with --tsv output).
"""

import argparse
import collections
import json
import re
import sys


def load(path):
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out[r["nodeid"]] = r
    return out


def short(nodeid: str) -> str:
    """tests/v1/core/X -> X (the scheduler and prefix-cache tests); tests/v1/kv_connector/X -> kv_connector/X."""
    return nodeid.split("tests/v1/core/", 1)[-1].split("tests/v1/", 1)[-1]


def classify(base, run):
    if base is None or base["outcome"] not in ("passed", "skipped"):
        msg = (base or {}).get("message") or "not run"
        if "Invalid repository ID" in msg:
            m = re.search(r"specified: '([^']+)'", msg)
            msg = f"needs the model config of {m.group(1) if m else '?'} from the Hugging Face hub (offline here)"
        return "baseline-fail", f"fails with vLLM's own KVCacheManager too: {msg}"
    if run["outcome"] == "skipped":
        return "skipped", run.get("message") or ""
    if run["outcome"] == "passed":
        if run.get("adapter_used"):
            return "pass", ""
        return "n/a-no-manager", "constructs no KVCacheManager (tests vLLM's own block pool / managers / helpers)"
    if run.get("not_provided"):
        return "n/a-internal", f"reads vLLM-internal {run['not_provided']}"
    if run.get("unsupported"):
        return "n/a-config", run["unsupported"]
    reads = run.get("internal_reads") or []
    extra = f" (after reading vLLM-internal {', '.join(reads)})" if reads else ""
    return "fail", f"{run.get('exc_type')}: {run.get('message')}{extra}"


def reason_key(status, reason):
    """The reason with request-specific numbers folded, for the summary."""
    r = re.sub(r"group \d+ is", "a group is", reason)
    r = re.sub(r"\(dcp \d+, pcp \d+\)", "(dcp > 1)", r)
    r = re.sub(r"sizes \[[0-9, ]+\]", "sizes", r)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline")
    ap.add_argument("run")
    ap.add_argument("--tsv")
    ap.add_argument("--markdown")
    ap.add_argument("--expected")
    a = ap.parse_args()
    base, run = load(a.baseline), load(a.run)
    rows = []
    for nodeid, r in run.items():
        st, reason = classify(base.get(nodeid), r)
        rows.append((short(nodeid), st, reason.replace("\t", " ").replace("\n", " ")))
    missing_in_run = sorted(set(base) - set(run))
    for n in missing_in_run:
        rows.append((short(n), "fail", "not run with the adapter (collection error?)"))
    rows.sort()
    if a.tsv:
        with open(a.tsv, "w") as f:
            f.write("test\tstatus\treason\n")
            for row in rows:
                f.write("\t".join(row) + "\n")

    order = ["pass", "fail", "n/a-internal", "n/a-config", "n/a-no-manager", "baseline-fail", "skipped"]
    per_file = collections.defaultdict(collections.Counter)
    reasons = collections.Counter()
    for t, st, reason in rows:
        per_file[t.split("::")[0]][st] += 1
        if st != "pass":
            reasons[(st, reason_key(st, reason) if st != "fail" else f"{t}: {reason}")] += 1
    total = collections.Counter(st for _, st, _ in rows)
    lines = ["| file | " + " | ".join(order) + " | total |", "|---" * (len(order) + 2) + "|"]
    for f in sorted(per_file):
        c = per_file[f]
        lines.append(f"| {f} | " + " | ".join(str(c[o]) for o in order) + f" | {sum(c.values())} |")
    lines.append("| **all** | " + " | ".join(f"**{total[o]}**" for o in order) + f" | **{len(rows)}** |")
    lines += ["", "| status | tests | reason |", "|---|---|---|"]
    for (st, reason), n in sorted(reasons.items(), key=lambda kv: (order.index(kv[0][0]), -kv[1], kv[0][1])):
        lines.append(f"| {st} | {n} | {reason.replace('|', '/')} |")
    md = "\n".join(lines) + "\n"
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    print(md)
    print("vllm-tests: " + ", ".join(f"{total[o]} {o}" for o in order if total[o]))

    rc = 0
    if a.expected:
        exp = {}
        with open(a.expected) as f:
            next(f)
            for line in f:
                t, st, _ = line.rstrip("\n").split("\t", 2)
                exp[t] = st
        now = {t: st for t, st, _ in rows}
        regress = [t for t, st in exp.items() if st == "pass" and now.get(t) != "pass"]
        gone = [t for t in exp if t not in now]
        new_pass = [t for t, st in now.items() if st == "pass" and exp.get(t) != "pass"]
        for t in regress:
            print(f"REGRESSION: {t} passed before, now {now.get(t, 'missing')}")
        for t in gone:
            if t not in regress:
                print(f"MISSING: {t} is in the expected results but did not run")
        for t in new_pass:
            print(f"new pass: {t} (update {a.expected})")
        rc = 1 if regress or gone else 0
        print(f"vllm-tests: {len(exp) - len(regress) - len(gone)} of {len(exp)} expected results held; "
              f"{len(regress)} regressions, {len(new_pass)} new passes")
    return rc


if __name__ == "__main__":
    sys.exit(main())
