#!/usr/bin/env bash
# `make test-deps` (run by `make test`): the system packages only the test suite
# needs -- a real one-node Slurm (slurm-wlm, munge), real sshd hosts in network
# namespaces (openssh-server/-client, iproute2). Kept out of `make setup`, which
# must not install daemons on a cluster node. Only the missing ones, only as root;
# without root the tests that need them skip (or fail under CI=true) and name them.
# `test-deps.sh --dry-run` prints what it would install and changes nothing.
set -euo pipefail

say() { printf '[test-deps] %s\n' "$*"; }
die() { printf '[test-deps] error: %s\n' "$*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

DRY_RUN=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        *) die "unknown argument '$arg' (the only option is --dry-run)" ;;
    esac
done

# sshd and munged live in /usr/sbin, which a non-root PATH may lack.
PATH=$PATH:/usr/sbin:/sbin
missing=()
have slurmctld || missing+=(slurm-wlm)
have munged || missing+=(munge)
have sshd || missing+=(openssh-server)
have ssh || missing+=(openssh-client)
have ip || missing+=(iproute2)

if [ "$DRY_RUN" = 1 ]; then
    say "dry run: apt-get install ${missing[*]:-(nothing missing)}"
    exit 0
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    say "not root: skipping ${missing[*]} (only the tests that launch Slurm or sshd hosts need them)"
    exit 0
fi
say "apt-get install ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
