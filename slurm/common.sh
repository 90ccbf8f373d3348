# slurm/common.sh: sourced by the sbatch files in slurm/. Starts the Horovod
# ranks with the launcher you choose and turns Slurm's warning signal into
# "checkpoint, then requeue":
#
#   source "$HVD_REPO/slurm/common.sh"
#   hvd_run scripts/train_cnn.py "$@"      # or any trainer: slurm/train.sbatch
#
# Settings, read from the environment (sbatch passes yours on):
#   LAUNCHER=srun        srun --mpi=pmix (default): Slurm starts every rank
#   LAUNCHER=mpirun      Open MPI's mpirun, which reads the allocation itself
#   LAUNCHER=horovodrun  horovodrun -H <hosts from scontrol show hostnames>
#   LAUNCHER=horovodrun-elastic
#                        elastic horovodrun: -np and --max-np $SLURM_NTASKS, --min-np
#                        $MIN_NP, hosts from `scripts/discover_hosts.py --slurm` (the
#                        job's nodes that Slurm considers usable now), and --elastic
#                        passed to the script. Submit with `sbatch --no-kill`: without
#                        it Slurm ends the whole job when one of its nodes fails
#   MIN_NP=N             the fewest ranks an elastic job goes on with (default: one
#                        node's tasks, SLURM_NTASKS_PER_NODE)
#   MIN_NODES=N          the fewest nodes a requeued run may start on (default: the
#                        nodes this run has; after a straggler, one fewer). Fewer nodes
#                        are taken only when no more are free; the ranks then resume the
#                        checkpoint on fewer ranks (exactly so with --global-batch)
#   LAUNCHER_ARGS="..."  extra launcher arguments, e.g. "--gloo" for horovodrun,
#                        "--blacklist-cooldown-range 60 600" for horovodrun-elastic
#   PYTHON=python        the ranks' interpreter (the activated venv's by default)
#
# Preemption: the sbatch files ask for `--signal=B:USR1@<seconds>`, so Slurm
# sends USR1 to this batch shell that long before the time limit (or send it
# yourself: scancel --signal=USR1 --batch JOBID). The trap below passes USR1 to
# the ranks; they finish their step, checkpoint and exit 0; then the job is
# requeued with `scontrol requeue` and the next run resumes from the checkpoint.
# The launcher runs in the background and the shell waits on it, because bash
# runs a trap only between commands: a foreground launcher would delay it
# until training ended.
#
# A straggler (--straggler-action checkpoint-exit): the ranks checkpoint and exit
# with status 5, rank 0 having written the slow rank's node to
# HVDTRAIN_STRAGGLER_FILE; the job is requeued with that node added to its
# excluded nodes (requeuehold, update ExcNodeList, release), so the next run
# resumes from the checkpoint on other nodes, or on the nodes left when no
# other is free.
#
# Node counts: the launch is sized from the allocation this run got
# (SLURM_TASKS_PER_NODE), so `sbatch --nodes=MIN-MAX --ntasks-per-node=R` runs
# R ranks on each of the nodes Slurm gives. Slurm pins a started job to the
# nodes it got: a requeued run of `--nodes=2-4` that had 4 waits for 4
# (measured, Slurm 22.05). A requeue from here therefore sets the range again,
# MIN_NODES up to the nodes this run had, and the tasks to MIN_NODES x R.
#
# SIGTERM (scancel, preemption, the time limit) makes the ranks checkpoint and
# exit 0 like USR1, and the trap passes it on like USR1 (without the requeue).
# But a plain `scancel` or the time limit signals every process of the job,
# not only this shell: with proctrack/linuxproc the batch step's whole process
# tree, deepest first, this shell last, then SIGKILL KillWait seconds later
# (measured on the test cluster). srun passes SIGTERM on and waits for its
# ranks; mpirun and horovodrun answer it by killing theirs (mpirun after
# odls_base_sigkill_timeout, 1 s; horovodrun --gloo after 5 s), often before
# the ranks reach their next stop check. Prefer srun, or USR1
# (`scancel --signal=USR1 --batch`), where the checkpoint matters.

hvd_log() { printf '[hvd %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
hvd_fail() { printf '%s: error: %s\n' "${SLURM_JOB_NAME:-${0##*/}}" "$*" >&2; exit 2; }

# This run's ranks: the sum of SLURM_TASKS_PER_NODE ("2(x3),1" is 7). Slurm keeps
# SLURM_NTASKS from the submission: a run requeued onto fewer nodes would
# otherwise start the first run's number of ranks on them (measured, Slurm 22.05).
hvd_allocated_tasks() {
    local part count times total=0 parts
    IFS=, read -r -a parts <<< "$SLURM_TASKS_PER_NODE"
    for part in "${parts[@]}"; do
        count=${part%%(*} times=1
        [[ "$part" == *"(x"* ]] && { times=${part#*(x}; times=${times%)}; }
        total=$(( total + count * times ))
    done
    echo "$total"
}

# The -H string for horovodrun: every node of the job with its task count.
hvd_horovodrun_hosts() {
    local nodes
    nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -) || return 1
    "$PYTHON" "$HVD_REPO/scripts/make_hostfile.py" --hosts "$nodes" \
        --tasks-per-node "${SLURM_TASKS_PER_NODE:-$SLURM_NTASKS_PER_NODE}" --format H
}

# Sets HVD_LAUNCH, the launcher command line (without the python command), and
# HVD_SCRIPT_ARGS, what the launcher needs the script to be told (before "$@").
hvd_launch_command() {
    HVD_SCRIPT_ARGS=()
    case "$LAUNCHER" in
        srun)
            # --kill-on-bad-exit: one failed rank ends the step instead of hanging it.
            HVD_LAUNCH=(srun --mpi=pmix --kill-on-bad-exit=1) ;;
        mpirun)
            # Open MPI takes nodes and slots from the allocation; no binding, so
            # each rank's OMP_NUM_THREADS threads can use its cores.
            HVD_LAUNCH=(mpirun -np "$SLURM_NTASKS" --bind-to none --map-by slot) ;;
        horovodrun)
            local hosts
            hosts=$(hvd_horovodrun_hosts) || hvd_fail "cannot build horovodrun's -H list"
            HVD_LAUNCH=(horovodrun -np "$SLURM_NTASKS" -H "$hosts") ;;
        horovodrun-elastic)
            # horovodrun runs the discovery command through a shell: quote its paths.
            local discover per_node
            discover="$(printf '%q %q' "$PYTHON" "$HVD_REPO/scripts/discover_hosts.py") --slurm"
            per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE%%[(,]*}}
            HVD_LAUNCH=(horovodrun -np "$SLURM_NTASKS" --min-np "${MIN_NP:-$per_node}"
                        --max-np "$SLURM_NTASKS" --host-discovery-script "$discover")
            HVD_SCRIPT_ARGS=(--elastic)
            # Discovery's memory (its last list, what it last said): a file of this launch's own.
            if [ -z "${HVD_DISCOVERY_STATE:-}" ]; then
                HVD_DISCOVERY_STATE=$(mktemp "${TMPDIR:-/tmp}/hvd-discover-$SLURM_JOB_ID.XXXXXX") ||
                    hvd_fail "cannot create a file in ${TMPDIR:-/tmp} for discover_hosts.py"
                export HVD_DISCOVERY_STATE HVD_DISCOVERY_STATE_OWNED=1
            fi ;;
        *)
            hvd_fail "LAUNCHER=$LAUNCHER: choose srun, mpirun, horovodrun or horovodrun-elastic" ;;
    esac
    local extra
    read -r -a extra <<< "${LAUNCHER_ARGS:-}"
    HVD_LAUNCH+=("${extra[@]}")
}

hvd_descendants() {
    local child
    for child in $(pgrep -P "$1"); do
        echo "$child"
        hvd_descendants "$child"
    done
}

# The training processes under the launcher on this node: python running the script.
hvd_local_rank_pids() {
    local pid argv
    for pid in $(hvd_descendants "$HVD_LAUNCHER_PID"); do
        mapfile -d '' -t argv 2>/dev/null < "/proc/$pid/cmdline" || continue
        [[ "${argv[0]##*/}" == python* && "${argv[1]:-}" == "$HVD_SCRIPT" ]] && echo "$pid"
    done
}

# Deliver a signal to the ranks. srun forwards USR1 and TERM to every rank, Open
# MPI's mpirun USR1 (TERM would make it end the job). horovodrun forwards neither
# (it would exit and kill the ranks). Otherwise signal the ranks on this node
# directly: StopRequest.should_stop() is an allreduce, so every rank on every
# node stops after the same step.
hvd_signal_ranks() {
    local signal=$1 pids tries
    if [ "$LAUNCHER" = srun ] || { [ "$LAUNCHER" = mpirun ] && [ "$signal" = USR1 ]; }; then
        kill -s "$signal" "$HVD_LAUNCHER_PID" 2>/dev/null
        return
    fi
    for tries in 1 2 3 4 5 6 7 8 9 10; do  # ranks may still be starting
        pids=$(hvd_local_rank_pids)
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086  # one pid per word
            kill -s "$signal" $pids 2>/dev/null
            return
        fi
        kill -0 "$HVD_LAUNCHER_PID" 2>/dev/null || return
        sleep 1
    done
    hvd_log "found no rank processes of $HVD_SCRIPT to signal"
}

hvd_on_usr1() {
    hvd_log "USR1: asking the ranks to checkpoint and stop; the job will be requeued"
    HVD_REQUEUE=1
    hvd_signal_ranks USR1
}

hvd_on_term() {
    # Cancelled, preempted or out of time (a preempted job is requeued by Slurm
    # itself). Pass it on: ranks that horovodrun started over ssh, or all of them
    # when only this shell was signalled (scancel --signal=TERM --batch), would
    # not get it otherwise.
    hvd_log "TERM: asking the ranks to checkpoint and stop"
    HVD_REQUEUE=0
    hvd_signal_ranks TERM
}

# Wait for the launcher. `wait` returns early when a trapped signal arrives,
# so keep waiting until the launcher has really exited.
hvd_wait_launcher() {
    local status
    while :; do
        wait "$HVD_LAUNCHER_PID"
        status=$?
        if [ "$status" -gt 128 ] && kill -0 "$HVD_LAUNCHER_PID" 2>/dev/null; then
            continue
        fi
        return "$status"
    done
}

# The fewest nodes a requeued run may start on: MIN_NODES, else this run's node
# count, one fewer when a straggler's node is left out ($1 = without-a-node).
hvd_requeue_min_nodes() {
    local nodes=${SLURM_JOB_NUM_NODES:-1}
    if [ -n "${MIN_NODES:-}" ]; then
        echo "$(( MIN_NODES < nodes ? MIN_NODES : nodes ))"
    elif [ "$1" = without-a-node ] && [ "$nodes" -gt 1 ]; then
        echo "$(( nodes - 1 ))"
    else
        echo "$nodes"
    fi
}

# Requeue this job; its next run resumes from the checkpoint. $1: a node to add
# to its excluded nodes (a straggler's), or empty. The job may then start on
# hvd_requeue_min_nodes up to the nodes it has now.
hvd_requeue() {
    local node=$1 nodes=${SLURM_JOB_NUM_NODES:-1} min_nodes update=() excluded where=""
    min_nodes=$(hvd_requeue_min_nodes "${node:+without-a-node}")
    if [ -n "$node" ]; then
        excluded=$(scontrol show job "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
        [ "$excluded" = "(null)" ] && excluded=""
        update+=(ExcNodeList="${excluded:+$excluded,}$node")
        where=" without node $node (a straggler)"
    fi
    if [ "$min_nodes" -lt "$nodes" ] && [ -z "${SLURM_NTASKS_PER_NODE:-}" ]; then
        hvd_log "the requeued job keeps its $nodes nodes: submit with --ntasks-per-node to let it start on fewer"
    elif [ "$min_nodes" -lt "$nodes" ]; then
        update+=(NumNodes="$min_nodes-$nodes" NumTasks=$(( min_nodes * SLURM_NTASKS_PER_NODE )))
        where+=" on $min_nodes to $nodes nodes"
    fi
    hvd_log "requeueing job $SLURM_JOB_ID$where; its next run resumes from the checkpoint"
    if [ "${#update[@]}" -eq 0 ]; then
        scontrol requeue "$SLURM_JOB_ID" && return
        hvd_log "scontrol requeue failed: submit the same command again to resume"
        exit 1
    fi
    # Held while it changes: released, it may start at once.
    # requeuehold ends this very script (SIGTERM now, SIGKILL after KillWait), so
    # TERM is ignored from here on, by the shell and by the scontrol it starts
    # (an ignored signal stays ignored across exec): update and release finish
    # in that grace even when the controller answers slowly.
    trap '' TERM
    scontrol requeuehold "$SLURM_JOB_ID" &&
        scontrol update JobId="$SLURM_JOB_ID" "${update[@]}" &&
        scontrol release "$SLURM_JOB_ID" && return
    hvd_log "requeue failed: submit the same command again${node:+ with --exclude=$node} to resume"
    exit 1
}

# hvd_run SCRIPT [ARGS...]: run SCRIPT on every rank of the job, requeue on USR1.
# SCRIPT: an absolute path, a path in the repository (scripts/train_cnn.py), or a
# path relative to the submit directory (a trainer of your own, anywhere).
hvd_run() {
    # By absolute path: the job runs in the submit directory, where relative
    # paths in the script's arguments (--output-dir runs/x) mean what you typed.
    [ -n "${1:-}" ] || hvd_fail "no script to run: give the trainer's path first"
    case $1 in
        /*) HVD_SCRIPT=$1 ;;
        *) if [ -f "$HVD_REPO/$1" ]; then HVD_SCRIPT=$HVD_REPO/$1; else HVD_SCRIPT=$PWD/$1; fi ;;
    esac
    shift
    [ -n "${SLURM_JOB_ID:-}" ] || hvd_fail "not inside a Slurm job: submit this file with sbatch"
    [ -f "$HVD_SCRIPT" ] || hvd_fail "$HVD_SCRIPT not found: give the trainer's path from where you submit, or set HVD_REPO to the repository"
    [[ -z "${MIN_NODES:-}" || "$MIN_NODES" =~ ^[1-9][0-9]*$ ]] ||
        hvd_fail "MIN_NODES=$MIN_NODES: give the fewest nodes a requeued run may start on, a number from 1"
    LAUNCHER=${LAUNCHER:-srun}
    PYTHON=${PYTHON:-python}
    # One thread per core of each rank; srun (since Slurm 22.05) no longer
    # inherits --cpus-per-task from the job, so hand it on explicitly.
    export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
    # srun reads the rank count from SLURM_NTASKS; the others are given it below.
    if [ -n "${SLURM_TASKS_PER_NODE:-}" ]; then
        SLURM_NTASKS=$(hvd_allocated_tasks)
        export SLURM_NTASKS SLURM_NPROCS=$SLURM_NTASKS
    fi
    [ -n "${SLURM_CPUS_PER_TASK:-}" ] && export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
    hvd_launch_command

    hvd_log "job $SLURM_JOB_ID ($SLURM_JOB_NAME) restart count ${SLURM_RESTART_COUNT:-0}:" \
        "${SLURM_JOB_NUM_NODES:-1} node(s) ${SLURM_JOB_NODELIST}, ${SLURM_NTASKS} ranks," \
        "${OMP_NUM_THREADS} thread(s) each, GPUs ${CUDA_VISIBLE_DEVICES:-none}, launcher $LAUNCHER"
    HVD_REQUEUE=0
    # Where rank 0 names a straggler's node (on the shared filesystem, like --output-dir).
    # Named by cluster and job: clusters that share a home directory number their jobs alike
    # (the suite's two clusters did, and one requeued the other's job without its straggler).
    export HVDTRAIN_STRAGGLER_FILE=${HVDTRAIN_STRAGGLER_FILE:-${SLURM_SUBMIT_DIR:-$PWD}/.hvd-straggler-${SLURM_CLUSTER_NAME:-slurm}-$SLURM_JOB_ID}
    rm -f "$HVDTRAIN_STRAGGLER_FILE"
    trap hvd_on_usr1 USR1
    trap hvd_on_term TERM
    hvd_log "+ ${HVD_LAUNCH[*]} $PYTHON $HVD_SCRIPT ${HVD_SCRIPT_ARGS[*]:+${HVD_SCRIPT_ARGS[*]} }$*"
    "${HVD_LAUNCH[@]}" "$PYTHON" "$HVD_SCRIPT" "${HVD_SCRIPT_ARGS[@]}" "$@" &
    HVD_LAUNCHER_PID=$!
    hvd_wait_launcher
    local status=$?
    trap - USR1 TERM
    hvd_log "launcher exited with status $status"
    [ "${HVD_DISCOVERY_STATE_OWNED:-}" = 1 ] && rm -f "$HVD_DISCOVERY_STATE"

    # Any status: rank 0 exits 5, but the launcher may report its own (srun 137 after
    # --kill-on-bad-exit, horovodrun 1); rank 0 writes the file after the checkpoint.
    if [ -s "$HVDTRAIN_STRAGGLER_FILE" ]; then
        local straggler
        straggler=$(head -n 1 "$HVDTRAIN_STRAGGLER_FILE")
        rm -f "$HVDTRAIN_STRAGGLER_FILE"
        hvd_requeue "$straggler"
        exit 0
    fi
    [ "$HVD_REQUEUE" = 1 ] && [ "$status" -eq 0 ] && hvd_requeue ""
    exit "$status"
}
