#!/usr/bin/env bash
# Run a command with a Docker engine reachable: the user's own engine when one answers (its images,
# pulled or built, are used as they are); else, if we are root, start dockerd the quiet way (no
# iptables, no bridge: containers use --network none or host only), run the command, then stop that
# dockerd by its pid. Without root or dockerd the command runs as is (the docker tests then say why
# they cannot run, and fail under POLAR_NO_SKIP=1).
#
# The engine this starts keeps its images between runs: its data root is persistent,
# $POLAR_DOCKER_ROOT, default $POLAR_CACHE/docker (else ~/.cache/polar/docker). SWE-bench instance
# images (built here, or official ones loaded into it) survive the next run; only the exec root and
# the log are per run.
set -uo pipefail
started=""
if ! docker info >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null 2>&1; then
  data="${POLAR_DOCKER_ROOT:-${POLAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/polar}/docker}"
  mkdir -p "$data"
  root=$(mktemp -d /tmp/polar-dockerd.XXXXXX)
  dockerd --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
    --data-root "$data" --exec-root "$root/exec" --pidfile "$root/dockerd.pid" \
    >"$root/dockerd.log" 2>&1 &
  started=$!
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "with-dockerd: dockerd did not come up; log:" >&2; tail -20 "$root/dockerd.log" >&2; }
fi
"$@"
rc=$?
if [ -n "$started" ]; then
  kill "$started" 2>/dev/null; wait "$started" 2>/dev/null
fi
exit $rc
