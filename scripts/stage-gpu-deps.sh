#!/usr/bin/env bash
# scripts/stage-gpu-deps.sh: run on a development machine (with Debian's catch2 installed) before sending the work
# tree to a GPU machine that has no Debian packages. Stages into .gpu-deps/ (which ignores itself through its own
# .gitignore, so nothing third-party is ever committed) everything scripts/gpu-check.sh needs from outside the
# repository:
#  - .gpu-deps/catch2/catch.hpp: the Catch2 2.13 single header (tests/cuda/CMakeLists.txt looks there when
#    find_package(Catch2) fails);
#  - .gpu-deps/prefix/: OpenSSL headers + static libcrypto, xxhash.h, CLI11, nlohmann_json, for gpu-check.sh's
#    consumers stage (the top-level project: examples/decode_loop --device cuda, the installed CUDA consumer);
#  - .gpu-deps/REVISION: the source revision of the work tree being sent (`git rev-parse HEAD`, the number of
#    changed or untracked paths from `git status --porcelain`, and the time of staging), because `.git` does not
#    travel; gpu-check.sh copies it into summary.json. Re-run this script right before every GPU call.
# That is the whole list: the kernels, the CPU reference and the kernel benchmark need only the repository's headers
# and the CUDA toolkit (with its CCCL); the prefix is for the consumers stage only. Carry `.gpu-deps` with the work tree: it is git-ignored, so a copy of
# "tracked + untracked-not-ignored files" leaves it behind unless named.
#
# --bundle (opt-in) also builds here the prebuilt fallback gpu-check.sh runs when the GPU machine's toolchain fails
# (or with GPU_CHECK_USE_BUNDLE=1): .gpu-deps/bundle/ with pagedkv_cuda_tests, bench_kernels and the device probe for
# sm_90 (H100, H200; with compute_90 PTX), linked with the static CUDA runtime and static libstdc++
# (-DPAGEDKV_CUDA_RUNTIME=Static) and stripped, needing glibc >= 2.34 only: the static libstdc++ of a glibc 2.36
# toolchain calls arc4random (GLIBC_2.36) in std::random_device, so the link gets a getrandom-based arc4random
# (glibc_compat.c, written below), and libgcc_s stays shared (the static unwinder calls GLIBC_2.35's
# _dl_find_object; glibc itself needs libgcc_s.so.1, so every glibc system has it); gpu_tests.tsv / host_tests.tsv (every CTest test of label gpu /
# cuda_host: name and arguments, read from the build's CTest files, never hand-copied); BUNDLE (the
# revision as in .gpu-deps/REVISION, the source hash gpu-check.sh compares, the highest GLIBC_ symbol version the
# binaries need, CUDA runtime, compiler, sizes, sha256). Build dir: build-bundle/ (PAGEDKV_BUNDLE_BUILD_DIR), -j JOBS
# (2) under nice. Fails when a binary still needs libcudart.so / libstdc++.so, a glibc newer than
# PAGEDKV_BUNDLE_GLIBC_MAX (2.34), or .gpu-deps would
# exceed 32 MiB (the device tool carries at most 64 MiB of ignored paths). Without --bundle an existing bundle is
# left as it is (gpu-check.sh refuses it once the sources differ; this script says so).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
want_bundle=0
for a in "$@"; do
  case $a in
    --bundle) want_bundle=1 ;;
    *) echo "usage: scripts/stage-gpu-deps.sh [--bundle]" >&2; exit 2 ;;
  esac
done
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
# The consumers stage of gpu-check.sh (examples/decode_loop --device cuda, and tests/package/cuda against an
# installed pagedkv) configures the top-level project, which needs the host library's dependencies: a prefix with
# OpenSSL's headers and static libcrypto, xxhash.h, CLI11 and nlohmann_json (headers and CMake configs, which find
# their prefix relative to themselves). From Debian's libssl-dev, libxxhash-dev, libcli11-dev, nlohmann-json3-dev.
prefix="$root/.gpu-deps/prefix"
rm -rf "$prefix"
mkdir -p "$prefix/include/openssl" "$prefix/lib" "$prefix/share/cmake"
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
for need in /usr/include/openssl/evp.h "/usr/include/$multiarch/openssl/configuration.h" \
            "/usr/lib/$multiarch/libcrypto.a" /usr/include/xxhash.h /usr/include/CLI/CLI.hpp \
            /usr/share/cmake/CLI11/CLI11Config.cmake /usr/include/nlohmann/json.hpp \
            /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake; do
  [[ -f "$need" ]] || { echo "stage-gpu-deps: $need not found (apt-get install libssl-dev libxxhash-dev" \
                             "libcli11-dev nlohmann-json3-dev)" >&2; exit 1; }
done
cp /usr/include/openssl/*.h "$prefix/include/openssl/"
cp "/usr/include/$multiarch/openssl/"*.h "$prefix/include/openssl/"
cp "/usr/lib/$multiarch/libcrypto.a" "$prefix/lib/"
cp /usr/include/xxhash.h "$prefix/include/"
cp -r /usr/include/CLI /usr/include/nlohmann "$prefix/include/"
cp -r /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json "$prefix/share/cmake/"
printf 'prefix/: OpenSSL %s headers + libcrypto.a, xxhash.h, CLI11, nlohmann_json (the consumers stage)\n' \
  "$(dpkg-query -W -f='${Version}' libssl-dev 2>/dev/null || echo '?')" >> "$root/.gpu-deps/MANIFEST"
rev=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
branch=$(git -C "$root" rev-parse --abbrev-ref HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain 2>/dev/null | grep -vc '^?? \.gpu-deps' || true)
printf 'commit=%s\nbranch=%s\nchanged_paths=%s\nstaged_at=%s\n' "$rev" "$branch" "$dirty" "$(date -u +%FT%TZ)" \
  > "$root/.gpu-deps/REVISION"
echo "staged $version -> .gpu-deps/catch2/catch.hpp, revision $rev ($dirty changed paths) -> .gpu-deps/REVISION" \
     "($(du -sh "$root/.gpu-deps" | cut -f1)); carry: .gpu-deps"

bundle="$root/.gpu-deps/bundle"
if (( ! want_bundle )); then
  if [[ -f "$bundle/BUNDLE" ]]; then
    if [[ "$(grep -m1 '^source_hash=' "$bundle/BUNDLE" | cut -d= -f2)" == "$("$root/scripts/gpu-check.sh" --source-hash)" \
          && "$(grep -m1 '^commit=' "$bundle/BUNDLE" | cut -d= -f2)" == "$rev" ]]; then
      echo "note: .gpu-deps/bundle matches this tree (commit and sources)"
    else
      echo "note: .gpu-deps/bundle is for other sources or another commit: gpu-check.sh will not run it;" \
           "rebuild it with --bundle, or delete it (rm -rf .gpu-deps/bundle) to carry less"
    fi
  fi
  exit 0
fi

# ---- --bundle: the prebuilt, self-contained GPU binaries --------------------------------------------------------
say() { echo "stage-gpu-deps --bundle: $*"; }
die() { echo "stage-gpu-deps --bundle: $*" >&2; exit 1; }
export PATH="$PATH:/usr/local/cuda/bin"
for tool in cmake ctest nvcc python3 strip objdump ldd sha256sum cc; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found"
done
arch=90
bdir=${PAGEDKV_BUNDLE_BUILD_DIR:-$root/build-bundle}
jobs=${JOBS:-2}
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
glibc_max=${PAGEDKV_BUNDLE_GLIBC_MAX:-2.34}
hash_before=$("$root/scripts/gpu-check.sh" --source-hash)
t0=$(date +%s)
mkdir -p "$bdir"
cat > "$bdir/glibc_compat.c" <<'EOF'
/* Written by scripts/stage-gpu-deps.sh --bundle. arc4random (glibc >= 2.36) for the static libstdc++'s
   std::random_device, so that the bundle runs on glibc >= 2.34: 4 bytes from getrandom(2) (glibc >= 2.25), retried
   on EINTR and short reads; aborts when the kernel gives no randomness (glibc's arc4random also never fails). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/random.h>
uint32_t arc4random(void) {
  uint32_t v = 0;
  size_t got = 0;
  while (got < sizeof v) {
    const ssize_t n = getrandom((char*)&v + got, sizeof v - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      abort();
    }
    got += (size_t)n;
  }
  return v;
}
EOF
cc -O2 -fPIC -Wall -Wextra -c "$bdir/glibc_compat.c" -o "$bdir/glibc_compat.o" || die "glibc_compat.c did not compile"
say "configuring $bdir (sm_$arch, PAGEDKV_CUDA_RUNTIME=Static)"
cmake -S "$root/cuda" -B "$bdir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=$arch \
  -DPAGEDKV_CUDA_RUNTIME=Static -DCMAKE_EXE_LINKER_FLAGS="$bdir/glibc_compat.o" -DPAGEDKV_BUILD_TESTS=ON -DPAGEDKV_BUILD_BENCHMARKS=ON -DPAGEDKV_CUDA_PTXAS_VERBOSE=ON \
  > "$bdir/stage-configure.log" 2>&1 || { tail -n 20 "$bdir/stage-configure.log" >&2; die "configure failed ($bdir/stage-configure.log)"; }
say "building pagedkv_cuda_tests and bench_kernels (-j $jobs, nice; a few minutes on 2 cores)"
nice -n 10 cmake --build "$bdir" -j "$jobs" --target pagedkv_cuda_tests pagedkv_bench_kernels > "$bdir/stage-build.log" 2>&1 \
  || { grep -E 'error|Error' "$bdir/stage-build.log" | head -n 20 >&2; die "build failed ($bdir/stage-build.log)"; }
mkdir -p "$bdir/probe"
"$root/scripts/gpu-check.sh" --probe-source > "$bdir/probe/probe.cu"
nvcc -std=c++17 -arch=sm_$arch -cudart static -Xcompiler=-static-libstdc++ -o "$bdir/probe/probe" \
  "$bdir/probe/probe.cu" "$bdir/glibc_compat.o" || die "the probe did not compile"
[[ "$("$root/scripts/gpu-check.sh" --source-hash)" == "$hash_before" ]] \
  || die "the sources changed during the build: run it again on a quiet tree"

tmp="$root/.gpu-deps/bundle.tmp"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT   # a failed run leaves no half-made bundle to carry
mkdir -p "$tmp"
cp "$bdir/tests/cuda/pagedkv_cuda_tests" "$bdir/benchmarks/bench_kernels" "$bdir/probe/probe" "$tmp/"
# The CTest tests, exactly as tests/cuda/CMakeLists.txt registers them: name and arguments, tab-separated.
(cd "$bdir" && ctest --show-only=json-v1) > "$tmp/ctest.json"
python3 - "$tmp" <<'PY' || die "could not read the CTest test list"
import json, os, sys
d = sys.argv[1]
tests = json.load(open(os.path.join(d, "ctest.json")))["tests"]
rows = {"gpu": [], "cuda_host": []}
for t in tests:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    labels = props.get("LABELS", [])
    cmd = t.get("command", [])
    if not cmd or os.path.basename(cmd[0]) != "pagedkv_cuda_tests":
        sys.exit(f"test {t['name']}: command {cmd} is not pagedkv_cuda_tests")
    if any("\t" in a or "\n" in a for a in cmd):
        sys.exit(f"test {t['name']}: an argument holds a tab or newline")
    for label in rows:
        if label in labels:
            if label == "gpu" and str(props.get("SKIP_RETURN_CODE")) != "77":
                sys.exit(f"test {t['name']}: SKIP_RETURN_CODE is {props.get('SKIP_RETURN_CODE')}, not 77")
            rows[label].append("\t".join([t["name"]] + cmd[1:]))
if not rows["gpu"] or not rows["cuda_host"]:
    sys.exit(f"found {len(rows['gpu'])} gpu and {len(rows['cuda_host'])} cuda_host tests")
for label, name in (("gpu", "gpu_tests.tsv"), ("cuda_host", "host_tests.tsv")):
    with open(os.path.join(d, name), "w") as f:
        f.write("".join(r + "\n" for r in rows[label]))
PY
rm -f "$tmp/ctest.json"
strip --strip-unneeded "$tmp/pagedkv_cuda_tests" "$tmp/bench_kernels" "$tmp/probe"
glibc=""
for b in pagedkv_cuda_tests bench_kernels probe; do
  bad=$(ldd "$tmp/$b" 2>&1 | grep -E 'libcudart|libstdc\+\+|not found' || true)
  [[ -z "$bad" ]] || die "$b still needs: $bad"
  # The device's fatbinary must be there after strip.
  sections=$(objdump -h "$tmp/$b")
  [[ $b == probe || "$sections" == *.nv_fatbin* ]] || die "$b has no .nv_fatbin section after strip"
  glibc+=$(objdump -T "$tmp/$b" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -uV | tail -n1)$'\n'
done
glibc=$(printf '%s' "$glibc" | sort -uV | tail -n1)
if [[ "$(printf '%s\n%s\n' "${glibc#GLIBC_}" "$glibc_max" | sort -V | tail -n1)" != "$glibc_max" ]]; then
  for b in pagedkv_cuda_tests bench_kernels probe; do
    objdump -T "$tmp/$b" | grep -E "\($glibc\)" | sed "s/^/$b: /" >&2
  done
  die "the binaries need $glibc, above PAGEDKV_BUNDLE_GLIBC_MAX=$glibc_max (symbols above)"
fi
{
  grep -E '^(commit|branch|changed_paths|staged_at)=' "$root/.gpu-deps/REVISION"
  echo "source_hash=$hash_before"
  echo "cuda_architectures=$arch"
  echo "cuda_runtime=$(nvcc --version | grep -o 'release [0-9.]*' | cut -d' ' -f2)"
  echo "host_compiler=$(grep -m1 '^CMAKE_CXX_COMPILER:' "$bdir/CMakeCache.txt" | cut -d= -f2) $(c++ -dumpfullversion 2>/dev/null)"
  echo "glibc_required=$glibc"
  echo "built_at=$(date -u +%FT%TZ)"
  echo "build_seconds=$(( $(date +%s) - t0 ))"
  echo "gpu_tests=$(grep -c . "$tmp/gpu_tests.tsv")"
  echo "host_tests=$(grep -c . "$tmp/host_tests.tsv")"
  for b in pagedkv_cuda_tests bench_kernels probe; do
    echo "size_$b=$(stat -c %s "$tmp/$b")"
    echo "sha256_$b=$(sha256sum "$tmp/$b" | cut -c1-64)"
  done
} > "$tmp/BUNDLE"
rm -rf "$bundle"
mv "$tmp" "$bundle"
total=$(du -sb "$root/.gpu-deps" | cut -f1)
if (( total > 32 * 1024 * 1024 )); then
  die ".gpu-deps is $total bytes, over 32 MiB: the device tool carries at most 64 MiB of ignored paths"
fi
say "$(grep -c . "$bundle/gpu_tests.tsv") GPU + $(grep -c . "$bundle/host_tests.tsv") host tests, $glibc," \
    "bundle $(du -sh "$bundle" | cut -f1), .gpu-deps $(( total / 1024 )) KiB, $(( $(date +%s) - t0 )) s -> .gpu-deps/bundle;" \
    "carry: .gpu-deps"
