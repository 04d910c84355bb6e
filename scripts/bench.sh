#!/usr/bin/env bash
# Runs every CPU benchmark in bench/ (each prints its own table with side-by-side ratios).
set -euo pipefail
cd "$(dirname "$0")/.."
for b in bench/bench_*.py; do
  echo "=== $b"
  python "$b"
done
