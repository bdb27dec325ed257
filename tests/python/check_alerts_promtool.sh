#!/usr/bin/env bash
# promtool check rules ALERTS, then promtool test rules TESTS (the alerts' unit tests).
# Exits 77 (skipped) without promtool (Debian: apt-get install prometheus).
set -euo pipefail
alerts=$1 tests=$2
if ! command -v promtool >/dev/null; then
  echo "SKIP: promtool not found (apt-get install prometheus)"
  exit 77
fi
promtool check rules "$alerts"
# promtool resolves rule_files relative to the test file.
cd "$(dirname "$tests")"
promtool test rules "$(basename "$tests")"
