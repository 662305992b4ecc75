#!/usr/bin/env bash
# Run a command with a Docker engine that can build with BuildKit; start dockerd for it when none answers.
#
#   tests/images/docker_engine.sh COMMAND [ARG...]
#
# - A running engine (`docker info` answers) is used as it is and left alone.
# - Otherwise, as root with dockerd installed (Debian's docker.io), dockerd is started here with overlay2
#   storage, no iptables and no bridge (`--iptables=false --bridge=none`: builds and containers use the
#   host's network, `--network host`), and stopped when COMMAND ends. Only that dockerd is stopped.
# - Without either, it fails naming what is missing: `make test` needs Docker, it never skips the image
#   tests.
#
# DOCKER, exported to COMMAND, is a client that builds with BuildKit (the Dockerfiles use per-Dockerfile
# .dockerignore files and cache mounts): `docker` when it has the buildx plugin, else a client of Docker
# 20.10 or older, whose built-in BuildKit needs no plugin (Debian's /usr/bin/docker). DOCKER_BUILDKIT=1.
set -euo pipefail

[[ $# -gt 0 ]] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }

fail() { echo "docker_engine.sh: $*" >&2; exit 1; }

# A client that can build with BuildKit, or nothing.
buildkit_client() {
  local c major
  for c in "${DOCKER:-}" "$(command -v docker || true)" /usr/bin/docker; do
    [[ -n "$c" && -x "$(command -v "$c" || true)" ]] || continue
    if "$c" buildx version >/dev/null 2>&1; then echo "$c"; return; fi
    major="$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)"
    if [[ "$major" =~ ^[0-9]+$ ]] && (( major < 23 )); then echo "$c"; return; fi
  done
}

DOCKER="$(buildkit_client)"
[[ -n "$DOCKER" ]] || fail "no Docker client that builds with BuildKit: install Debian's docker.io \
(apt-get install docker.io; .ci/run does this) or the docker buildx plugin"
export DOCKER DOCKER_BUILDKIT=1

if "$DOCKER" info >/dev/null 2>&1; then
  exec "$@"
fi

command -v dockerd >/dev/null \
  || fail "make test needs a Docker engine: none answers ($DOCKER info fails) and dockerd is not installed. \
Install Debian's docker.io (apt-get install docker.io; .ci/run does this), or start Docker yourself."
[[ $(id -u) -eq 0 ]] || fail "no Docker engine answers, and starting dockerd needs root: start Docker yourself"

LOG="$(mktemp -t dockerd.XXXXXX.log)"
dockerd --storage-driver=overlay2 --iptables=false --bridge=none >"$LOG" 2>&1 &
DOCKERD_PID=$!
echo "docker_engine.sh: started dockerd (pid $DOCKERD_PID, log $LOG)" >&2

stop_dockerd() {
  kill -TERM "$DOCKERD_PID" 2>/dev/null || return 0
  # dockerd stops its containers and its managed containerd before it exits.
  for _ in $(seq 60); do
    if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then echo "docker_engine.sh: stopped dockerd" >&2; rm -f "$LOG"; return 0; fi
    sleep 1
  done
  echo "docker_engine.sh: dockerd (pid $DOCKERD_PID) did not stop in 60 s; killing it" >&2
  kill -KILL "$DOCKERD_PID" 2>/dev/null || true
}
trap stop_dockerd EXIT
trap 'exit 130' INT   # so that an interrupted run stops its dockerd too
trap 'exit 143' TERM

deadline=$((SECONDS + 60))
until "$DOCKER" info >/dev/null 2>&1; do
  kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -n 20 "$LOG" >&2; fail "dockerd exited while starting (log $LOG)"; }
  (( SECONDS < deadline )) || { tail -n 20 "$LOG" >&2; fail "dockerd did not answer within 60 s (log $LOG)"; }
  sleep 0.5
done

"$@"
