# shellcheck shell=bash disable=SC2034  # the options set here are read by the sourcing script
# Shared by launch/tpu_vm.sh and launch/multislice.sh (sourced, not run): options, dry-run
# printing, the host count of an accelerator type, the wait for a queued resource, and the
# commands that run on the workers. The sourcing script defines usage() and MULTISLICE (0 or 1).

LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname "$LAUNCH_DIR")
PROG=$(basename "$0")
# TPU wheels: `jax[tpu]` pulls libtpu; JAX's install guide gives this page as --find-links.
LIBTPU_FIND_LINKS=https://storage.googleapis.com/jax-releases/libtpu_releases.html

# The options every launch script takes, for its usage (after its own --name, --type, ...).
common_options_usage() {
    cat <<'EOF'
  --runtime VERSION  TPU software version [RUNTIME_VERSION], default v2-alpha-tpuv5-lite
  --spot             create: Spot capacity [SPOT=1]
  --best-effort      create: best-effort capacity (a gcloud alpha flag)
  --async            delete: return before the deletion completes
  --env NAME=VALUE   run: extra environment for podrun on every worker (repeatable)
  --python PYTHON    setup: the workers' Python (3.11 or newer; installed with apt when missing)
                     [PODRUN_PYTHON], default python3.11
  --dest DIR         logs: local folder [LOG_DIR], default out/logs/NAME in the repository
  --hosts N          workers per slice, for a type the built-in table lacks [HOSTS_PER_SLICE]
  --dry-run          print the commands, one a line, instead of running them [DRY_RUN=1]
  -h, --help         print this message
create and wait check the state WAIT_TRIES times (default 120), WAIT_SECONDS apart (default 30).
RUN_ID names a run's log files (default: the UTC time, e.g. 20250101-120000).
EOF
}

usage_error() { printf '%s: error: %s (see %s -h)\n' "$PROG" "$*" "$PROG" >&2; exit 2; }
fail() { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 1; }
note() { printf '%s: %s\n' "$PROG" "$*" >&2; }

# One command as one line of words quoted with printf %q: pasted into bash, the line runs exactly
# these arguments.
quote_words() {
    local line
    line=$(printf '%q ' "$@")
    printf '%s' "${line% }"
}

# Run a command, or in a dry run print it (stdout carries the commands and nothing else).
cmd() {
    if [[ $DRY_RUN == 1 ]]; then
        printf '%s\n' "$(quote_words "$@")"
    else
        "$@"
    fi
}

need_gcloud() {
    [[ $DRY_RUN == 1 ]] && return 0
    command -v gcloud >/dev/null 2>&1 || fail "gcloud not found on PATH: install the Google Cloud" \
        "CLI (https://cloud.google.com/sdk/docs/install), or add --dry-run to print the commands instead"
}

# TPU VM workers (the hosts that --worker=0..N-1 index) in one slice of an accelerator type.
# The number in the type counts chips for v5e (v5litepod-N) and v6e, TensorCores (2 a chip) for
# v2, v3, v4 and v5p.
#   v5e, v6e: a slice of up to 8 chips is one VM (of 1, 4 or 8 chips); larger slices are VMs of
#             4 chips: v5litepod-8 -> 1, v5litepod-16 -> 4, v5litepod-256 -> 64.
#   v2, v3, v4, v5p: 4 chips (8 TensorCores) a VM: v4-8 -> 1, v4-32 -> 4.
# Sources: the Cloud TPU v5e page ("VM types": 1, 4 or 8 chips a VM), the GKE TPU page (a 16x16
# slice of ct5lp-hightpu-4t is 64 nodes) and xpk's system table (vms_per_slice: v5litepod-16 4,
# v5litepod-256 64, v4-32 4). The v5e page's "hosts" column (4x4 -> 2) counts 8-chip machines,
# not TPU VM workers.
hosts_per_slice() {
    local type=$1 family size
    family=${type%-*}
    size=${type##*-}
    [[ $type == *-* && $size =~ ^[0-9]+$ ]] || usage_error "accelerator type '$type' is not" \
        "of the form <family>-<size>, e.g. v5litepod-8 or v4-32"
    case $family in
        v5litepod | v6e)
            case $size in
                1 | 4 | 8) echo 1 ;;
                16 | 32 | 64 | 128 | 256) echo $((size / 4)) ;;
                *) usage_error "$type: $family slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips" ;;
            esac
            ;;
        v2 | v3 | v4 | v5p)
            ((size >= 8 && size % 8 == 0)) || usage_error "$type: $family sizes count TensorCores," \
                "a multiple of 8 (4 chips a host)"
            echo $((size / 8))
            ;;
        *) usage_error "unknown accelerator type '$type' (known: v5litepod-N, v6e-N, v2/v3/v4/v5p-N);" \
            "give the workers per slice with --hosts" ;;
    esac
}

workers() {  # workers per slice: --hosts, or from the accelerator type
    if [[ -n $HOSTS ]]; then
        [[ $HOSTS =~ ^[1-9][0-9]*$ ]] || usage_error "--hosts must be a positive integer, not '$HOSTS'"
        echo "$HOSTS"
    else
        hosts_per_slice "$TYPE"
    fi
}

parse_args() {
    CMD="" PODRUN_ARGS=() ENV_VARS=()
    NAME=${TPU_NAME:-}
    PROJECT=${PROJECT_ID:-}
    ZONE=${ZONE:-}
    TYPE=${ACCELERATOR_TYPE:-v5litepod-8}
    RUNTIME=${RUNTIME_VERSION:-v2-alpha-tpuv5-lite}
    SLICES=${NUM_SLICES:-}
    HOSTS=${HOSTS_PER_SLICE:-}
    DEST=${LOG_DIR:-}
    PYTHON=${PODRUN_PYTHON:-python3.11}
    if [[ ${SPOT:-} == 1 ]]; then SPOT=1; else SPOT=0; fi
    if [[ ${DRY_RUN:-} == 1 ]]; then DRY_RUN=1; else DRY_RUN=0; fi
    BEST_EFFORT=0 ASYNC=0
    local arg
    while (($#)); do
        arg=$1
        case $arg in
            --) shift; PODRUN_ARGS=("$@"); break ;;
            -h | --help) usage; exit 0 ;;
            --dry-run) DRY_RUN=1 ;;
            --spot) SPOT=1 ;;
            --best-effort) BEST_EFFORT=1 ;;
            --async) ASYNC=1 ;;
            --name | --project | --zone | --type | --runtime | --slices | --hosts | --dest | --env | --python)
                (($# >= 2)) || usage_error "$arg needs a value"
                set_option "$arg" "$2"
                shift
                ;;
            --*=*) set_option "${arg%%=*}" "${arg#*=}" ;;
            -*) usage_error "unknown option '$arg'" ;;
            *)
                [[ -z $CMD ]] || usage_error "unexpected argument '$arg' (podrun's arguments go after --)"
                CMD=$arg
                ;;
        esac
        shift
    done
    ((SPOT + BEST_EFFORT < 2)) || usage_error "--spot and --best-effort exclude each other"
}

set_option() {
    case $1 in
        --name) NAME=$2 ;;
        --project) PROJECT=$2 ;;
        --zone) ZONE=$2 ;;
        --type) TYPE=$2 ;;
        --runtime) RUNTIME=$2 ;;
        --hosts) HOSTS=$2 ;;
        --dest) DEST=$2 ;;
        --python) PYTHON=$2 ;;
        --env)
            [[ $2 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || usage_error "--env takes NAME=VALUE, not '$2'"
            ENV_VARS+=("$2")
            ;;
        --slices)
            [[ $MULTISLICE == 1 ]] || usage_error "--slices is for launch/multislice.sh"
            SLICES=$2
            ;;
        *) usage_error "unknown option '$1'" ;;
    esac
}

# require OPTION... : each named option must be set for $CMD.
require() {
    local opt value env
    for opt in "$@"; do
        case $opt in
            --name) value=$NAME env=TPU_NAME ;;
            --project) value=$PROJECT env=PROJECT_ID ;;
            --zone) value=$ZONE env=ZONE ;;
            --slices) value=$SLICES env=NUM_SLICES ;;
        esac
        [[ -n $value ]] || usage_error "$opt is required for $CMD (or set $env)"
    done
    if [[ " $* " == *" --slices "* ]]; then
        if ! [[ $SLICES =~ ^[0-9]+$ ]] || ((SLICES < 2)); then
            usage_error "--slices must be 2 or more (one slice: launch/tpu_vm.sh), not '$SLICES'"
        fi
    fi
}

LOCATION=()  # --project=... --zone=..., set by locate()
locate() { LOCATION=("--project=$PROJECT" "--zone=$ZONE"); }

# Poll the queued resource until ACTIVE: WAIT_TRIES checks (default 120), WAIT_SECONDS apart
# (default 30), an error on FAILED or SUSPENDED or when the checks run out.
wait_active() {
    local tries=${WAIT_TRIES:-120} secs=${WAIT_SECONDS:-30} state="" i
    local describe=(gcloud compute tpus queued-resources describe "$NAME" "${LOCATION[@]}"
        "--format=value(state.state)")
    if [[ $DRY_RUN == 1 ]]; then
        cmd "${describe[@]}"
        note "dry run: the line above would be polled up to $tries times, ${secs}s apart, until ACTIVE"
        return 0
    fi
    for ((i = 1; i <= tries; i++)); do
        state=$("${describe[@]}") || fail "could not describe queued resource $NAME (gcloud's message is above)"
        case $state in
            ACTIVE)
                note "$NAME is ACTIVE"
                return 0
                ;;
            FAILED | SUSPENDING | SUSPENDED)
                fail "queued resource $NAME is $state; '$(quote_words "${describe[@]:0:6}" "${LOCATION[@]}")'" \
                    "says why; delete it ($PROG delete) before creating it again"
                ;;
        esac
        note "$NAME is ${state:-not listed yet} (check $i of $tries)"
        if ((i < tries)); then sleep "$secs"; fi
    done
    fail "queued resource $NAME is not ACTIVE after $tries checks ${secs}s apart (last state:" \
        "${state:-none}); keep waiting with '$PROG wait' (WAIT_TRIES, WAIT_SECONDS) or delete it"
}

# The tarball of the committed tree (git archive HEAD) that setup copies to every worker.
TARBALL=""
make_tarball() {
    TARBALL=${TMPDIR:-/tmp}/podrun-$NAME.tar.gz
    git -C "$REPO_DIR" rev-parse --verify -q HEAD >/dev/null || fail "$REPO_DIR has no commit to" \
        "archive (setup ships 'git archive HEAD')"
    if [[ -n $(git -C "$REPO_DIR" status --porcelain --untracked-files=no) ]]; then
        note "warning: uncommitted changes are not shipped (setup ships 'git archive HEAD')"
    fi
    cmd git -C "$REPO_DIR" archive --format=tar.gz -o "$TARBALL" HEAD
}

# On each worker: replace the code in ~/podrun (keeping logs/ and .venv/), make a venv with $PYTHON (jax needs Python >= 3.11; the
# TPU VM images are Ubuntu 22.04 with 3.10, so it is installed from apt when missing), then
# install podrun's requirements and the TPU wheels. Runs in the worker's login shell (bash).
setup_remote_command() {
    local py
    py=$(printf %q "$PYTHON")
    printf '%s' "mkdir -p ~/podrun && find ~/podrun -mindepth 1 -maxdepth 1 ! -name logs ! -name .venv" \
        " -exec rm -rf {} + && tar -xzf ~/podrun.tar.gz -C ~/podrun && rm -f ~/podrun.tar.gz" \
        " && cd ~/podrun && { command -v $py >/dev/null || { sudo apt-get update -q" \
        " && sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $py $py-venv; }; }" \
        " && { test -x .venv/bin/python || $py -m venv .venv; }" \
        " && .venv/bin/pip install -q -U pip" \
        " && .venv/bin/pip install -r requirements.txt 'jax[tpu]' -f $LIBTPU_FIND_LINKS"
}

# On each worker: podrun with the given arguments (quoted for the worker's bash), its output also
# written to ~/podrun/logs/run-$RUN_ID.log (set_run_id first); the exit status is podrun's, not tee's.
set_run_id() {  # RUN_ID from the environment, or the UTC time
    RUN_ID=${RUN_ID:-$(date -u +%Y%m%d-%H%M%S)}
    [[ $RUN_ID =~ ^[A-Za-z0-9._-]+$ ]] || usage_error "RUN_ID may hold letters, digits, . _ -, not '$RUN_ID'"
}

run_remote_command() {
    local envs="" kv
    for kv in "${ENV_VARS[@]}"; do envs+="$(printf %q "$kv") "; done
    printf '%s' "set -o pipefail; test -x ~/podrun/.venv/bin/python" \
        " || { echo \"podrun is not set up on \$(hostname): run '$PROG setup' first\" >&2; exit 1; };" \
        " cd ~/podrun && mkdir -p logs && ${envs:+env $envs}.venv/bin/python -m runner.main" \
        " $(quote_words "$@") 2>&1 | tee logs/run-$RUN_ID.log"
}

need_podrun_args() {
    ((${#PODRUN_ARGS[@]})) || usage_error "run needs podrun's arguments after --," \
        "e.g. $PROG run ... -- --config=configs/gptoss_v5e.py"
}

default_dest() { DEST=${DEST:-$REPO_DIR/out/logs/$NAME}; }

# The queued resource, created with the script's node flags ($@) and the capacity asked for.
create_queued() {
    local gcloud=(gcloud compute tpus queued-resources create) capacity=()
    if ((SPOT)); then capacity=(--spot); fi
    if ((BEST_EFFORT)); then
        gcloud=(gcloud alpha compute tpus queued-resources create)
        capacity=(--best-effort)
    fi
    cmd "${gcloud[@]}" "$NAME" "$@" "${LOCATION[@]}" "--accelerator-type=$TYPE" \
        "--runtime-version=$RUNTIME" "${capacity[@]}"
    wait_active
}

delete() {
    local extra=()
    if ((ASYNC)); then extra=(--async); fi
    cmd gcloud compute tpus queued-resources delete "$NAME" "${LOCATION[@]}" --force --quiet "${extra[@]}"
}

# After parse_args: checks the command and its options, then runs it (the script's own create,
# setup, run and logs; wait and delete from here). $@: the options create and logs require.
dispatch() {
    case $CMD in
        "") usage_error "a command is required: create, wait, setup, run, logs, delete or hosts" ;;
        hosts) workers; exit 0 ;;
        create | wait | setup | run | logs | delete) ;;
        *) usage_error "unknown command '$CMD'" ;;
    esac
    if [[ $CMD == run ]]; then need_podrun_args; elif ((${#PODRUN_ARGS[@]})); then
        usage_error "only run takes arguments after --"
    fi
    case $CMD in
        create | logs) require "$@" ;;
        *) require --name --project --zone ;;
    esac
    if [[ $CMD == logs ]]; then workers >/dev/null; fi  # a bad --type fails before anything runs
    need_gcloud
    locate
    case $CMD in
        wait) wait_active ;;
        *) "$CMD" ;;
    esac
}
