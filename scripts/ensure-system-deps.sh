#!/usr/bin/env bash
# System packages, installed on a fresh machine when we may (root + apt-get).
#
#   ensure-system-deps.sh test    OpenSSH's sshd for the SSH tests, iproute2 (ip, tc) and
#                                 nftables for the SSH fleet tests (separate hosts in network
#                                 namespaces; nft drops packets where the kernel has no netem);
#                                 bubblewrap and setpriv for the sandbox tests;
#                                 under CI=true a missing one that cannot be installed fails
#                                 here, loudly
set -euo pipefail

can_apt() { [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; }
# Two runs at once (two `make` invocations) take turns at apt (flock), rather than one
# failing on apt's lock.
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  (
    flock 9
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  ) 9>/tmp/agent-backend-apt.lock
}

test_deps() {
  if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
    if can_apt; then
      echo "installing openssh-server (sshd) for the SSH tests..."
      apt_install openssh-server openssh-client
      # The package may start a system sshd on port 22; the tests start their own on a free port.
    elif [ "${CI:-}" = "true" ]; then
      echo "sshd is missing and cannot be installed (need root and apt-get); the SSH tests require it" >&2
      exit 1
    else
      echo "warning: sshd is missing; SSH tests will be skipped (run as root to install it)" >&2
    fi
  fi
  local net=()
  # bubblewrap (bwrap) and util-linux's setpriv: the namespaces isolation tier (docs/sandboxes.md).
  command -v bwrap >/dev/null 2>&1 || net+=(bubblewrap)
  command -v setpriv >/dev/null 2>&1 || net+=(util-linux)
  command -v ip >/dev/null 2>&1 || net+=(iproute2)
  command -v tc >/dev/null 2>&1 || net+=(iproute2)
  command -v nft >/dev/null 2>&1 || net+=(nftables)
  if [ ${#net[@]} -gt 0 ]; then
    # shellcheck disable=SC2207 # package names have no spaces
    net=($(printf '%s\n' "${net[@]}" | sort -u))
    if can_apt; then
      echo "installing ${net[*]} for the SSH fleet and sandbox tests..."
      apt_install "${net[@]}"
    elif [ "${CI:-}" = "true" ]; then
      echo "${net[*]} missing and cannot be installed (need root and apt-get); the SSH fleet and sandbox tests require them" >&2
      exit 1
    else
      echo "warning: ${net[*]} missing; SSH fleet and sandbox tests will be skipped (run as root to install)" >&2
    fi
  fi
}

case "${1:-test}" in
  test) test_deps ;;
  *) echo "usage: $0 [test]" >&2; exit 2 ;;
esac
