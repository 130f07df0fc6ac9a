#!/usr/bin/env bash
# podrun on GKE: many independent replicas, one a TPU slice, answer the parts of one request file,
# then one merge writes the results file. The cluster (with JobSet), its TPU node pools, the
# image, the JobSet of a job, its status, the merge, deletion. `launch/gke/gke.sh -h`.
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
GKE_DIR=$LAUNCH_DIR/gke
# RestartJob (one slice restarted alone) is new in JobSet v0.12.0; tests/data holds its schema.
JOBSET_VERSION=v0.12.0
JOBSET_MANIFESTS=https://github.com/kubernetes-sigs/jobset/releases/download/$JOBSET_VERSION/manifests.yaml
SERVICE_ACCOUNT=podrun  # the pods' Kubernetes service account (launch/gke/render.py's too)
CPU_MACHINE=e2-standard-4  # the cluster's own pool: JobSet's controller and the merge

usage() {
    cat <<EOF
Usage: $PROG COMMAND [options] [-- podrun arguments]

Runs one podrun job on GKE as SLICES independent replicas, one a TPU slice of --type, that answer
the PARTS parts of the request file (podrun's io.parts and io.part), then merges the parts into
the results file. A lost slice stops no other, and a part that fails is run again on its own.
Single-host types (v5litepod-8 and smaller, v4-8): one JobSet, an Indexed Job whose index is the
part, then the merge. Multi-host types: one JobSet a slice (NAME-0 ..), whose hosts take parts r,
r+SLICES, ... together; then 'merge'. launch/gke/README.md says why.

Commands:
  cluster          create the cluster (--workload-pool; a CPU pool for JobSet and the merge), fetch
                   its credentials, install JobSet $JOBSET_VERSION, create the pods' service account
                   ($SERVICE_ACCOUNT) and the image's Artifact Registry repository (podrun)
  grant            let the pods read and write a bucket (--bucket): roles/storage.objectUser for
                   their service account, through Workload Identity
  nodepool         create SLICES slices of --type: one node pool of SLICES nodes (single-host), or
                   the node pools POOL-0 .. POOL-<SLICES-1> of one slice each (multi-host)
  build            build the image from the committed tree (git archive HEAD) and push it
  apply            render the JobSets (PARTS, SLICES, --type, the image and podrun's arguments
                   after --) into MANIFEST_DIR/NAME.yaml (default out/gke) and apply them
  manifest         print the JobSets that apply would apply, and run nothing
  status           the job's JobSets and Jobs; with podrun's arguments after --, the parts done,
                   pending and failed (python -m runner.tools.merge --status, run here)
  merge            merge the parts here (python -m runner.tools.merge): multi-host jobs end so;
                   a single-host job's JobSet merges on the cluster as its last step
  delete           delete the job's JobSets and their pods
  delete-nodepool  delete the TPU node pools
  delete-cluster   delete the cluster
  hosts            print the hosts (pods) in one slice of --type

Options (environment variable in brackets):
  --cluster NAME     the GKE cluster [CLUSTER], default podrun
  --name NAME        the job: its JobSets, Jobs and pods are named after it [JOB_NAME], default podrun
  --project PROJECT  Google Cloud project [PROJECT_ID]
  --zone ZONE        zone of the cluster and its nodes, e.g. us-west4-a [ZONE]
  --type TYPE        accelerator type of each slice [ACCELERATOR_TYPE], default v5litepod-8
  --topology TOPO    the slices' TPU topology [TPU_TOPOLOGY], default from --type (v4 and v5p
                     slices over 512 chips need it)
  --slices K         slices [NUM_SLICES], default 1
  --parts N          parts of the request file [NUM_PARTS]: apply, manifest, status, merge
  --retries R        apply: tries more of a failed part (single-host), or restarts of a failed
                     slice (multi-host); preemptions do not count [RETRIES], default 3
  --pool NAME        the TPU node pool, or the prefix of one a slice [NODE_POOL], default tpu
  --image IMAGE      the image [IMAGE], default REGION-docker.pkg.dev/PROJECT/podrun/podrun:COMMIT
                     (REGION from --zone, COMMIT the short hash of HEAD)
  --bucket BUCKET    grant: the bucket, gs://NAME
  --spot             nodepool: Spot VMs
  --dry-run          print the commands, one a line, instead of running them [DRY_RUN=1]
  -h, --help         print this message

Example (16 v5e-8 slices, 256 parts):
  $PROG cluster  --project=my-project --zone=us-west4-a
  $PROG grant    --project=my-project --bucket=gs://BUCKET
  $PROG nodepool --project=my-project --zone=us-west4-a --slices=16 --spot
  $PROG build    --project=my-project --zone=us-west4-a
  $PROG apply    --project=my-project --zone=us-west4-a --slices=16 --parts=256 -- \\
      --config=configs/gptoss_v5e.py --config.checkpoint.path=gs://BUCKET/gpt-oss-20b \\
      --config.io.input=gs://BUCKET/requests.jsonl --config.io.output=gs://BUCKET/results.jsonl
  $PROG status   --parts=256 -- --config=configs/gptoss_v5e.py ... (the same podrun arguments)
  $PROG delete-nodepool --project=my-project --zone=us-west4-a --slices=16
EOF
}

parse_gke_args() {
    CMD="" PODRUN_ARGS=()
    CLUSTER=${CLUSTER:-podrun}
    NAME=${JOB_NAME:-podrun}
    PROJECT=${PROJECT_ID:-}
    ZONE=${ZONE:-}
    TYPE=${ACCELERATOR_TYPE:-v5litepod-8}
    TOPOLOGY=${TPU_TOPOLOGY:-}
    SLICES=${NUM_SLICES:-1}
    PARTS=${NUM_PARTS:-}
    RETRIES=${RETRIES:-3}
    POOL=${NODE_POOL:-tpu}
    IMAGE=${IMAGE:-}
    BUCKET=""
    if [[ ${SPOT:-} == 1 ]]; then SPOT=1; else SPOT=0; fi
    if [[ ${DRY_RUN:-} == 1 ]]; then DRY_RUN=1; else DRY_RUN=0; fi
    local arg
    while (($#)); do
        arg=$1
        case $arg in
            --) shift; PODRUN_ARGS=("$@"); break ;;
            -h | --help) usage; exit 0 ;;
            --dry-run) DRY_RUN=1 ;;
            --spot) SPOT=1 ;;
            --cluster | --name | --project | --zone | --type | --topology | --slices | --parts | --retries | \
                --pool | --image | --bucket)
                (($# >= 2)) || usage_error "$arg needs a value"
                set_gke_option "$arg" "$2"
                shift
                ;;
            --*=*) set_gke_option "${arg%%=*}" "${arg#*=}" ;;
            -*) usage_error "unknown option '$arg'" ;;
            *)
                [[ -z $CMD ]] || usage_error "unexpected argument '$arg' (podrun's arguments go after --)"
                CMD=$arg
                ;;
        esac
        shift
    done
}

set_gke_option() {
    case $1 in
        --cluster) CLUSTER=$2 ;;
        --name) NAME=$2 ;;
        --project) PROJECT=$2 ;;
        --zone) ZONE=$2 ;;
        --type) TYPE=$2 ;;
        --topology) TOPOLOGY=$2 ;;
        --slices) SLICES=$2 ;;
        --parts) PARTS=$2 ;;
        --retries) RETRIES=$2 ;;
        --pool) POOL=$2 ;;
        --image) IMAGE=$2 ;;
        --bucket) BUCKET=$2 ;;
        *) usage_error "unknown option '$1'" ;;
    esac
}

# require_gke OPTION... : each named option must be set for $CMD.
require_gke() {
    local opt value env
    for opt in "$@"; do
        case $opt in
            --project) value=$PROJECT env=PROJECT_ID ;;
            --zone) value=$ZONE env=ZONE ;;
            --parts) value=$PARTS env=NUM_PARTS ;;
            --bucket) value=$BUCKET env="" ;;
        esac
        [[ -n $value ]] || usage_error "$opt is required for $CMD${env:+ (or set $env)}"
    done
}

whole() {  # whole OPTION VALUE MIN MAX: VALUE is a whole number from MIN to MAX
    if ! [[ $2 =~ ^(0|[1-9][0-9]{0,5})$ ]] || (($2 < $3 || $2 > $4)); then
        usage_error "$1 must be a whole number from $3 to $4, not '$2'"
    fi
}

# The slices of --type on GKE: ACCELERATOR (the node label cloud.google.com/gke-tpu-accelerator),
# MACHINE (the node pool's machine type), TOPOLOGY, CHIPS (TPU chips a host, google.com/tpu),
# HOSTS (hosts, and pods, a slice: hosts_per_slice, as on TPU VMs). Source: the tables of GKE's
# "Plan TPUs in GKE" page and xpk's system characteristics: v5e and v6e slices of up to 8 chips
# are one host of that many chips (ct5lp-hightpu-8t is a 2x4 v5e-8), larger ones hosts of 4
# chips (ct5lp-hightpu-4t); v4 and v5p hosts have 4 chips, a 2x2x1 v4-8 is one.
slice_shape() {
    local family=${TYPE%-*} size=${TYPE##*-} chips default product
    case $family in
        v5litepod) ACCELERATOR=tpu-v5-lite-podslice MACHINE=ct5lp-hightpu ;;
        v6e) ACCELERATOR=tpu-v6e-slice MACHINE=ct6e-standard ;;
        v4) ACCELERATOR=tpu-v4-podslice MACHINE=ct4p-hightpu ;;
        v5p) ACCELERATOR=tpu-v5p-slice MACHINE=ct5p-hightpu ;;
        *) usage_error "$TYPE: GKE's TPU node pools are v4, v5e (v5litepod), v5p and v6e slices" ;;
    esac
    HOSTS=$(hosts_per_slice "$TYPE")
    case $family in
        v5litepod | v6e)
            chips=$size
            case $size in
                1) default=1x1 ;; 4) default=2x2 ;; 8) default=2x4 ;; 16) default=4x4 ;; 32) default=4x8 ;;
                64) default=8x8 ;; 128) default=8x16 ;; 256) default=16x16 ;;
            esac
            ;;
        *)
            chips=$((size / 2))  # the size counts TensorCores, 2 a chip
            case $chips in
                4) default=2x2x1 ;; 8) default=2x2x2 ;; 16) default=2x2x4 ;; 32) default=2x4x4 ;;
                64) default=4x4x4 ;; 128) default=4x4x8 ;; 256) default=4x8x8 ;; 512) default=8x8x8 ;;
                *) default="" ;;
            esac
            ;;
    esac
    CHIPS=$((chips / HOSTS))
    MACHINE=$MACHINE-${CHIPS}t
    TOPOLOGY=${TOPOLOGY:-$default}
    [[ -n $TOPOLOGY ]] || usage_error "$TYPE: give its topology with --topology (e.g. 4x4x16)"
    [[ $TOPOLOGY =~ ^[1-9][0-9]*(x[1-9][0-9]*)+$ ]] || usage_error "--topology must be like 2x4 or 2x2x4," \
        "not '$TOPOLOGY'"
    product=$((${TOPOLOGY//x/*}))
    ((product == chips)) || usage_error "--topology=$TOPOLOGY has $product chips, and $TYPE $chips"
}

multi_host() { ((HOSTS > 1)); }

GKE_WHERE=()  # --project=... --location=ZONE, set by gke_locate
gke_locate() { GKE_WHERE=("--project=$PROJECT" "--location=$ZONE"); }

region() { printf '%s' "${ZONE%-*}"; }  # us-west4-a -> us-west4

default_image() {
    local commit
    [[ -z $IMAGE ]] || return 0
    require_gke --project --zone
    commit=$(git -C "$REPO_DIR" rev-parse --short=12 HEAD 2>/dev/null) || fail "$REPO_DIR has no commit to" \
        "name the image after; give --image"
    IMAGE=$(region)-docker.pkg.dev/$PROJECT/podrun/podrun:$commit
}

node_pools() {  # the TPU node pools, one a line
    local s
    if multi_host; then
        for ((s = 0; s < SLICES; s++)); do echo "$POOL-$s"; done
    else
        echo "$POOL"
    fi
}

need() {  # the tools a real run calls
    [[ $DRY_RUN == 1 ]] && return 0
    local tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || fail "$tool not found on PATH: install it (gcloud: the Google Cloud" \
            "CLI, https://cloud.google.com/sdk/docs/install; kubectl: gcloud components install kubectl;" \
            "docker: https://docs.docker.com/engine/install), or add --dry-run to print the commands instead"
    done
}

cluster() {
    cmd gcloud container clusters create "$CLUSTER" "${GKE_WHERE[@]}" "--workload-pool=$PROJECT.svc.id.goog" \
        "--machine-type=$CPU_MACHINE" --num-nodes=1
    cmd gcloud container clusters get-credentials "$CLUSTER" "${GKE_WHERE[@]}"
    cmd kubectl apply --server-side -f "$JOBSET_MANIFESTS"
    cmd kubectl wait --for=condition=Available deployment/jobset-controller-manager --namespace=jobset-system \
        --timeout=300s
    cmd kubectl create serviceaccount "$SERVICE_ACCOUNT"
    cmd gcloud artifacts repositories create podrun "--project=$PROJECT" "--location=$(region)" \
        --repository-format=docker
}

# The pods' service account, as Workload Identity names it, gets roles/storage.objectUser on the
# bucket. The principal holds the project's number, which the first command prints.
grant() {
    local number bucket
    [[ $BUCKET =~ ^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9](/.*)?$ ]] || usage_error "--bucket must be" \
        "gs://BUCKET, not '$BUCKET'"
    bucket=${BUCKET#gs://}
    bucket=gs://${bucket%%/*}
    local describe=(gcloud projects describe "$PROJECT" "--format=value(projectNumber)")
    if [[ $DRY_RUN == 1 ]]; then
        cmd "${describe[@]}"
        note "dry run: PROJECT_NUMBER below stands for the number the line above prints"
        number=PROJECT_NUMBER
    else
        number=$("${describe[@]}") || fail "could not read the number of project $PROJECT (gcloud's message is above)"
    fi
    local pool=projects/$number/locations/global/workloadIdentityPools/$PROJECT.svc.id.goog
    cmd gcloud storage buckets add-iam-policy-binding "$bucket" "--role=roles/storage.objectUser" \
        "--member=principal://iam.googleapis.com/$pool/subject/ns/default/sa/$SERVICE_ACCOUNT"
}

nodepool() {
    local pool spot=() topology=()
    if ((SPOT)); then spot=(--spot); fi
    if multi_host; then topology=("--tpu-topology=$TOPOLOGY" "--num-nodes=$HOSTS"); else
        topology=("--num-nodes=$SLICES")
    fi
    for pool in $(node_pools); do
        cmd gcloud container node-pools create "$pool" "--cluster=$CLUSTER" "${GKE_WHERE[@]}" \
            "--machine-type=$MACHINE" "${topology[@]}" "${spot[@]}"
    done
}

delete-nodepool() {
    local pool
    for pool in $(node_pools); do
        cmd gcloud container node-pools delete "$pool" "--cluster=$CLUSTER" "${GKE_WHERE[@]}" --quiet
    done
}

delete-cluster() { cmd gcloud container clusters delete "$CLUSTER" "${GKE_WHERE[@]}" --quiet; }

# The image from the committed tree, unpacked in a scratch folder (nothing uncommitted, no .venv
# or out/ goes in), pushed to its registry.
build() {
    local context registry
    context=${TMPDIR:-/tmp}/podrun-image-$NAME
    registry=${IMAGE%%/*}
    make_tarball
    cmd rm -rf "$context"
    cmd mkdir -p "$context"
    cmd tar -xzf "$TARBALL" -C "$context"
    cmd docker build --platform=linux/amd64 -f "$context/launch/gke/Dockerfile" -t "$IMAGE" "$context"
    if [[ $registry == *-docker.pkg.dev ]]; then cmd gcloud auth configure-docker "$registry" --quiet; fi
    cmd docker push "$IMAGE"
    cmd rm -rf "$context" "$TARBALL"
}

render_command() {  # the words of render.py's command line; $@: its own options (--output)
    local shape=single-host
    if multi_host; then shape=multi-host; fi
    RENDER=(python3 "$GKE_DIR/render.py" "$shape" "--name=$NAME" "--image=$IMAGE" "--accelerator=$ACCELERATOR"
        "--topology=$TOPOLOGY" "--chips=$CHIPS" "--hosts=$HOSTS" "--slices=$SLICES" "--parts=$PARTS"
        "--retries=$RETRIES" "$@" -- "${PODRUN_ARGS[@]}")
}

apply() {
    local dir=${MANIFEST_DIR:-$REPO_DIR/out/gke}
    local manifest=$dir/$NAME.yaml
    render_command "--output=$manifest"
    cmd mkdir -p "$dir"
    cmd "${RENDER[@]}"
    cmd kubectl apply -f "$manifest"
    note "the manifest is $manifest; follow the job with '$PROG status --name=$NAME --parts=$PARTS --" \
        "<podrun arguments>'"
    if multi_host; then note "once every part is done, '$PROG merge' writes the results file"; fi
}

manifest() {
    render_command
    "${RENDER[@]}"
}

merge_tool() {  # python -m runner.tools.merge, run here from the repository, with podrun's arguments
    cmd env "PYTHONPATH=$REPO_DIR" python3 -m runner.tools.merge "${PODRUN_ARGS[@]}" "--config.io.parts=$PARTS" "$@"
}

JOB_SELECTOR=()  # the job's JobSets and Jobs (render.py labels them), set by dispatch_gke
status() {
    cmd kubectl get jobsets "${JOB_SELECTOR[@]}"
    cmd kubectl get jobs "${JOB_SELECTOR[@]}"
    if ((${#PODRUN_ARGS[@]})); then merge_tool --status; fi
}

merge() { merge_tool; }

delete() { cmd kubectl delete jobsets "${JOB_SELECTOR[@]}"; }

# The podrun arguments of apply, manifest and merge: given, and without the part options that
# the JobSet sets itself.
check_podrun_args() {
    local arg
    ((${#PODRUN_ARGS[@]})) || usage_error "$CMD needs podrun's arguments after --," \
        "e.g. $PROG $CMD ... -- --config=configs/gptoss_v5e.py --config.io.input=gs://... --config.io.output=gs://..."
    for arg in "${PODRUN_ARGS[@]}"; do
        case $arg in
            --config.io.part=* | --config.io.parts=* | --config.io.part | --config.io.parts)
                usage_error "podrun's $arg is set by $PROG (--parts, and each replica's index)" ;;
        esac
    done
}

dispatch_gke() {
    case $CMD in
        "") usage_error "a command is required: cluster, grant, nodepool, build, apply, manifest, status, merge," \
            "delete, delete-nodepool, delete-cluster or hosts" ;;
        cluster | grant | nodepool | build | apply | manifest | status | merge | delete | delete-nodepool | \
            delete-cluster | hosts) ;;
        *) usage_error "unknown command '$CMD'" ;;
    esac
    case $CMD in
        apply | manifest | merge) check_podrun_args ;;
        status) ;;
        *) ((${#PODRUN_ARGS[@]} == 0)) || usage_error "only apply, manifest, status and merge take arguments" \
            "after --" ;;
    esac
    whole --slices "$SLICES" 1 1024  # RestartJob's limit on a replicated Job's replicas
    whole --retries "$RETRIES" 0 999
    case $CMD in
        cluster | build | delete-cluster) require_gke --project --zone ;;
        nodepool | delete-nodepool) require_gke --project --zone; slice_shape ;;
        grant) require_gke --project --bucket ;;
        apply | manifest) require_gke --parts; whole --parts "$PARTS" 1 99999; slice_shape; default_image ;;
        status) if ((${#PODRUN_ARGS[@]})); then require_gke --parts; whole --parts "$PARTS" 1 99999; fi ;;
        merge) require_gke --parts; whole --parts "$PARTS" 1 99999 ;;
        hosts) slice_shape; echo "$HOSTS"; exit 0 ;;
    esac
    if [[ $CMD == build ]]; then default_image; fi
    if [[ $CMD == apply || $CMD == manifest ]] && ((PARTS < SLICES)); then
        note "warning: $PARTS part(s) for $SLICES slices: $((SLICES - PARTS)) slice(s) will have nothing to do"
    fi
    case $CMD in
        cluster | nodepool | delete-nodepool | delete-cluster) need gcloud kubectl ;;
        grant) need gcloud ;;
        build) need git gcloud docker ;;
        apply) need kubectl python3 ;;
        status | delete) need kubectl ;;
        manifest | merge) need python3 ;;
    esac
    gke_locate
    JOB_SELECTOR=("--selector=app.kubernetes.io/instance=$NAME")
    "$CMD"
}

parse_gke_args "$@"
dispatch_gke
