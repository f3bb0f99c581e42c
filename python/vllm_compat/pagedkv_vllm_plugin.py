"""pytest plugin: run vLLM's own tests with vLLM's KVCacheManager replaced by pagedkv.vllm.KVCacheManager.

Load with ``-p pagedkv_vllm_plugin`` (this folder on PYTHONPATH, pagedkv importable); scripts/vllm-tests.sh does.
Environment:
  PAGEDKV_VLLM_SWAP=0        run vLLM's own manager instead (the baseline: which tests pass in this environment);
  PAGEDKV_VLLM_RESULTS=path  write one JSON line per test: nodeid, outcome, whether an adapter was constructed, the
                             exception (type, message's first line), and the vLLM-internal objects the test read
                             that the adapter does not provide (pagedkv.vllm.NotProvided) or the configuration it
                             refused (pagedkv.vllm.Unsupported).

The swap happens when the plugin is loaded, before collection, so vLLM's test modules (unmodified) bind the adapter
when they import ``KVCacheManager`` from vllm.v1.core.kv_cache_manager, and so does vLLM's Scheduler.
"""

import json
import os

import pytest

_SWAP = os.environ.get("PAGEDKV_VLLM_SWAP", "1") != "0"
_OUT = os.environ.get("PAGEDKV_VLLM_RESULTS")

if _SWAP:
    import pagedkv.vllm as _adapter

    _adapter.install()
    _orig_np_init = _adapter.NotProvided.__init__
    _accessed: list[str] = []

    def _np_init(self, object_name):  # record every internal read, also those a getattr default swallows
        _accessed.append(object_name)
        _orig_np_init(self, object_name)

    _adapter.NotProvided.__init__ = _np_init
else:
    _adapter = None
    _accessed = []

_records: dict[str, dict] = {}


def _chain(exc):
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _first_line(exc) -> str:
    s = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    return " / ".join(s[:2])[:300]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _accessed.clear()
    before = _adapter.constructions() if _adapter else 0
    _records[item.nodeid] = rec = {"nodeid": item.nodeid, "outcome": "passed", "exc_type": None, "message": None,
                                   "not_provided": None, "unsupported": None}
    yield
    rec["adapter_used"] = (_adapter.constructions() - before) > 0 if _adapter else None
    rec["internal_reads"] = sorted(set(_accessed))
    if _OUT:
        with open(_OUT, "a") as f:
            f.write(json.dumps(rec) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    rec = _records.get(item.nodeid)
    if rec is None or rec["outcome"] != "passed":
        return
    if report.skipped:
        rec["outcome"] = "skipped"
        rec["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return
    if not report.failed:
        return
    rec["outcome"] = "failed" if call.when == "call" else "error"
    exc = call.excinfo.value if call.excinfo is not None else None
    if exc is None:
        return
    rec["exc_type"] = type(exc).__name__
    rec["message"] = _first_line(exc)
    if _adapter is not None:
        for e in _chain(exc):
            if isinstance(e, _adapter.NotProvided):
                rec["not_provided"] = e.object_name
                break
            if isinstance(e, _adapter.Unsupported):
                rec["unsupported"] = e.reason
                break
