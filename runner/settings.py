"""The ConfigDict stops here: typed, frozen settings go further into the library."""

from __future__ import annotations

import dataclasses
import hashlib
import os

from ml_collections import ConfigDict

from models.policy import Policy
from sharding.mesh import MESH_AXES, MeshShape


class SettingsError(ValueError):
    """A config value is out of range or inconsistent."""


@dataclasses.dataclass(frozen=True)
class Generation:
    batch_size: int
    max_prompt_len: int
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    steps_per_dispatch: int
    reasoning_effort: str
    page_size: int = 16
    kv_cache_gib: float = 0.0
    chunk_tokens: int = 256
    longest_first: bool = True  # admission by max_tokens, largest first


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    seed: int


@dataclasses.dataclass(frozen=True)
class Distributed:
    mode: str  # auto | off
    coordinator: str  # host:port, "" = detect (TPU VMs)
    num_processes: int
    process_id: int
    timeout_s: int
    heartbeat_timeout_s: int


@dataclasses.dataclass(frozen=True)
class Settings:
    checkpoint_path: str
    checkpoint_fetch: str
    checkpoint_model: str
    chat_template: str  # a template file or text in place of the checkpoint's ("": its own)
    mesh: MeshShape
    num_cpu_devices: int
    device_memory_gib: float
    tpu_topology: str
    rules: dict[str, tuple[str, ...]]
    compilation_cache_dir: str
    policy: Policy
    generation: Generation
    sampling: Sampling
    input: str
    output: str
    echo_prompt: bool
    overwrite: bool  # a finished output is generated again, not left as it is
    distributed: Distributed
    parts: int = 1  # the input split into this many parts (1: not split)
    part: int = -1  # the part this run answers (-1: none given)
    # The settings that change what a request's result is, as the config names them: a part's
    # header records them, and the merge refuses a part written with others (RESULT_KEYS).
    result_config: dict = dataclasses.field(default_factory=dict)


# What changes a result: the model and its template, the numbers' precision, the limits and stops
# that parsing applies, the sampling defaults, what a result line holds. Not the mesh, the batch,
# the engine, its kernels or programs (each gives the same results), nor where files are.
RESULT_KEYS = ("checkpoint.path", "checkpoint.chat_template", "precision.params", "precision.activations",
               "precision.kv_cache", "precision.matmul", "precision.quantize", "precision.int4_activations",
               "precision.batch_invariant",
               "generation.max_prompt_len",
               "generation.max_new_tokens", "generation.stop", "generation.stop_token_ids",
               "generation.reasoning_effort", "sampling.temperature", "sampling.top_k", "sampling.top_p",
               "sampling.seed", "io.echo_prompt")


def _result_config(c: ConfigDict) -> dict:
    """RESULT_KEYS' values as given (a path as written, not expanded: the merge may run on another
    machine), JSON-ready; a template's text longer than a path by its sha256."""
    out = {}
    for key in RESULT_KEYS:
        section, name = key.split(".")
        v = c[section][name]
        v = list(v) if isinstance(v, tuple) else v
        if key == "checkpoint.chat_template" and len(v) > 200:
            v = "sha256:" + hashlib.sha256(v.encode("utf-8", "surrogateescape")).hexdigest()
        out[key] = v
    return out


def _parts(io: ConfigDict) -> tuple[int, int]:
    """(io.parts, the part this run answers: io.part, else JOB_COMPLETION_INDEX where parts > 1,
    else -1), each checked."""
    parts, part = int(io.parts), int(io.part)
    if parts < 1:
        raise SettingsError(f"io.parts={parts} must be at least 1 (1: the input is not split)")
    if part < -1 or part >= parts:
        raise SettingsError(f"io.part={part} is out of range: io.parts={parts} has parts 0 to {parts - 1}")
    index = os.environ.get("JOB_COMPLETION_INDEX", "")
    if part == -1 and parts > 1 and index:
        if not index.isdigit() or int(index) >= parts:
            raise SettingsError(f"JOB_COMPLETION_INDEX={index!r} (the index of this pod in its Indexed "
                                f"Job) is no part of io.parts={parts}: give a Job of {parts} completions, "
                                "or --config.io.part")
        part = int(index)
    return parts, part


def _path(p: str) -> str:
    return p if not p or "://" in p else os.path.expanduser(p)


def from_config(c: ConfigDict, checkpoint: bool = True) -> Settings:
    """c's Settings, checked; checkpoint=False: checkpoint.path may be empty (a Generator given
    its weights in Python, with checkpoint.model)."""
    g, s = c.generation, c.sampling
    gen = Generation(
        batch_size=int(g.batch_size),
        max_prompt_len=int(g.max_prompt_len),
        max_new_tokens=int(g.max_new_tokens),
        stop=tuple(x for x in g.stop if x),
        stop_token_ids=tuple(int(x) for x in g.stop_token_ids if int(x) >= 0),
        steps_per_dispatch=int(g.steps_per_dispatch),
        reasoning_effort=g.reasoning_effort,
        page_size=int(g.page_size),
        kv_cache_gib=float(g.kv_cache_gib),
        chunk_tokens=int(g.chunk_tokens),
        longest_first=bool(g.longest_first),
    )
    for field in ("batch_size", "max_prompt_len", "max_new_tokens", "steps_per_dispatch"):
        if getattr(gen, field) < 1:
            raise SettingsError(f"generation.{field}={getattr(gen, field)} must be at least 1")
    if gen.page_size < 1:
        raise SettingsError(f"generation.page_size={gen.page_size}: the KV cache is paged, in pages "
                            "of at least 1 token (16: every config's); kv_cache_gib sizes the pool")
    if gen.kv_cache_gib < 0 or gen.chunk_tokens < 1:
        raise SettingsError(f"generation.kv_cache_gib={gen.kv_cache_gib} must be 0 or more, "
                            f"chunk_tokens={gen.chunk_tokens} at least 1")
    if gen.reasoning_effort not in ("low", "medium", "high"):
        raise SettingsError(f"generation.reasoning_effort={gen.reasoning_effort!r}: use low, medium or high")
    samp = Sampling(float(s.temperature), int(s.top_k), float(s.top_p), int(s.seed))
    if samp.temperature < 0 or not 0 < samp.top_p <= 1 or samp.top_k < 0:
        raise SettingsError(
            f"sampling temperature={samp.temperature}, top_p={samp.top_p}, top_k={samp.top_k}: "
            "need temperature >= 0, 0 < top_p <= 1, top_k >= 0"
        )
    p, k, prog = c.precision, c.kernels, c.programs
    for field in ("params", "activations"):
        if p[field] not in ("float32", "bfloat16", "float16"):
            raise SettingsError(f"precision.{field}={p[field]!r}: use float32, bfloat16 or float16")
    if p.kv_cache not in ("float32", "bfloat16", "float16", "int8"):
        raise SettingsError(f"precision.kv_cache={p.kv_cache!r}: use float32, bfloat16, float16 "
                            "or int8")
    if p.matmul not in ("default", "high", "highest"):
        raise SettingsError(f"precision.matmul={p.matmul!r}: use default, high or highest")
    if p.quantize not in ("none", "int8", "int4"):
        raise SettingsError(f"precision.quantize={p.quantize!r}: use none, int8 or int4")
    if p.int4_activations not in ("float32", "bfloat16"):
        raise SettingsError(f"precision.int4_activations={p.int4_activations!r}: use float32 or bfloat16")
    if not c.checkpoint.path and (checkpoint or not c.checkpoint.model):
        raise SettingsError("checkpoint.path is empty: pass --config.checkpoint.path=<converted checkpoint>")
    parts, part = _parts(c.io)
    return Settings(
        checkpoint_path=_path(c.checkpoint.path),
        checkpoint_fetch=c.checkpoint.fetch,
        checkpoint_model=c.checkpoint.model,
        chat_template=c.checkpoint.chat_template,
        mesh=MeshShape(c.mesh.data, c.mesh.sequence, c.mesh.expert, c.mesh.model,
                       dcn=tuple(int(c.mesh.dcn[a]) for a in MESH_AXES)),
        num_cpu_devices=int(c.mesh.num_cpu_devices),
        device_memory_gib=float(c.mesh.device_memory_gib),
        tpu_topology=c.mesh.tpu_topology,
        rules={k: tuple(a.strip() for a in v.split(",") if a.strip()) for k, v in c.rules.items()},
        compilation_cache_dir=_path(c.compilation_cache.dir),
        policy=Policy(params=p.params, activations=p.activations, kv_cache=p.kv_cache,
                      matmul=p.matmul, quantize=p.quantize, int4_activations=p.int4_activations,
                      batch_invariant=bool(p.batch_invariant), kernels=bool(k.enabled),
                      pallas_attention=bool(k.pallas_attention), pallas_moe=bool(k.pallas_moe),
                      greedy_screen=bool(k.greedy_screen), panel_weights=bool(k.panel_weights),
                      fuse_projections=bool(prog.fuse_projections), scan_layers=bool(prog.scan_layers),
                      donate_cache=bool(prog.donate_cache), huge_pages=bool(prog.huge_pages)),
        generation=gen,
        sampling=samp,
        input=_path(c.io.input),
        output=_path(c.io.output),
        echo_prompt=bool(c.io.echo_prompt),
        overwrite=bool(c.io.overwrite),
        distributed=_distributed(c.distributed),
        parts=parts,
        part=part,
        result_config=_result_config(c),
    )


def _distributed(d: ConfigDict) -> Distributed:
    if d.mode not in ("auto", "off"):
        raise SettingsError(f"distributed.mode={d.mode!r}: use auto or off")
    dist = Distributed(d.mode, d.coordinator, int(d.num_processes), int(d.process_id),
                       int(d.timeout_s), int(d.heartbeat_timeout_s))
    if dist.coordinator and not (dist.num_processes > 0 and 0 <= dist.process_id < dist.num_processes):
        raise SettingsError(
            f"distributed.coordinator={dist.coordinator} needs distributed.num_processes > 0 and "
            f"0 <= distributed.process_id < num_processes (got {dist.num_processes}, {dist.process_id})"
        )
    return dist
