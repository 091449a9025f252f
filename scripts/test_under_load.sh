#!/usr/bin/env bash
# The suite on a busy machine: scripts/test.sh (set-up included; extra arguments go to pytest)
# with two CPU-bound loops beside it, at the suite's own priority, for as long as it runs and
# at most $POLAR_LOAD_SECONDS (default 5400: CI's 90 minutes), so they end even if this script
# is killed. It must pass as a quiet run does: a test that depends on the machine being idle
# (a fixed sleep, a tight wall-clock bound, a limit with no room) fails here first. README
# "Tests" has the times, quiet and loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${POLAR_LOAD_SECONDS:-5400}"
trap 'kill $(jobs -p) 2>/dev/null' EXIT
for _ in 1 2; do
    timeout "$seconds" sh -c 'while :; do :; done' &
done
began=$SECONDS
rc=0
./scripts/test.sh "$@" || rc=$?
echo "under load (2 busy loops): scripts/test.sh $* ended with exit $rc after $((SECONDS - began)) s" >&2
exit "$rc"
