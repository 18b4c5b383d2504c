#!/usr/bin/env bash
# Re-split the staged vLLM parts (.stage/1..4 from ../shared/gpu/stage_vllm.sh) into parts that fit
# one device call beside the current tracked tree (64 MiB per call, tree included): .stage/p1..pN.
# Then, back to back: parts 1..N-1 `mkdir -p /tmp/stage && cp -r .stage/pK/. /tmp/stage/`
# (carry [".stage/pK"]), part N the same + `source /tmp/stage/setup_on_device.sh && ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')
room=$(( 64 * 1024 * 1024 - tree - 1024 * 1024 ))  # 1 MiB margin for files committed later
[ "$room" -gt 8000000 ] || { echo "restage: the tracked tree ($tree bytes) leaves no room for parts" >&2; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cat .stage/[0-9]/vllm.tar.xz.* > "$tmp/vllm.tar.xz"
(cd "$tmp" && split -b "$room" -a 2 vllm.tar.xz vllm.tar.xz.part.)
rm -rf .stage/p[0-9]*
n=0
for chunk in "$tmp"/vllm.tar.xz.part.*; do
  n=$((n + 1)); mkdir -p .stage/p$n; mv "$chunk" ".stage/p$n/vllm.tar.xz.$(basename "$chunk" | sed 's/.*part\.//')"
done
# the wheels and the setup script fill the last part's room, then new parts
used=$(du -sb .stage/p$n | cut -f1)
for w in $(ls -S .stage/[0-9]/deps/*.whl); do
  s=$(stat -c %s "$w")
  if [ $((used + s)) -gt "$room" ]; then n=$((n + 1)); used=0; fi
  mkdir -p .stage/p$n/deps; cp "$w" .stage/p$n/deps/; used=$((used + s))
done
cp .stage/[0-9]/setup_on_device.sh .stage/p$n/
echo "restage: $n parts of <= $room bytes beside a $tree-byte tree (.stage/p1 .. .stage/p$n; the last sources setup_on_device.sh)"
