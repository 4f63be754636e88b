#!/usr/bin/env bash
# Make sure `prometheus` and `promtool` can be run by the tests and print the directory that
# holds them on stdout (scripts/test.sh puts it first on PATH): the metrics end-to-end test
# scrapes real workers with a real Prometheus, and `promtool` checks deploy/prometheus/.
#   1. both already on PATH                     -> print the directory of `prometheus`
#   2. a copy this script unpacked before       -> print its directory
#   3. otherwise fetch Debian's `prometheus` .deb with `apt-get download` (no install) and
#      unpack only its two binaries with `dpkg-deb -x` into a private directory:
#      ${GPUHEDGE_TOOLS_DIR:-${XDG_CACHE_HOME:-~/.cache}/gpuhedge-celery}/prometheus/bin
# The package is never installed, so no prometheus.service is enabled or started, no system
# user is created, and nothing is left running after the tests. Deleting the directory undoes
# it. Diagnostics go to stderr; exit 1 if the binaries cannot be had (tests must not skip).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  dirname "$(command -v prometheus)"; exit 0
fi
tools="${GPUHEDGE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuhedge-celery}"
bin="$tools/prometheus/bin"
if [ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ]; then
  echo "$bin"; exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
  echo "ensure-prometheus: prometheus and promtool are not on PATH and this is no Debian" \
    "system (apt-get, dpkg-deb) to fetch them from: install both and rerun" >&2
  exit 1
fi
echo "ensure-prometheus: prometheus/promtool not found; unpacking Debian's prometheus package" \
  "into $bin (not installed: no service)" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt's download sandbox user writes here
if ! apt-cache show prometheus >/dev/null 2>&1; then  # no package lists yet (fresh machine)
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >&2 || true
fi
if ! (cd "$work" && apt-get download -qq prometheus >&2); then
  echo "ensure-prometheus: apt-get download prometheus failed (see above)" >&2
  exit 1
fi
mkdir -p "$work/root" "$tools/prometheus"
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
for name in prometheus promtool; do
  if [ ! -x "$work/root/usr/bin/$name" ]; then
    echo "ensure-prometheus: the prometheus package has no usr/bin/$name" >&2
    exit 1
  fi
done
# Move into place whole, so an interrupted run never leaves half a directory behind.
rm -rf "$tools/prometheus/bin.new"
mkdir "$tools/prometheus/bin.new"
mv "$work/root/usr/bin/prometheus" "$work/root/usr/bin/promtool" "$tools/prometheus/bin.new/"
rm -rf "$bin"
mv "$tools/prometheus/bin.new" "$bin"
echo "ensure-prometheus: $("$bin/prometheus" --version 2>&1 | head -n 1)" >&2
echo "$bin"
