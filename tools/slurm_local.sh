#!/usr/bin/env bash
# A real Slurm on this one host, for tests and for trying recipes/slurm/train.sbatch:
# Debian's slurmctld + two slurmd ("emulated nodes" n1, n2 on the same host) + munge.
#
#   eval "$(tools/slurm_local.sh up)"   # install the Debian packages when missing (root),
#                        # write the config, start munged/slurmctld/slurmd n1,n2, wait until
#                        # idle; prints EARL_SLURM_DIR and SLURM_CONF exports (progress: stderr)
#   eval "$(tools/slurm_local.sh env)"   # the same exports again, in another shell
#   tools/slurm_local.sh down    # stop exactly the daemons `up` started (by pid), nothing else
#   tools/slurm_local.sh status
#
# Invariants:
# - Everything lives in one private directory: a fresh `mktemp -d` (0700, owned by the caller)
#   unless $EARL_SLURM_DIR names one, which must then be owned by the caller and writable by
#   nobody else (created 0700 when missing). It holds slurm.conf, state, spool, logs and pid
#   files: a fixed, shared /tmp path would let another user plant pid files or a config there.
#   `up` records the directory in ~/.cache/earl-slurm/current (0700) so that `down`, `env` and
#   `status` find it without $EARL_SLURM_DIR. No system file is edited; nodes reach each other
#   at 127.0.0.1 (NodeAddr), so node names need not resolve.
# - `down` stops only processes whose pids `up` recorded (pid files there) AND that still are
#   the daemon `up` started (/proc/<pid>/comm is slurmctld/slurmd/munged, and the slurm daemons'
#   command line names this directory's slurm.conf): a recycled pid is left alone. A munged that
#   was already running is used and left alone.
# - Ports: slurmctld $EARL_SLURM_PORT (default 16817), slurmd n1/n2 on the next two ports, so a
#   site Slurm on the default ports is not touched.
# Requires root (apt-get; Slurm's daemons run as root here: SlurmUser=root).
set -euo pipefail

PORT=${EARL_SLURM_PORT:-16817}
NODES=(n1 n2)
HOST=$(hostname -s)
MUNGE_PID=/run/munge/munged.pid
RECORD_DIR=${HOME:-/root}/.cache/earl-slurm
RECORD=$RECORD_DIR/current

die() { echo "slurm_local: $*" >&2; exit 2; }
say() { echo "slurm_local: $*" >&2; }

# DIR: $EARL_SLURM_DIR, else the directory the last `up` recorded (empty when none)
DIR=${EARL_SLURM_DIR:-}
if [[ -z $DIR && -f $RECORD ]]; then
    DIR=$(cat "$RECORD")
fi
CONF=${DIR:+$DIR/slurm.conf}

private_dir() {  # create or check DIR: owned by us, 0700-like (nobody else may write)
    if [[ -z $DIR ]]; then
        DIR=$(mktemp -d "${TMPDIR:-/tmp}/earl-slurm.XXXXXX")
    elif [[ ! -e $DIR ]]; then
        mkdir -p -m 0700 "$DIR"
    fi
    [[ -d $DIR && ! -L $DIR ]] || die "EARL_SLURM_DIR=$DIR is not a directory"
    [[ $(stat -c %u "$DIR") == $(id -u) ]] \
        || die "EARL_SLURM_DIR=$DIR is owned by uid $(stat -c %u "$DIR"), not $(id -u): use a directory of your own (or unset it: a private one is made)"
    (( (8#$(stat -c %a "$DIR") & 8#022) == 0 )) \
        || die "EARL_SLURM_DIR=$DIR is writable by others (mode $(stat -c %a "$DIR")): chmod 0700 it"
    chmod 0700 "$DIR"
    CONF=$DIR/slurm.conf
    mkdir -p -m 0700 "$RECORD_DIR"
    echo "$DIR" > "$RECORD"
}

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# ours PIDFILE NAME [NEEDLE]: the pid file names a live process called NAME whose command line
# contains NEEDLE (this directory's slurm.conf for the Slurm daemons)
ours() {
    local f=$1 name=$2 needle=${3:-} pid
    [[ -f $f ]] || return 1
    pid=$(cat "$f")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    [[ -z $needle ]] || tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$needle"
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    [[ $(id -u) == 0 ]] || die "slurmctld/slurmd/munge are not installed and installing them needs root: run as root or apt-get install slurmctld slurmd slurm-client munge"
    say "installing slurmctld slurmd slurm-client munge (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
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
        # a loaded host (CI beside training jobs, load average 50) answers slowly: Slurm's 10 s
        # message and 2 s connect defaults made `scontrol show job` fail with "slurm_load_jobs
        # error: Socket timed out"; a node is marked down only after 5 minutes of silence, and
        # a step is unkillable only after 5 x MessageTimeout (Slurm's own floor)
        echo "MessageTimeout=60"
        echo "TCPTimeout=15"
        echo "SlurmdTimeout=300"
        echo "SlurmctldTimeout=300"
        echo "BatchStartTimeout=120"
        echo "UnkillableStepTimeout=300"
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

exports() {
    printf 'export EARL_SLURM_DIR=%q SLURM_CONF=%q\n' "$DIR" "$CONF"
}

up() {
    if [[ -n $DIR ]] && ours "$DIR/slurmctld.pid" slurmctld "$DIR/slurm.conf"; then
        say "already up ($DIR)"; exports; return
    fi
    [[ -n ${EARL_SLURM_DIR:-} ]] || DIR=""   # not up: a fresh private directory, not the last one
    private_dir
    install_packages
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
    say "up: ${NODES[*]} idle in $DIR"
    exports
}

# stop_pid_file PIDFILE NAME [NEEDLE]: TERM, then KILL after 10 s, the process the pid file
# names, only if it still is ours (see `ours`); the pid file goes either way
stop_pid_file() {
    local f=$1 pid i
    [[ -f $f ]] || return 0
    pid=$(cat "$f")
    if ours "$@"; then
        kill -TERM "$pid"
        for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null && ours "$@"; then kill -KILL "$pid"; fi
    elif kill -0 "$pid" 2>/dev/null; then
        say "$f names pid $pid, which is not the $2 started here: left alone"
    fi
    rm -f "$f"
}

down() {
    [[ -n $DIR && -d $DIR ]] || { say "nothing to stop (no EARL_SLURM_DIR, no recorded directory)"; return 0; }
    for n in "${NODES[@]}"; do
        stop_pid_file "$DIR/slurmd-$n.pid" slurmd "$DIR/slurm.conf"
    done
    stop_pid_file "$DIR/slurmctld.pid" slurmctld "$DIR/slurm.conf"
    stop_pid_file "$DIR/munged.pid" munged
    if [[ -f $RECORD && $(cat "$RECORD") == "$DIR" ]]; then
        rm -f "$RECORD"
    fi
    say "down ($DIR kept: logs in $DIR/log)"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    env) [[ -n $DIR ]] || die "no Slurm directory: run 'eval \"\$(tools/slurm_local.sh up)\"' first"
         exports ;;
    status)
        [[ -n $DIR ]] || die "no Slurm directory recorded: not up"
        for f in "$DIR"/*.pid; do
            [[ -f $f ]] || continue
            if alive "$f"; then s=running; else s=dead; fi
            echo "$(basename "$f" .pid): pid $(cat "$f") $s"
        done
        [[ -f $CONF ]] && SLURM_CONF=$CONF sinfo -N 2>/dev/null || true ;;
    *) die "usage: tools/slurm_local.sh up|down|env|status (got '${1:-}')" ;;
esac
