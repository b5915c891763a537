#!/bin/sh
# Build a static fio (no shared libraries: it runs on the GPU machine, whose image has no fio and no
# network) from Debian's source package, into .gpu/vllm-src/fio (git-ignored; carried with the sources).
# Run on the CPU machine (Debian, as root or with apt access):  scripts/gpu/build_static_fio.sh [out]
# The GPU scripts run it against their test tables (`--fio`): the disk under every cold number.
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$repo/.gpu/vllm-src/fio}
[ -x "$out" ] && { "$out" --version; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/parts"
# Source entries for the machine's own Debian sources, in a private list: its apt configuration stays as it is.
for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && sed 's/^Types: deb$/Types: deb-src/' "$f" >"$work/parts/$(basename "$f")"
done
[ -f /etc/apt/sources.list ] && sed -n 's/^deb /deb-src /p' /etc/apt/sources.list >"$work/src.list" || : >"$work/src.list"
o="-o Dir::Etc::SourceList=$work/src.list -o Dir::Etc::SourceParts=$work/parts -o Dir::State::Lists=$work/lists"
apt-get $o update >/dev/null
(cd "$work" && apt-get $o source --download-only fio >/dev/null 2>&1)
tar -xzf "$work"/fio_*.orig.tar.gz -C "$work"
cd "$work"/fio-*/
./configure --build-static --disable-native >/dev/null
make -j"$(nproc)" fio >/dev/null
mkdir -p "$(dirname "$out")"
strip -o "$out" fio
"$out" --version
