#!/usr/bin/env bash
# scripts/stage-gpu-deps.sh: run on a development machine (with Debian's catch2 installed) before sending the work
# tree to a GPU machine that has no Debian packages. Stages into .gpu-deps/ (which ignores itself through its own
# .gitignore, so nothing third-party is ever committed) everything scripts/gpu-check.sh needs from outside the
# repository:
#  - .gpu-deps/catch2/catch.hpp: the Catch2 2.13 single header (tests/cuda/CMakeLists.txt looks there when
#    find_package(Catch2) fails);
#  - .gpu-deps/REVISION: the source revision of the work tree being sent (`git rev-parse HEAD`, the number of
#    changed or untracked paths from `git status --porcelain`, and the time of staging), because `.git` does not
#    travel; gpu-check.sh copies it into summary.json. Re-run this script right before every GPU call.
# That is the whole list: the kernels, the CPU reference and the kernel benchmark need only the repository's headers
# and the CUDA toolkit (with its CCCL). Carry `.gpu-deps` with the work tree: it is git-ignored, so a copy of
# "tracked + untracked-not-ignored files" leaves it behind unless named.
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
rev=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
branch=$(git -C "$root" rev-parse --abbrev-ref HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain 2>/dev/null | grep -vc '^?? \.gpu-deps' || true)
printf 'commit=%s\nbranch=%s\nchanged_paths=%s\nstaged_at=%s\n' "$rev" "$branch" "$dirty" "$(date -u +%FT%TZ)" \
  > "$root/.gpu-deps/REVISION"
echo "staged $version -> .gpu-deps/catch2/catch.hpp, revision $rev ($dirty changed paths) -> .gpu-deps/REVISION" \
     "($(du -sh "$root/.gpu-deps" | cut -f1)); carry: .gpu-deps"
