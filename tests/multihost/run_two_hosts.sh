#!/usr/bin/env bash
# Two simulated hosts (network, mount, UTS, IPC and pid namespaces joined by a
# veth pair) under `torchrun --nnodes 2 --nproc-per-node 2`: the multi-host
# cases of tests/multihost, with one line of results per case.
#
#   tests/multihost/run_two_hosts.sh                  # the CI selection
#   tests/multihost/run_two_hosts.sh --all            # plus the slow cases
#   tests/multihost/run_two_hosts.sh --case fault-tp-link --timeout 5 --keep
#
# Needs root, iproute2 (`ip netns`) and util-linux (`unshare`, `nsenter`);
# exits 77 (skipped) without them. Every namespace, veth, mount and process
# it creates is removed on every exit: the Python driver tears its hosts
# down itself, and this trap deletes any namespace a killed driver left.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}

driver=""
cleanup() {
    if [[ -n "$driver" ]] && kill -0 "$driver" 2>/dev/null; then
        kill -TERM "$driver" 2>/dev/null || true
        wait "$driver" 2>/dev/null || true
    fi
    # namespaces whose creating driver is gone (names carry its pid)
    "$py" -c 'from tests.multihost.netns import sweep_stale; sweep_stale()' 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$py" -m tests.multihost.scenarios "$@" &
driver=$!
wait "$driver"
