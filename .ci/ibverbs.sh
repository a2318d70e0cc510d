#!/usr/bin/env bash
# Span shipping's transfer engine (Mooncake's non-CUDA wheel) loads libibverbs and libnl even
# over TCP. Where the system has none, unpack Debian's packages into $1 (no root needed:
# `apt-get download` + `dpkg -x`); runtime/scale/ship/mooncake.py loads them from there.
set -euo pipefail
dest="$1"
if ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then exit 0; fi
if [ -e "$dest/usr/lib/x86_64-linux-gnu/libibverbs.so.1" ]; then exit 0; fi
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "warning: no libibverbs and no apt-get: span shipping (runtime/scale/ship) cannot start" >&2
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null)
mkdir -p "$dest"
for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dest"; done
