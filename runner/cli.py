"""What podrun's commands share: the devices set up before the backend starts, their flags
parsed with one-line errors, the --config file read with one-line errors, the line an
interrupted job ends with."""

from __future__ import annotations

import collections
import os
import re
import socket
import sys
import time

import jax
from absl import flags
from etils import epath
from ml_collections import config_flags

from runner.log import quiet
from runner.results.parts import part_path
from runner.results.writer import partial_objects, read_partial
from runner.storage import check_bucket, is_remote


def setup_devices(s) -> None:
    """Before the backend starts: simulated CPU devices, the persistent compilation cache, and
    jax.distributed when several processes share the mesh."""
    quiet()
    if s.num_cpu_devices > 0:
        try:
            jax.config.update("jax_num_cpu_devices", s.num_cpu_devices)
        except RuntimeError:  # the backend is up (a Generator in a trainer's process): its
            pass  # devices stand, and a mesh they cannot hold is refused when it is made
    d = s.distributed
    timeouts = dict(initialization_timeout=d.timeout_s, heartbeat_timeout_seconds=d.heartbeat_timeout_s)
    auto = d.mode == "auto" and not jax.distributed.is_initialized()  # a caller's stands
    if auto and d.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes only
        if d.process_id != 0:  # process 0 serves the coordinator; the others must reach it
            wait_for_coordinator(d.coordinator, d.process_id, d.timeout_s)
        jax.distributed.initialize(d.coordinator, d.num_processes, d.process_id, **timeouts)
    elif auto and "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):  # a TPU VM pod
        jax.distributed.initialize(**timeouts)
    cache_dir = s.compilation_cache_dir
    if cache_dir:
        check_bucket(cache_dir, "compilation_cache.dir")  # jax would create a missing bucket
        os.makedirs(cache_dir, exist_ok=True) if not is_remote(cache_dir) else None
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.monitoring.register_event_listener(lambda event, **_: _CACHE_EVENTS.update([event]))


class DistributedError(RuntimeError):
    """The other processes of a multi-process run cannot be reached."""


def wait_for_coordinator(address: str, process_id: int, timeout_s: int) -> None:
    """Waits until the coordinator's port answers. jax, when it cannot register, aborts the process
    with a C++ stack trace; this says instead what is wrong, after the same timeout."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {process_id}: distributed.coordinator={address} did not answer within "
                    f"distributed.timeout_s={timeout_s} s ({e.strerror or e}); is process 0 running "
                    "there, and is the address right?") from e
            time.sleep(0.5)


# jax's compilation-cache events: compiles that asked the cache, and those it answered.
_CACHE_EVENTS: collections.Counter = collections.Counter()
_ASKED, _HITS = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"


def cache_counts() -> tuple[int, int]:
    """(hits, misses) of the persistent compilation cache so far in this process."""
    return _CACHE_EVENTS[_HITS], _CACHE_EVENTS[_ASKED] - _CACHE_EVENTS[_HITS]


def interrupted(s, tool: str = "podrun") -> str:
    """The line a job stopped by Ctrl-C ends with: how many results its partial file keeps (the
    results module appends each as it finishes; a part's run, its part's), and that the same
    command resumes from them. `s`: the job's Settings, or None before they were read."""
    if s is None:
        return f"{tool}: interrupted before the job started"
    output = part_path(s.output, s.part, s.parts) if s.parts > 1 and s.part >= 0 else s.output
    partial = epath.Path(output + ".partial")
    try:
        found = read_partial(partial, partial_objects(partial) if is_remote(output) else None)
    except ValueError as e:  # read_partial's RequestFileError: the partial file cannot be read
        return f"{tool}: interrupted; {e}; the same command resumes from what it holds"
    if found is None:
        return f"{tool}: interrupted before any result was written; the same command starts again"
    return (f"{tool}: interrupted: {len(found.done)} results kept in {partial}; the same command resumes "
            "from them")


def config_flag():
    """A command's --config flag: a deployment's config file, locked, so that an override of a
    key it lacks is an error."""
    return config_flags.DEFINE_config_file("config", None, "deployment config file", lock_config=True)


def read_config(argv: list[str], config, tool: str, also: str = "", given: bool = True):
    """The --config flag's ConfigDict (its `.value`) for a command that takes no positional
    arguments: one line and exit when absl left some in `argv`, or when --config (or the flag
    `also` names, where not `given`) is missing. ml_collections defers a config file's load
    error to the first attribute read, as a multi-line OSError: here it is one line too."""
    if len(argv) > 1:
        sys.exit(f"{tool}: error: unexpected arguments {argv[1:]}")
    try:
        if config is not None:
            config.get("checkpoint")
    except OSError as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        sys.exit(f"{tool}: error: --config: {lines[-1] if lines else e}")
    if config is None or not given:
        needed = "--config=configs/<deployment>.py" + (f" and {also} are" if also else " is")
        sys.exit(f"{tool}: error: {needed} required")
    return config


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with a misspelt --config override reported in one line."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:  # ml_collections: an override of a field not there
        inner = e.args[0] if e.args else ""  # AttributeError wraps the KeyError of a nested field
        inner = inner.args[0] if isinstance(inner, KeyError) and inner.args else inner
        sys.exit(f"podrun: error: {unknown_override(argv, str(inner))}")
    except flags.Error as e:
        message = str(e)
        if message[:1] == message[-1:] == "'":
            message = message[1:-1]
        message = message.replace("\\n", "\n").replace("\\'", "'")
        lines = [x.strip() for x in message.splitlines() if x.strip()]
        if "Traceback (most recent call last):" in lines:  # a config file's get_config raised
            message = f"{lines[0]} {lines[-1]}"
        sys.exit(f"podrun: error: {' '.join(message.split())}")


# Keys that left `precision` for the sections that say what they hold.
MOVED = {"precision.kernels": "kernels.enabled", **{f"precision.{k}": f"kernels.{k}" for k in (
    "pallas_attention", "pallas_moe", "greedy_screen", "panel_weights")},
    **{f"precision.{k}": f"programs.{k}" for k in ("scan_layers", "fuse_projections", "donate_cache",
                                                     "huge_pages")}}

# Keys of the engine whose rows reserved their longest request, which the paged engine replaced.
_CHUNKS = "prompts are computed in chunks of up to generation.chunk_tokens beside the decoding rows"
_ATTENTION = "kernels.pallas_attention: the paged attention kernel takes prompts' chunks too"
REMOVED = {
    "generation.prefill_buckets": _CHUNKS,
    "generation.prefill_rows": _CHUNKS + ", one prompt a group at a time",
    "generation.prefix_tokens": "prompts share their full pages of generation.page_size tokens",
    "generation.prefix_block": "prompts share their full pages of generation.page_size tokens",
    "kernels.pallas_prefill": _ATTENTION, "kernels.cudnn_prefill": _ATTENTION,
    "precision.pallas_prefill": _ATTENTION, "precision.cudnn_prefill": _ATTENTION,
}


def unknown_override(argv: list[str], detail: str) -> str:
    """One line naming the --config.* override whose field does not exist, from ml_collections'
    message ("'foo'", or "'batch_sizee' Did you mean "batch_size" ...")."""
    named = re.search(r"'([^']+)'", detail)
    name = named.group(1) if named else detail
    hint = re.search(r'Did you mean "([^"]+)"', detail)
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--config.") and name in flag.removeprefix("--config.").split("."):
            path = flag.removeprefix("--config.")
            where = path[: path.index(name) + len(name)]
            if where in MOVED:
                return f"{flag}: {where} is now {MOVED[where]}"
            if where in REMOVED:
                return f"{flag}: {where} is gone with the unpaged engine; {REMOVED[where]}"
            did = f"; did you mean {hint.group(1)!r}?" if hint else ""
            return (f"{flag}: the config has no field {where!r}{did} (configs/base.py lists "
                    "the fields)")
    return f"no config field {name!r} (configs/base.py lists the fields)"
