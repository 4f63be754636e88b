#!/usr/bin/env bash
# Make sure Prometheus's server and promtool are installed for the tests (Debian's
# `prometheus` package has both): the metrics end-to-end test scrapes real workers with a real
# Prometheus, and `promtool check rules` validates deploy/prometheus/. Installs it with apt-get
# where missing; diagnostics go to stderr; exit 1 if it cannot be had (tests must not skip).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
echo "ensure-prometheus: prometheus/promtool not found; installing Debian's prometheus package" >&2
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >&2
  # no recommends: the node exporter and the web console libraries are not needed
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    prometheus >&2
fi
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "ensure-prometheus: prometheus and promtool are needed and could not be installed" >&2
  exit 1
fi
