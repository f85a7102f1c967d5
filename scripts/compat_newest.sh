#!/usr/bin/env bash
# Runs the compatibility job (scripts/compat_release.sh) on the newest Ray the package index serves: the evidence
# a maintainer needs to raise pyproject.toml's cap (and _rllib_compat.NEWEST_TESTED, TESTED_RANGE and the README's
# table) to it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
newest=$(pip index versions ray 2>/dev/null | sed -n 's/^ray (\(.*\))$/\1/p')
[ -n "$newest" ] || { echo "error: the package index named no Ray release (pip index versions ray)"; exit 2; }
cap=$(python -c "import re; print(re.search(r'ray\[rllib\][^\"]*<([0-9.]+)', open('$root/pyproject.toml').read()).group(1))")
if python -c "import sys; v = lambda s: tuple(map(int, s.split('.')[:2])); sys.exit(v('$newest') < v('$cap'))"; then
    echo "ray $newest is at or above the cap <$cap: testing it beyond the cap"
    exec "$root/scripts/compat_release.sh" "$newest" --beyond-cap
fi
echo "ray $newest is within the declared range (<$cap)"
exec "$root/scripts/compat_release.sh" "$newest"
