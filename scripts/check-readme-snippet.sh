#!/usr/bin/env bash
# The README's "Using it" C++ snippet is the code between the SNIPPET markers of tests/package/main.cpp (built and
# run against the installed package by scripts/test.sh), so the snippet compiles and runs in the order written.
# Exits 1 with a diff when they differ.
set -euo pipefail
cd "$(dirname "$0")/.."
extract_test() { sed -n '/SNIPPET-BEGIN/,/SNIPPET-END/p' tests/package/main.cpp | sed '1d;$d' | sed 's/^  //'; }
extract_readme() { awk '/<!-- snippet: tests\/package\/main.cpp -->/{f=1; next} f && /^```cpp/{g=1; next} g && /^```/{exit} g' README.md; }
if ! diff <(extract_test) <(extract_readme); then
  echo "check-readme-snippet: README.md's snippet differs from tests/package/main.cpp (diff above: < test, > README)" >&2
  exit 1
fi
echo "check-readme-snippet: README snippet = tests/package/main.cpp ($(extract_test | wc -l) lines)"
