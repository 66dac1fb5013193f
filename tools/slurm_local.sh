#!/usr/bin/env bash
# A real Slurm on this one host, for tests and for trying recipes/slurm/train.sbatch:
# Debian's slurmctld + two slurmd ("emulated nodes" n1, n2 on the same host) + munge.
#
#   tools/slurm_local.sh up      # install the Debian packages when missing (root), write the
#                                # config, start munged/slurmctld/slurmd n1,n2, wait until idle
#   eval "$(tools/slurm_local.sh env)"   # SLURM_CONF for sbatch/squeue/scontrol in this shell
#   tools/slurm_local.sh down    # stop exactly the daemons `up` started (by pid), nothing else
#   tools/slurm_local.sh status
#
# Invariants:
# - Everything lives under $EARL_SLURM_DIR (default /tmp/earl-slurm): slurm.conf, state, spool,
#   logs, pid files. No system file is edited; nodes reach each other at 127.0.0.1 (NodeAddr),
#   so node names need not resolve.
# - `down` stops only processes whose pids `up` recorded (pid files here); a munged that was
#   already running is used and left alone.
# - Ports: slurmctld $EARL_SLURM_PORT (default 16817), slurmd n1/n2 on the next two ports, so a
#   site Slurm on the default ports is not touched.
# Requires root (apt-get; Slurm's daemons run as root here: SlurmUser=root).
set -euo pipefail

DIR=${EARL_SLURM_DIR:-/tmp/earl-slurm}
PORT=${EARL_SLURM_PORT:-16817}
NODES=(n1 n2)
HOST=$(hostname -s)
CONF=$DIR/slurm.conf
MUNGE_PID=/run/munge/munged.pid

die() { echo "slurm_local: $*" >&2; exit 2; }

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    [[ $(id -u) == 0 ]] || die "slurmctld/slurmd/munge are not installed and installing them needs root: run as root or apt-get install slurmctld slurmd slurm-client munge"
    echo "slurm_local: installing slurmctld slurmd slurm-client munge (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge \
        >/dev/null
}

write_config() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    # one node line per emulated node: this host's CPUs and memory as slurmd -C reports them
    local cpus mem
    cpus=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -n 1)
    mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n 1)
    {
        echo "# written by tools/slurm_local.sh: one host, ${#NODES[@]} emulated nodes"
        echo "ClusterName=earl-local"
        echo "SlurmctldHost=$HOST(127.0.0.1)"
        echo "SlurmctldPort=$PORT"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "SchedulerType=sched/backfill"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "JobCompType=jobcomp/none"
        echo "MpiDefault=none"
        echo "ReturnToService=2"
        echo "JobRequeue=1"
        echo "MinJobAge=3600"          # finished jobs stay visible to scontrol for the tests
        echo "KillWait=30"
        echo "SlurmdTimeout=60"
        echo "SchedulerParameters=defer_batch=0"
        local i=1
        for n in "${NODES[@]}"; do
            echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + i))" \
                 "CPUs=$cpus RealMemory=$mem State=UNKNOWN"
            i=$((i + 1))
        done
        echo "PartitionName=cpu Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    } > "$CONF"
}

start_munge() {
    if alive "$MUNGE_PID"; then
        return  # someone's munged: use it, never stop it
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    [[ -f /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing: reinstall munge (apt-get install --reinstall munge) or create a key with mungekey"
    runuser -u munge -- munged
    cp "$MUNGE_PID" "$DIR/munged.pid"   # ours: `down` stops it
}

up() {
    install_packages
    if alive "$DIR/slurmctld.pid"; then
        echo "slurm_local: already up ($DIR)"; return
    fi
    write_config
    start_munge
    export SLURM_CONF=$CONF
    slurmctld -f "$CONF"
    for n in "${NODES[@]}"; do
        slurmd -f "$CONF" -N "$n"
    done
    # the nodes register within a few seconds; wait until both are idle
    local t=0
    until [[ $(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l) -ge ${#NODES[@]} ]]; do
        t=$((t + 1))
        if ((t > 60)); then
            sinfo -N >&2 || true
            die "nodes not idle after 60 s: see $DIR/log"
        fi
        sleep 1
    done
    echo "slurm_local: up: ${NODES[*]} idle; export SLURM_CONF=$CONF"
}

stop_pid_file() {  # TERM, then KILL after 10 s, the process a pid file names
    local f=$1 pid i
    [[ -f $f ]] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$f"
}

down() {
    for n in "${NODES[@]}"; do
        stop_pid_file "$DIR/slurmd-$n.pid"
    done
    stop_pid_file "$DIR/slurmctld.pid"
    stop_pid_file "$DIR/munged.pid"
    echo "slurm_local: down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    status)
        for f in "$DIR"/*.pid; do
            [[ -f $f ]] || continue
            if alive "$f"; then s=running; else s=dead; fi
            echo "$(basename "$f" .pid): pid $(cat "$f") $s"
        done
        [[ -f $CONF ]] && SLURM_CONF=$CONF sinfo -N 2>/dev/null || true ;;
    *) die "usage: tools/slurm_local.sh up|down|env|status (got '${1:-}')" ;;
esac
