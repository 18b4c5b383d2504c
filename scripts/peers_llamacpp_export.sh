#!/usr/bin/env bash
# Export a trimmed llama.cpp source tree (only what `llama-bench` with the CPU and CUDA backends
# needs) as .peers/llama.cpp-<short commit>.tar.xz, small enough to travel to the device machine
# in a run's `carry` (issue 28). Runs here, not on the device.
#
# Where the source comes from: the device machine and this one reach no git host, and the
# llama.cpp repository is too large for the search tool's fetch (1.4 GB), so the pinned source is
# the llama.cpp tree vendored in the llama-cpp-python sdist, a PyPI release that records the
# submodule commit it vendors (.git/modules/vendor/llama.cpp/HEAD):
#   llama-cpp-python 0.3.36 -> ggml-org/llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f
#
#   scripts/peers_llamacpp_export.sh            # downloads the sdist into .peers/ if missing
#   scripts/peers_llamacpp_export.sh SDIST.tar.gz
#
# What is kept besides the build: gguf-py/ (the same commit's GGUF writer, for the gguf phase).
# What is dropped: models/ (vocab GGUFs), docs/, tests/, examples/, benches/, media, every tool
# but llama-bench (tools/CMakeLists.txt is rewritten to add only it), every ggml backend
# but CPU, CUDA and BLAS. BUILD_COMMIT in cmake/build-info.cmake is set to the pinned short hash
# (the tree has no .git), so llama-bench's JSON names the commit it was built from.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="$ROOT/.peers"
VERSION=0.3.36
COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
SHORT=${COMMIT:0:7}
mkdir -p "$PEERS"
SDIST="${1:-$PEERS/llama_cpp_python-$VERSION.tar.gz}"
if [ ! -f "$SDIST" ]; then
  ${PIP:-python3 -m pip} download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS"
fi
WORK="$(mktemp -d "$PEERS/export.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
P="llama_cpp_python-$VERSION"
tar xzf "$SDIST" -C "$WORK" "$P/vendor/llama.cpp" "$P/.git/modules/vendor/llama.cpp/HEAD"
got="$(tr -d '[:space:]' < "$WORK/$P/.git/modules/vendor/llama.cpp/HEAD")"
if [ "$got" != "$COMMIT" ]; then
  echo "the sdist vendors llama.cpp $got, not the pinned $COMMIT" >&2
  exit 1
fi
SRC="$WORK/$P/vendor/llama.cpp"
DST="$WORK/llama.cpp-$SHORT"
mkdir -p "$DST/tools" "$DST/ggml/src"
for d in CMakeLists.txt LICENSE licenses cmake include src common vendor gguf-py; do
  [ -e "$SRC/$d" ] && cp -a "$SRC/$d" "$DST/"
done
cp -a "$SRC/tools/llama-bench" "$DST/tools/"
rm -rf "$DST/gguf-py/tests" "$DST/gguf-py/gguf/scripts"
for d in "$SRC"/ggml/*; do
  [ "$(basename "$d")" = src ] || cp -a "$d" "$DST/ggml/"
done
rm -rf "$DST/ggml/tests" "$DST/ggml/examples"
for f in "$SRC"/ggml/src/*; do
  case "$(basename "$f")" in
    ggml-*) [ -d "$f" ] || { cp -a "$f" "$DST/ggml/src/"; continue; } ;;
  esac
  case "$(basename "$f")" in
    ggml-cpu|ggml-cuda|ggml-blas) cp -a "$f" "$DST/ggml/src/" ;;
    ggml-*) [ -d "$f" ] && continue; cp -a "$f" "$DST/ggml/src/" ;;
    *) cp -a "$f" "$DST/ggml/src/" ;;
  esac
done
cat > "$DST/tools/CMakeLists.txt" <<'CM'
# trimmed by reap-swap scripts/peers_llamacpp_export.sh: llama-bench only
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
CM
sed -i "s/^set(BUILD_COMMIT \"unknown\")/set(BUILD_COMMIT \"$SHORT\")/" "$DST/cmake/build-info.cmake"
grep -q "set(BUILD_COMMIT \"$SHORT\")" "$DST/cmake/build-info.cmake"
echo "$COMMIT" > "$DST/PINNED_COMMIT"
echo "llama-cpp-python==$VERSION sdist, vendor/llama.cpp" > "$DST/SOURCE"
OUTF="$PEERS/llama.cpp-$SHORT.tar.xz"
tar -C "$WORK" -cf - "llama.cpp-$SHORT" | xz -T2 -6 > "$OUTF.tmp"
mv "$OUTF.tmp" "$OUTF"
du -sh "$DST" | sed 's/^/unpacked: /'
ls -l "$OUTF"
