#!/usr/bin/env bash
# One TPU VM slice for podrun: create it (a queued resource), set podrun up on every worker, run
# the same podrun command on all workers, gather their logs, delete it. `launch/tpu_vm.sh -h`.
set -euo pipefail

MULTISLICE=0
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<EOF
Usage: $PROG COMMAND [options] [-- podrun arguments]

Runs podrun on one TPU VM slice: every worker runs the same command, and JAX on TPU VMs joins the
workers into one program.

Commands:
  create   request the slice as a queued resource, then wait until it is ACTIVE
  wait     wait until the queued resource is ACTIVE
  setup    copy the committed tree (git archive HEAD) to every worker, unpack it into ~/podrun
           and install requirements.txt and jax[tpu] into ~/podrun/.venv
  run      run 'python -m runner.main <podrun arguments>' on all workers (--worker=all); each
           worker also writes its output to ~/podrun/logs/run-<RUN_ID>.log
  logs     copy ~/podrun/logs of each worker into DEST/worker-<i>/
  delete   delete the queued resource and its TPU (--force --quiet)
  hosts    print the number of workers of --type

Options (environment variable in brackets):
  --name NAME        queued resource and TPU name [TPU_NAME]
  --project PROJECT  Google Cloud project [PROJECT_ID]
  --zone ZONE        zone, e.g. us-west4-a [ZONE]
  --type TYPE        accelerator type [ACCELERATOR_TYPE], default v5litepod-8
EOF
    common_options_usage
    cat <<EOF

Example:
  $PROG create --name=podrun --project=my-project --zone=us-west4-a --type=v5litepod-8
  $PROG setup  --name=podrun --project=my-project --zone=us-west4-a
  $PROG run    --name=podrun --project=my-project --zone=us-west4-a -- \\
      --config=configs/gptoss_v5e.py --config.io.input=gs://BUCKET/requests.jsonl \\
      --config.io.output=gs://BUCKET/results.jsonl
  $PROG logs   --name=podrun --project=my-project --zone=us-west4-a
  $PROG delete --name=podrun --project=my-project --zone=us-west4-a
EOF
}

create() { create_queued "--node-id=$NAME"; }

setup() {
    make_tarball
    cmd gcloud compute tpus tpu-vm scp "$TARBALL" "$NAME:podrun.tar.gz" --recurse --worker=all "${LOCATION[@]}"
    cmd gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" "--command=$(setup_remote_command)"
    cmd rm -f "$TARBALL"
}

run() {
    local remote
    set_run_id
    remote=$(run_remote_command "${PODRUN_ARGS[@]}")
    note "each worker writes ~/podrun/logs/run-$RUN_ID.log; gather them with '$PROG logs'"
    cmd gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOCATION[@]}" "--command=$remote"
}

logs() {  # scp cannot download from --worker=all: one copy a worker
    local n i
    n=$(workers)
    default_dest
    for ((i = 0; i < n; i++)); do
        cmd mkdir -p "$DEST/worker-$i"
        cmd gcloud compute tpus tpu-vm scp "$NAME:podrun/logs" "$DEST/worker-$i" --recurse "--worker=$i" \
            "${LOCATION[@]}"
    done
    note "logs of $n worker(s) in $DEST/worker-<i>/logs"
}

parse_args "$@"
dispatch --name --project --zone
