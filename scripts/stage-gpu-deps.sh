#!/usr/bin/env bash
# scripts/stage-gpu-deps.sh: run on a development machine (with Debian's catch2 installed) before sending the work
# tree to a GPU machine that has no Debian packages. Copies the Catch2 2.13 single header into .gpu-deps/ (which
# ignores itself through its own .gitignore, so nothing third-party is ever committed); tests/cuda/CMakeLists.txt
# looks there when find_package(Catch2) fails. Carry `.gpu-deps` with the work tree.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src=${CATCH2_HEADER:-/usr/include/catch2/catch.hpp}
if [[ ! -f "$src" ]]; then
  echo "stage-gpu-deps: $src not found (apt-get install catch2, or set CATCH2_HEADER)" >&2
  exit 1
fi
mkdir -p "$root/.gpu-deps/catch2"
printf '*\n' > "$root/.gpu-deps/.gitignore"
cp "$src" "$root/.gpu-deps/catch2/catch.hpp"
echo "staged $(grep -m1 -o 'Catch v[0-9.]*' "$src" || echo Catch2) -> .gpu-deps/catch2/catch.hpp"
