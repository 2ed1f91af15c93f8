# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts sourcing this
# Shared settings and helpers for the opt-in host lanes (sourced by scripts/hosts/* and
# scripts/test-hosts, scripts/test-slurm). Everything here needs root.
#
# Layout of the "hosts" lane (scripts/hosts/up, scripts/hosts/down):
#   bridge nbbr0 in the root namespace, 10.77.0.1/24   -> the notebook kernel's address ("nbkernel")
#   network namespace nbhK, veth eth0, 10.77.0.(10+K)  -> host "nbhK", its own sshd on port 22
# There is no default route in the namespaces: hosts reach only each other and 10.77.0.1.

NBH_STATE=${NBH_STATE:-/var/lib/nbaccel-hosts}   # keys, ssh config, sshd configs and logs
NBH_BRIDGE=nbbr0
NBH_NET=10.77.0
NBH_KERNEL_ADDR=$NBH_NET.1
NBH_KERNEL_NAME=nbkernel
NBH_MARK_BEGIN="# >>> nbaccel-hosts (scripts/hosts/up) >>>"
NBH_MARK_END="# <<< nbaccel-hosts (scripts/hosts/up) <<<"

nbh_die() { echo "${0##*/}: $*" >&2; exit 1; }
nbh_need_root() { [ "$(id -u)" = 0 ] || nbh_die "needs root (network namespaces, sshd, /etc/hosts)"; }

# host_addr K -> 10.77.0.(10+K)
nbh_host_addr() { echo "$NBH_NET.$((10 + $1))"; }

# The lane's hosts as created by `up`: one "name address" line each (empty when down).
nbh_hosts_file() { echo "$NBH_STATE/hosts"; }

# Remove the lines between our markers from FILE, in place (keeps the inode: /etc/hosts may be
# a bind mount). Deletes FILE when nothing else is left and DELETE_EMPTY=1.
nbh_strip_block() {
  local file=$1 tmp
  [ -f "$file" ] || return 0
  tmp=$(mktemp)
  awk -v b="$NBH_MARK_BEGIN" -v e="$NBH_MARK_END" \
    '$0 == b { skip = 1; next } $0 == e { skip = 0; next } !skip' "$file" >"$tmp"
  cat "$tmp" >"$file"
  rm -f "$tmp"
  if [ "${DELETE_EMPTY:-0}" = 1 ] && ! grep -q '[^[:space:]]' "$file"; then rm -f "$file"; fi
}

# Install Debian packages that are missing. A temporary policy-rc.d stops their maintainer
# scripts from starting system daemons (a stray sshd on 0.0.0.0:22, a default slurmctld).
nbh_apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing: ${missing[*]}"
  local policy=/usr/sbin/policy-rc.d own_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && own_policy=1
  fi
  # DPkg::Lock::Timeout: wait for another apt (an unattended upgrade, a second lane) to finish.
  apt-get -o DPkg::Lock::Timeout=600 update -qq </dev/null
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}" </dev/null >/dev/null
  if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi
}

# Stop one lane host: kill every process in its network namespace (the host's PID 1 is among
# them, so its whole PID namespace goes too), then remove its veth and namespace.
nbh_host_down() {
  local name=$1 pids
  if [ -e "/run/netns/$name" ]; then
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      pids=$(ip netns pids "$name" 2>/dev/null || true)
      [ -z "$pids" ] && break
      # shellcheck disable=SC2086  # one pid per word
      kill -KILL $pids 2>/dev/null || true
      sleep 0.2
    done
    ip netns del "$name"
  fi
  ip link del "nbv${name#nbh}" 2>/dev/null || true
}

# The "slurm" lane (scripts/hosts/slurm-up, slurm-down): a one-node cluster in the root namespace.
NBS_STATE=${NBS_STATE:-/var/lib/nbaccel-slurm}   # slurmctld/slurmd state, pid and log files
NBS_CONF=/etc/slurm/slurm.conf                   # where srun/salloc/sinfo look by default
NBS_TAG="# nbaccel-slurm: written by scripts/hosts/slurm-up, removed by scripts/hosts/slurm-down"

# Is the process in pid file $1 alive?
nbh_pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Is a lane already up (perhaps someone else's)? The test scripts then use it and leave it up.
nbh_lane_up() {
  [ -s "$NBH_STATE/hosts" ] && [ -s "$NBH_STATE/ssh_config" ] &&
    ssh -F "$NBH_STATE/ssh_config" "$(head -n1 "$NBH_STATE/hosts" | cut -d' ' -f1)" true 2>/dev/null
}
nbs_lane_up() {
  [ -f "$NBS_CONF" ] && grep -qxF "$NBS_TAG" "$NBS_CONF" && nbh_pid_alive "$NBS_STATE/slurmctld.pid"
}
