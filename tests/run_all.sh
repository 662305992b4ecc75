#!/usr/bin/env bash
# Every test (`make test`), in two pytest runs, so a fresh machine builds the local control plane while tests run:
#
#   tests/run_all.sh PYTHON [PYTEST_ARG...]
#
# The control plane's binaries (tests/cluster/build_binaries.sh) are most of a fresh machine's set-up: Go builds
# of Kubernetes, etcd, kwok, helm, the inference extension's picker and KEDA, 26 min on two cores here (`make k8s`
# alone, other work sharing the machine). The build runs in the background at the idle scheduling class
# (`chrt --idle`: it gets only the CPU time no test wants; many run torch on one thread or wait on a server)
# while the tests that need no cluster run (on a cold machine here it finished in 26 of their 43 minutes); the
# `cluster` tests (tests/conftest.py marks every test on the control plane) run after it has finished. With the
# binaries cached (every later run) the build finds them and exits at once. helm is built first, in the
# foreground: the chart's static tests, among the first, run it.
#
# Idle class or not, the build slows the tests beside it. Running the multi-process (torch.distributed) tests
# after it instead was measured cold on one machine and lost: their own run took 396 s where their durations
# beside the build had summed to 742 s, but the other tests took 474 s longer, and the whole `.ci/run` 3589 s
# against 3390 s.
#
# Exit status: non-zero when either run fails or the build does (its log's tail is printed).
set -uo pipefail

[[ $# -ge 1 ]] || { echo "usage: $0 PYTHON [PYTEST_ARG...]" >&2; exit 2; }
python="$1"; shift
cd "$(dirname "$0")/.."

log="$(mktemp -t control-plane-build.XXXXXX.log)"
failed() { echo "run_all.sh: building $1 failed; the tail of $log:" >&2; tail -n 40 "$log" >&2; exit 1; }

bash tests/cluster/build_binaries.sh helm >"$log" 2>&1 || failed helm
setsid --wait chrt --idle 0 bash tests/cluster/build_binaries.sh >"$log" 2>&1 &
build=$!
# Stopped with the tests (Ctrl-C): the build's whole process group, go and its compilers included.
trap 'kill -- -"$build" 2>/dev/null' EXIT

status=0
# pytest's exit status 5: no test selected in this half (a -k that matches only cluster tests, or none).
run() { "$python" -m pytest tests "$@"; local rc=$?; (( rc == 0 || rc == 5 )) || status=$rc; }
run -m "not cluster" "$@"

started=$(date +%s)
wait "$build" || failed "the control plane's binaries"
echo "run_all.sh: the control plane's binaries: $(grep -o 'built into .* in [0-9]*s' "$log");" \
  "waited for them $(( $(date +%s) - started )) s after the tests that need no cluster" >&2
rm -f "$log"

run -m cluster "$@"
exit "$status"
