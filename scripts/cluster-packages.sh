#!/usr/bin/env bash
# The Debian packages the multi-node tests run for real (pdsh, sshd, OpenMPI, Slurm, munge), installed once
# when missing (--check: only say which are missing). Their maintainer scripts are kept from starting daemons: the tests start their own on loopback.
set -euo pipefail
declare -A PACKAGES=([/usr/bin/pdsh]=pdsh [/usr/sbin/sshd]=openssh-server [/usr/bin/ssh]=openssh-client
                     [/usr/bin/mpirun]=openmpi-bin [/usr/sbin/slurmctld]=slurm-wlm [/usr/sbin/munged]=munge)
missing=()
for binary in "${!PACKAGES[@]}"; do
    [ -e "$binary" ] || missing+=("${PACKAGES[$binary]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "${1:-}" = --check ]; then
    echo "the multi-node tests need ${missing[*]}: run \`make cluster-packages\` (as root) first" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "error: the multi-node tests need ${missing[*]}; run as root or: sudo apt-get install ${missing[*]}" >&2
    exit 2
fi
policy=/usr/sbin/policy-rc.d
added=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && added=1
fi
trap 'if [ "$added" = 1 ]; then rm -f "$policy"; fi' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
