#!/usr/bin/env bash
# The Debian packages the multi-node tests run for real (pdsh, sshd, OpenMPI, Slurm, munge), and libaio, which
# DeepSpeed's async_io op (offload to NVMe) builds against, installed once when missing, as root; as another user
# it says so and the tests that need them skip (--check: only say which are missing, exit 1). Their maintainer
# scripts are kept from starting daemons: the tests start their own on loopback.
set -euo pipefail
declare -A PACKAGES=([/usr/bin/pdsh]=pdsh [/usr/sbin/sshd]=openssh-server [/usr/bin/ssh]=openssh-client
                     [/usr/bin/mpirun]=openmpi-bin [/usr/sbin/slurmctld]=slurm-wlm [/usr/sbin/munged]=munge
                     [/usr/include/libaio.h]=libaio-dev)
missing=()
for binary in "${!PACKAGES[@]}"; do
    [ -e "$binary" ] || missing+=("${PACKAGES[$binary]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "${1:-}" = --check ]; then
    echo "needs ${missing[*]}: \`sudo make cluster-packages\` installs them (make test does, as root)" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then  # the rest of the suite runs; the multi-node tests skip, saying this
    echo "note: the multi-node and NVMe tests need ${missing[*]}, which only root installs: they are skipped;" \
         "\`sudo make cluster-packages\` installs them" >&2
    exit 0
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
