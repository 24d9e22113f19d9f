#!/usr/bin/env bash
# System packages the test suite and the demo use, installed only when missing:
#   chromium + chromium-driver  the HTML trajectory view's screenshot test (polar-recon show)
#   bubblewrap                  isolation of the local rollout runtime
#   docker.io                   the docker rollout runtime (dockerd is started quietly by with-dockerd.sh)
#   nodejs + npm                the real harness CLIs (Codex, Claude Code, Qwen Code, Pi)
#   debootstrap                 the Debian base of the SWE-bench instance images (runtimes/images.py;
#                               built once, kept in $POLAR_CACHE/swebench/)
set -euo pipefail
need=()
for pkg in chromium chromium-driver bubblewrap docker.io debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "sysdeps: missing system packages: ${need[*]} (as root: apt-get install -y ${need[*]})" >&2
  exit 0
fi
# Keep package scripts from starting services: a dockerd started by docker.io's postinst would
# create its default bridge (a private-range network), which must never happen here.
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && created_policy=1
fi
trap '[ $created_policy = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
echo "sysdeps: installing ${need[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
