#!/usr/bin/env bash
# Several TPU VM slices joined over the data-center network (Multislice) for podrun: create them
# as one queued resource, set podrun up on every worker of every slice, run the same podrun
# command on all of them, gather their logs, delete them. `launch/multislice.sh -h`.
set -euo pipefail

MULTISLICE=1
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<EOF
Usage: $PROG COMMAND [options] [-- podrun arguments]

Runs podrun on SLICES TPU VM slices of one type, requested together as one queued resource
NAME whose slices are NAME-0 .. NAME-<SLICES-1>. Every worker of every slice runs the same
command. The queued resource sets up the Multislice (MEGASCALE_*) environment on the workers
itself; --env adds to it. podrun's own arguments (its mesh over all slices) pass through as given.

Commands:
  create   request the slices (--node-count, --node-prefix), then wait until ACTIVE
  wait     wait until the queued resource is ACTIVE
  setup    copy the committed tree (git archive HEAD) to every worker of every slice, unpack it
           into ~/podrun and install requirements.txt and jax[tpu] into ~/podrun/.venv
  run      run 'python -m runner.main <podrun arguments>' on all workers of all slices
           (--node=all --worker=all); each worker also writes ~/podrun/logs/run-<RUN_ID>.log
  logs     copy ~/podrun/logs of each worker into DEST/slice-<s>/worker-<i>/
  delete   delete the queued resource and its slices (--force --quiet)
  hosts    print the number of workers in one slice of --type

Options (environment variable in brackets):
  --name NAME        queued resource name, also the slices' name prefix [TPU_NAME]
  --slices K         number of slices, 2 or more [NUM_SLICES]
  --project PROJECT  Google Cloud project [PROJECT_ID]
  --zone ZONE        zone, e.g. us-west4-a [ZONE]
  --type TYPE        accelerator type of each slice [ACCELERATOR_TYPE], default v5litepod-8
EOF
    common_options_usage
    cat <<EOF

Example (2 x v5litepod-16):
  $PROG create --name=podrun-ms --slices=2 --type=v5litepod-16 --project=my-project --zone=us-west4-a
  $PROG setup  --name=podrun-ms --slices=2 --project=my-project --zone=us-west4-a
  $PROG run    --name=podrun-ms --slices=2 --project=my-project --zone=us-west4-a -- \\
      --config=configs/<deployment>.py --config.io.input=gs://BUCKET/requests.jsonl \\
      --config.io.output=gs://BUCKET/results.jsonl
  $PROG logs   --name=podrun-ms --slices=2 --type=v5litepod-16 --project=my-project --zone=us-west4-a
  $PROG delete --name=podrun-ms --slices=2 --project=my-project --zone=us-west4-a
EOF
}

create() { create_queued "--node-count=$SLICES" "--node-prefix=$NAME"; }

setup() {
    make_tarball
    cmd gcloud compute tpus queued-resources scp "$TARBALL" "$NAME:podrun.tar.gz" --recurse --node=all \
        --worker=all "${LOCATION[@]}"
    cmd gcloud compute tpus queued-resources ssh "$NAME" --node=all --worker=all "${LOCATION[@]}" \
        "--command=$(setup_remote_command)"
    cmd rm -f "$TARBALL"
}

run() {
    local remote
    set_run_id
    remote=$(run_remote_command "${PODRUN_ARGS[@]}")
    note "each worker writes ~/podrun/logs/run-$RUN_ID.log; gather them with '$PROG logs'"
    cmd gcloud compute tpus queued-resources ssh "$NAME" --node=all --worker=all "${LOCATION[@]}" \
        "--command=$remote"
}

logs() {  # scp cannot download from --worker=all: one copy a worker of each slice NAME-<s>
    local n s i
    n=$(workers)
    default_dest
    for ((s = 0; s < SLICES; s++)); do
        for ((i = 0; i < n; i++)); do
            cmd mkdir -p "$DEST/slice-$s/worker-$i"
            cmd gcloud compute tpus tpu-vm scp "$NAME-$s:podrun/logs" "$DEST/slice-$s/worker-$i" --recurse \
                "--worker=$i" "${LOCATION[@]}"
        done
    done
    note "logs of $SLICES x $n worker(s) in $DEST/slice-<s>/worker-<i>/logs"
}

parse_args "$@"
dispatch --name --slices --project --zone
