#!/usr/bin/env bash
# Run a command (make test when none is given) with CPU-bound busy loops beside it (two unless
# LOAD says otherwise), as on a loaded CI machine: a wait that passes only on an idle machine
# fails here first. The loops are stopped by their own PIDs when the command ends.
set -uo pipefail
if [ $# -eq 0 ]; then set -- make test; fi
busy=()
for _ in $(seq "${LOAD:-2}"); do
    python3 -c 'while True: pass' &
    busy+=("$!")
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
echo "under load: ${#busy[@]} busy loops beside: $*"
start=$(date +%s)
"$@"
rc=$?
echo "under load: exit $rc after $(( $(date +%s) - start )) s"
exit "$rc"
