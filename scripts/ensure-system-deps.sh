#!/usr/bin/env bash
# System packages the tests need, installed on a fresh machine when we may (root + apt-get).
# Under CI=true a missing package that cannot be installed fails the run here, loudly.
set -euo pipefail

need_sshd() { ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; }

if need_sshd; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing openssh-server (sshd) for the SSH tests..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends openssh-server openssh-client >/dev/null
    # The package may start a system sshd on port 22; the tests start their own on a free port.
  elif [ "${CI:-}" = "true" ]; then
    echo "sshd is missing and cannot be installed (need root and apt-get); the SSH tests require it" >&2
    exit 1
  else
    echo "warning: sshd is missing; SSH tests will be skipped (run as root to install it)" >&2
  fi
fi
