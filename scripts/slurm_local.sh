#!/usr/bin/env bash
# A real Slurm cluster on this one machine, to run slurm/*.sbatch unchanged (tests/e2e/test_preemption.py):
# NODES fake nodes (slurmd each) on 127.0.0.1 with 8 fake GPUs apiece, a controller and munge, all
# under $BASE, no systemd. Needs root. Debian's slurm-wlm is installed when missing. Idempotent.
#   bash scripts/slurm_local.sh install  # only the packages (.ci/run)
#   bash scripts/slurm_local.sh start    # prints SLURM_CONF=<file> once every node is idle
#   bash scripts/slurm_local.sh stop
# Then `export SLURM_CONF=<file>` for sbatch/squeue/scontrol. Facts behind the settings (measured on
# this workplace's machines): ../shared/notes/slurm-local.md.
set -euo pipefail
BASE=${ALIGNER_SLURM_BASE:-/tmp/aligner-slurm}
NODES=${ALIGNER_SLURM_NODES:-2}
CONF=$BASE/slurm.conf
HOSTS_TAG="# aligner-slurm-local"

die() { echo "slurm_local: $*" >&2; exit 1; }

stop() {
  if [ -f "$CONF" ]; then
    SLURM_CONF=$CONF timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
    SLURM_CONF=$CONF timeout 10 scontrol shutdown >/dev/null 2>&1 || true
  fi
  for pid_file in "$BASE"/run/*.pid; do
    [ -f "$pid_file" ] || continue
    pid=$(cat "$pid_file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pid_file"
  done
  sed -i "/$HOSTS_TAG\$/d" /etc/hosts 2>/dev/null || true
}

running() {  # every daemon alive and every node idle
  for pid_file in "$BASE/run/munged.pid" "$BASE/run/slurmctld.pid"; do
    [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null || return 1
  done
  idle=$(SLURM_CONF=$CONF timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l) || return 1
  [ "$idle" -eq "$NODES" ]
}

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
  # the packages' scripts would start the system's own munge/slurm daemons: forbid that while installing
  local own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && own_policy=1
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm >/dev/null
  [ "$own_policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
}

write_config() {
  local host; host=$(hostname -s)
  mkdir -p "$BASE"/{run,log,state,spool,munge,dev}
  chmod 755 "$BASE"
  # Fake GPUs: Slurm binds gres files only if they are character devices (these read as /dev/null).
  for i in $(seq 0 7); do
    [ -e "$BASE/dev/gpu$i" ] || mknod -m 666 "$BASE/dev/gpu$i" c 1 3
  done
  cat > "$CONF" <<EOF
ClusterName=aligner-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$BASE/munge/socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
# the fake nodes declare more CPUs than the machine has
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# the main scheduler and backfill every second: a requeued job starts ~11 s (cred_expire + 1) later
SchedulerParameters=bf_interval=1,sched_interval=1
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=600
GresTypes=gpu
NodeName=node[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[16818-$((16817 + NODES))] CPUs=64 RealMemory=512000 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  echo "NodeName=node[1-$NODES] Name=gpu File=$BASE/dev/gpu[0-7]" > "$BASE/gres.conf"
  # node names resolve for MASTER_ADDR=$(scontrol show hostnames ... | head -n1)
  sed -i "/$HOSTS_TAG\$/d" /etc/hosts
  echo "127.0.0.1 $(seq -f 'node%g' -s ' ' 1 "$NODES") $HOSTS_TAG" >> /etc/hosts
}

start() {
  [ "$(id -u)" = 0 ] || die "needs root (daemons, /etc/hosts)"
  if running; then echo "SLURM_CONF=$CONF"; return; fi
  install
  stop
  # a fresh cluster: a controller killed with its machine (no `stop`) left jobs in its state, which it would
  # recover as running on the nodes (state "mix", never idle)
  rm -rf "$BASE/state" "$BASE/spool"
  write_config
  # munge: our own key and socket; munged runs as the munge user and wants a 0755 socket directory
  [ -f "$BASE/munge/munge.key" ] || dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none
  chown -R munge: "$BASE/munge" && chmod 755 "$BASE/munge" && chmod 400 "$BASE/munge/munge.key"
  runuser -u munge -- munged --socket="$BASE/munge/socket" --key-file="$BASE/munge/munge.key" \
    --pid-file="$BASE/munge/munged.pid" --log-file="$BASE/munge/munged.log" --seed-file="$BASE/munge/seed" \
    </dev/null >>"$BASE/log/munged.out" 2>&1 || die "munged did not start: $(tail -3 "$BASE/munge/munged.log")"
  cp "$BASE/munge/munged.pid" "$BASE/run/munged.pid"  # munged (user munge) cannot write root's run/; stop reads it there
  slurmctld -f "$CONF" </dev/null >>"$BASE/log/slurmctld.out" 2>&1
  for i in $(seq 1 "$NODES"); do
    slurmd -f "$CONF" -N "node$i" </dev/null >>"$BASE/log/slurmd.out" 2>&1
  done
  for _ in $(seq 150); do
    if running; then echo "SLURM_CONF=$CONF"; return; fi
    sleep 0.2
  done
  SLURM_CONF=$CONF sinfo -N >&2 || true
  tail -5 "$BASE/log/slurmctld.log" >&2 || true
  die "nodes not idle after 30 s (logs in $BASE/log)"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) die "usage: $0 install|start|stop" ;;
esac
