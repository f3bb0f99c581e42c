#!/usr/bin/env python3
"""Regenerate python/pagedkv/_pagedkv.pyi with nanobind's stubgen from a built extension.

Usage: python python/generate_stubs.py <dir holding the built pagedkv package> [output .pyi]
  e.g. python python/generate_stubs.py build-py/python
stubgen renders the exception classes (created with the C API, not nanobind) as a re-import from `pagedkv`, which
would make the stub circular; this script replaces that import with their class definitions. The test suite
(test_stubs.py) regenerates the stub and compares it with the committed one.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile

ERRORS = [  # (name, extra base, Errc member)
    ("InvalidArgumentError", "ValueError", "INVALID_ARGUMENT"),
    ("UnknownSequenceError", "LookupError", "UNKNOWN_SEQUENCE"),
    ("DuplicateSequenceError", "ValueError", "DUPLICATE_SEQUENCE"),
    ("DoubleFreeError", "RuntimeError", "DOUBLE_FREE"),
    ("LimitExceededError", "ValueError", "LIMIT_EXCEEDED"),
    ("BlockOutOfRangeError", "IndexError", "BLOCK_OUT_OF_RANGE"),
    ("BadShapeError", "ValueError", "BAD_SHAPE"),
]


def render(import_dir: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "_pagedkv.pyi"
        subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-i", import_dir, "-m", "pagedkv._pagedkv",
                        "-o", str(out)], check=True)
        text = out.read_text()
    text = re.sub(r"from pagedkv import \([^)]*\)\n", "", text)
    classes = ["", "class Error(Exception):",
               '    """Misuse of a pagedkv call (pagedkv::Error); the call changed nothing. str(e) is the C++ what()."""',
               "    code: Errc", "    message: str", ""]
    for name, base, member in ERRORS:
        classes += [f"class {name}(Error, {base}):", f"    code: Errc  # Errc.{member}", ""]
    marker = "\nclass Errc(enum.IntEnum):"
    assert marker in text, "stubgen output changed: no Errc class"
    i = text.index(marker)
    # Error and its subclasses refer to Errc: place them right after it.
    j = text.index("\nclass ", i + len(marker))
    return text[:j] + "\n".join(classes) + text[j:]


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else \
        pathlib.Path(__file__).resolve().parent / "pagedkv" / "_pagedkv.pyi"
    target.write_text(render(sys.argv[1]))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
