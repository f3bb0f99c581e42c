#!/usr/bin/env bash
# scripts/stage-gpu-deps.sh: run on a development machine (with Debian's catch2 installed) before sending the work
# tree to a GPU machine that has no Debian packages. Stages into .gpu-deps/ (which ignores itself through its own
# .gitignore, so nothing third-party is ever committed) everything scripts/gpu-check.sh needs from outside the
# repository: the Catch2 2.13 single header, .gpu-deps/catch2/catch.hpp (tests/cuda/CMakeLists.txt looks there when
# find_package(Catch2) fails). That is the whole list: the kernels, the CPU reference and the kernel benchmark need
# only the repository's headers and the CUDA toolkit (with its CCCL). Carry `.gpu-deps` with the work tree: it is
# git-ignored, so a copy of "tracked + untracked-not-ignored files" leaves it behind unless named.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src=${CATCH2_HEADER:-/usr/include/catch2/catch.hpp}
if [[ ! -f "$src" ]]; then
  echo "stage-gpu-deps: $src not found (apt-get install catch2, or set CATCH2_HEADER)" >&2
  exit 1
fi
if ! grep -q 'Catch v2\.' "$src"; then
  echo "stage-gpu-deps: $src is not a Catch2 2.x single header" >&2
  exit 1
fi
mkdir -p "$root/.gpu-deps/catch2"
printf '*\n' > "$root/.gpu-deps/.gitignore"
cp "$src" "$root/.gpu-deps/catch2/catch.hpp"
version=$(grep -m1 -o 'Catch v[0-9.]*' "$src" || echo Catch2)
printf 'catch2/catch.hpp: %s (from %s)\n' "$version" "$src" > "$root/.gpu-deps/MANIFEST"
echo "staged $version -> .gpu-deps/catch2/catch.hpp ($(du -sh "$root/.gpu-deps" | cut -f1)); carry: .gpu-deps"
