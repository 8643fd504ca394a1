# shellcheck shell=bash
# Sourced by launch/ray_on_slurm.sh and launch/torchrun.sh (with REPO_DIR set): the configuration read from
# the environment, the plan check before anything starts, and running the driver so that SLURM's
# time-limit signal ends in a checkpoint and a requeue. Environment it reads (all optional):
#   MODEL_PATH        -> actor_rollout_ref.model.path
#   DATA_DIR          -> data.train_files=[$DATA_DIR/train.parquet] data.val_files=[$DATA_DIR/val.parquet]
#                        (what `python -m megatron_rl.data.tasks` writes; test.parquet, verl's name, when there
#                        is no val.parquet)
#   OUTPUT_DIR        -> trainer.default_local_dir; in a SLURM job the default is
#                        <submit dir>/outputs/<job name>-<job id>: the same after a requeue, so it resumes
#   EXTRA_OVERRIDES   more Hydra overrides, space-separated, after the arguments
#   NNODES            nodes; in a SLURM job it must equal the allocation (choose that with sbatch --nodes)
#   GPUS_PER_NODE     default: the job's --gpus-per-node (else nvidia-smi's count); 0 = CPU, no GPU flags
#   PYTHON            interpreter with megatron_rl installed (default: the checkout's .venv/bin/python, else
#                     python3 on PATH); checked to import megatron_rl before anything starts. On GPU nodes, the
#                     venv of the rollout engine's environment: scripts/install_gpu.sh sglang|vllm (one each)
#   REQUEUE_GRACE_S   seconds the driver gets to checkpoint after SIGUSR1 before SIGTERM (default 240)
#   MRL_HEAD_IFACE    network interface whose IPv4 address is the head's (Ray head, torchrun rendezvous), e.g.
#                     ib0; default: the address SLURM has for the job's first node (its NodeAddr, resolved)
#   NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME
#                     when set, passed explicitly to every node's Ray / torchrun process (so to every rank)
#   DRY_RUN=1         check the plan, print what would start, start nothing

# shellcheck disable=SC2034 # RUN, GPU_FLAGS and overrides are read by the scripts that source this file

LAUNCH_NAME=$(basename "$0" .sh)
die() { echo "$LAUNCH_NAME: error: $*" >&2; exit 1; }
log() { echo "$LAUNCH_NAME: [$(date +%T)] $*"; }
quoted() { printf '%q ' "$@"; }

# head_address: the IPv4 address the other nodes reach the job's first node at. `hostname -I` lists the
# addresses in no useful order and on a multi-NIC node its first may be one the other nodes cannot reach.
# MRL_HEAD_IFACE names the interface (its address on this node, the batch script's: the job's first);
# otherwise SLURM's own address for the first node of SLURM_JOB_NODELIST (NodeAddr, resolved when a name).
head_address() {
    local addr node node_addr
    if [[ -n ${MRL_HEAD_IFACE:-} ]]; then
        addr=$(ip -4 -o addr show dev "$MRL_HEAD_IFACE" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
        [[ -n $addr ]] || die "MRL_HEAD_IFACE=$MRL_HEAD_IFACE: no IPv4 address on that interface here ($(hostname -s)); see \`ip -4 -o addr\`"
        echo "$addr"
        return
    fi
    [[ -n ${SLURM_JOB_NODELIST:-} ]] || die "no head address: set MRL_HEAD_IFACE (an interface) or the address itself"
    node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n1)
    [[ -n $node ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no node; set MRL_HEAD_IFACE or the address"
    node_addr=$(scontrol show node "$node" -o 2>/dev/null | tr ' ' '\n' | awk -F= '$1 == "NodeAddr" {print $2; exit}')
    node_addr=${node_addr:-$node}
    if [[ $node_addr =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
        addr=$node_addr
    else
        addr=$(getent ahostsv4 "$node_addr" 2>/dev/null | awk '{print $1; exit}')
    fi
    [[ -n $addr ]] || die "cannot resolve the head node $node (NodeAddr $node_addr) to an IPv4 address; set MRL_HEAD_IFACE or the address"
    if [[ $addr == 127.* ]] && ((NNODES > 1)); then
        die "the head node $node resolves to the loopback address $addr, which the other nodes cannot reach; set MRL_HEAD_IFACE (e.g. the interface of \`ip -4 -o addr\`) or the address"
    fi
    echo "$addr"
}

# socket_env: `env NAME=VALUE ...` for the NCCL/Gloo socket-interface settings that are set, to put in front
# of each node's command (every rank inherits them whatever srun's --export says); nothing when none is set.
socket_env() {
    local name pairs=()
    for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
        [[ -n ${!name:-} ]] && pairs+=("$name=${!name}")
    done
    ((${#pairs[@]} == 0)) || printf '%s\n' env "${pairs[@]}"
}

OWNED_PIDS=()  # background steps this script started; ended by pid on exit
DRIVER_PID="" WATCHDOG_PID="" DRIVER_RC=0 REQUEUE=0

# launch_init OVERRIDES...: read the environment and fill `overrides` (the arguments, what the environment
# asks for, EXTRA_OVERRIDES, then the node count the launcher owns) and `GPU_FLAGS` (for srun).
launch_init() {
    (($# > 0)) || die "no Hydra overrides given; pass at least +experiment=NAME"
    if [[ -z ${PYTHON:-} ]]; then
        PYTHON=python3
        [[ -x $REPO_DIR/.venv/bin/python ]] && PYTHON=$REPO_DIR/.venv/bin/python
    fi
    REQUEUE_GRACE_S=${REQUEUE_GRACE_S:-240}
    RUN=${SLURM_RESTART_COUNT:-0}
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        NNODES=${NNODES:-$SLURM_JOB_NUM_NODES}
        [[ $NNODES == "$SLURM_JOB_NUM_NODES" ]] \
            || die "NNODES=$NNODES but the job has $SLURM_JOB_NUM_NODES nodes; choose the node count with sbatch --nodes=$NNODES"
        local job_gpus=${SLURM_GPUS_PER_NODE:-0}
        GPUS_PER_NODE=${GPUS_PER_NODE:-${job_gpus##*:}}  # --gpus-per-node=h100:8 -> 8
        OUTPUT_DIR=${OUTPUT_DIR:-$SLURM_SUBMIT_DIR/outputs/${SLURM_JOB_NAME%.sh}-$SLURM_JOB_ID}
    else
        NNODES=${NNODES:-1}
        GPUS_PER_NODE=${GPUS_PER_NODE:-$( (nvidia-smi --list-gpus 2>/dev/null || true) | wc -l)}
    fi
    [[ $GPUS_PER_NODE =~ ^[0-9]+$ ]] || die "GPUS_PER_NODE=$GPUS_PER_NODE is not a number of GPUs"
    # Processes started on other nodes inherit this environment: the checkout is importable everywhere.
    export PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}

    check_python
    overrides=("$@")
    # Resume after a requeue unless the user chose otherwise (their trainer.resume_mode is kept).
    [[ " $* " == *" trainer.resume_mode="* ]] || overrides+=("trainer.resume_mode=auto")
    [[ -n ${OUTPUT_DIR:-} ]] && overrides+=("trainer.default_local_dir=$OUTPUT_DIR")
    [[ -n ${MODEL_PATH:-} ]] && overrides+=("actor_rollout_ref.model.path=$MODEL_PATH")
    if [[ -n ${DATA_DIR:-} ]]; then
        local val=$DATA_DIR/val.parquet
        [[ -f $val || ! -f $DATA_DIR/test.parquet ]] || val=$DATA_DIR/test.parquet
        overrides+=("data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$val]")
    fi
    local extra=()
    read -ra extra <<<"${EXTRA_OVERRIDES:-}"
    overrides+=("${extra[@]}" "trainer.nnodes=$NNODES")
    GPU_FLAGS=()
    ((GPUS_PER_NODE > 0)) && GPU_FLAGS=("--gpus-per-node=$GPUS_PER_NODE")
    trap stop_owned EXIT
    trap on_time_limit USR1
    trap 'log "SIGTERM: stopping"; exit 143' TERM
}

# check_python: the interpreter can import megatron_rl (else its own error, and what is needed).
check_python() {
    local err
    command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON is not an executable; set PYTHON to the interpreter megatron-rl is installed in (e.g. $REPO_DIR/.venv/bin/python)"
    err=$("$PYTHON" -c "import megatron_rl.config" 2>&1) \
        || die "PYTHON=$PYTHON cannot import megatron_rl: $(tail -n 3 <<<"$err"); set PYTHON to the interpreter megatron-rl is installed in (e.g. $REPO_DIR/.venv/bin/python)"
}

# check_plan: resolve the config and reject a layout that does not factor or fit, before anything starts.
# A plan that could not even be computed (an import error, a crash) is reported as that, not as a rejection.
check_plan() {
    local errfile rc=0
    errfile=$(mktemp)
    "$PYTHON" -m megatron_rl.plan "${overrides[@]}" 2>"$errfile" || rc=$?
    cat "$errfile" >&2
    if ((rc != 0)); then
        if grep -q "rejected:" "$errfile"; then
            rm -f "$errfile"
            die "the plan was rejected (above); nothing was started"
        fi
        rm -f "$errfile"
        die "the plan check failed with status $rc (its error is above; this is not a verdict on the plan); nothing was started"
    fi
    rm -f "$errfile"
}

# exit_if_dry_run LINE...: with DRY_RUN=1, print what would start and stop here.
exit_if_dry_run() {
    [[ ${DRY_RUN:-0} == 1 ]] || return 0
    local line
    for line in "$@"; do log "DRY_RUN: $line"; done
    exit 0
}

own_pid() { OWNED_PIDS+=("$1"); }

# shellcheck disable=SC2317 # run by the EXIT trap
stop_owned() {  # TERM what this script started (by pid), KILL what still runs 30 s later
    local pid alive=""
    for pid in $WATCHDOG_PID $DRIVER_PID "${OWNED_PIDS[@]}"; do
        kill -0 "$pid" 2>/dev/null && alive+=" $pid" && { kill -TERM "$pid" 2>/dev/null || true; }
    done
    [[ -n $alive ]] && log "stopping the processes this script started:$alive (srun reports a stopped step as killed)"
    for _ in $(seq 30); do
        alive=""
        for pid in $DRIVER_PID "${OWNED_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=" $pid"; done
        [[ -z $alive ]] && break
        sleep 1
    done
    if [[ -n $alive ]]; then
        log "killing pids$alive, still running 30 s after SIGTERM"
        for pid in $alive; do kill -KILL "$pid" 2>/dev/null || true; done
    fi
    OWNED_PIDS=() DRIVER_PID="" WATCHDOG_PID=""
}

# shellcheck disable=SC2317 # run by the USR1 trap
on_time_limit() {  # sbatch --signal=B:USR1@300: the time limit is 5 minutes away
    REQUEUE=1
    if [[ -z $DRIVER_PID ]]; then
        log "SIGUSR1: the time limit is near and training has not started; stopping"
        finish
    fi
    log "SIGUSR1: the time limit is near; asking the driver to checkpoint and stop (grace ${REQUEUE_GRACE_S} s)"
    kill -USR1 "$DRIVER_PID" 2>/dev/null || true
    (sleep "$REQUEUE_GRACE_S" && kill -TERM "$DRIVER_PID" 2>/dev/null) &
    WATCHDOG_PID=$!
}

# run_driver CMD...: run the driver, forwarding signals, until it exits; its status is in DRIVER_RC.
run_driver() {
    log "driver: $(quoted "$@")"
    "$@" &
    DRIVER_PID=$!
    while :; do
        wait "$DRIVER_PID" && DRIVER_RC=0 || DRIVER_RC=$?
        kill -0 "$DRIVER_PID" 2>/dev/null || break  # else a trapped signal interrupted `wait`: keep waiting
    done
    DRIVER_PID=""
    case $DRIVER_RC in
        0) log "driver exited with status 0: finished" ;;
        75) log "driver exited with status 75: stopped by a signal, resumable (re-run the same command)" ;;
        130) log "driver exited with status 130: a second stop signal ended it at once, the current step unsaved; re-run to resume from the newest checkpoint" ;;
        2) log "driver exited with status 2: the configuration or its files were rejected; nothing was started" ;;
        *) log "driver exited with status $DRIVER_RC: failed (the error is above and in the run's train.log)" ;;
    esac
}

# finish: stop what this script started; requeue the SLURM job when the time limit asked for it.
finish() {
    stop_owned
    if ((REQUEUE)) && [[ -n ${SLURM_JOB_ID:-} ]]; then
        log "requeueing job $SLURM_JOB_ID; the next run resumes from ${OUTPUT_DIR}"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit "$DRIVER_RC"
}
