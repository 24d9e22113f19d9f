#!/usr/bin/env bash
# Run a command with a Docker engine reachable: if none answers and we are root, start dockerd the
# quiet way (no iptables, no bridge: containers use --network none or host only), run the command,
# then stop that dockerd by its pid. Without root or dockerd the command runs as is (the docker
# tests then say why they cannot run, and fail under POLAR_NO_SKIP=1).
set -uo pipefail
started=""
if ! docker info >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null 2>&1; then
  root=$(mktemp -d /tmp/polar-dockerd.XXXXXX)
  dockerd --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
    --data-root "$root/data" --exec-root "$root/exec" --pidfile "$root/dockerd.pid" \
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
