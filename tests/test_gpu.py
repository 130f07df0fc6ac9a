"""What of the GPU deployment a CPU can check: the platform chosen on an NVIDIA machine, the
kernels a GPU mesh runs (traced over stand-in GPU devices: cuDNN's prefill attention, nothing
CPU- or TPU-only), the H100 configs' fit, and the transformers peer's architecture. The speed is
benchmarks/gpu_check.py's, on a real GPU (docs/benchmarks/gpu-h100.md)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from models import weights
from models.backend import Backend
from models.decoder import Mode, Output
from models.kernels import cpu, gpu, tpu
from models.policy import Policy
from models.registry import Model
from runner import log
from runner.settings import from_config
from runner.tools.memory import footprint
from sharding.mesh import MESH_AXES
from sharding.rules import Rules
from tests.test_configs import ROOT, load


@pytest.mark.parametrize("devices,plugins,want", [
    ({"/dev/nvidiactl", "/dev/nvidia0"}, {"jax_cuda13_plugin"}, "cuda,cpu"),
    ({"/dev/nvidia0"}, {"jax_cuda12_plugin"}, "cuda,cpu"),
    ({"/dev/nvidiactl", "/dev/nvidia0"}, set(), "cpu"),  # no CUDA plugin: jax could not use them
    (set(), {"jax_cuda13_plugin"}, "cpu"),  # the plugin on a machine without a GPU
    ({"/dev/accel0", "/dev/nvidia0"}, {"jax_cuda13_plugin"}, None),  # a TPU VM: jax's default
])
def test_platforms_follow_the_machine(monkeypatch, devices, plugins, want):
    def matches(pattern):
        prefix = pattern.split("*")[0].split("[")[0]
        return sorted(d for d in devices if d.startswith(prefix))

    monkeypatch.setattr(log.glob, "glob", matches)
    monkeypatch.setattr(log.os.path, "exists", lambda p: p in devices)
    monkeypatch.setattr(log.importlib.util, "find_spec", lambda name: name in plugins or None)
    assert log.platforms() == want


class StandInGPU:
    """A device for tracing only: what the mesh and the rules read of one."""

    platform, id, process_index, device_kind = "gpu", 0, 0, "stand-in"


def gpu_rules() -> Rules:
    return Rules.make(Mesh(np.array([StandInGPU()]).reshape(1, 1, 1, 1), MESH_AXES))


@pytest.fixture
def tripwires(monkeypatch):
    """Every CPU- and TPU-only kernel fails if a GPU program reaches it; cuDNN's attention is
    counted and traced through XLA's implementation of the same call (no cuDNN on a CPU)."""
    def forbidden(*a, **k):
        raise AssertionError("a CPU- or TPU-only kernel on a GPU mesh")

    monkeypatch.setattr(cpu, "available", forbidden)
    for name in ("flash_prefill", "decode_attention"):
        monkeypatch.setattr(tpu, name, forbidden)
    calls = []
    real = gpu.flash_prefill

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw, implementation="xla")

    monkeypatch.setattr(gpu, "flash_prefill", counted)
    return calls


@pytest.mark.parametrize("spec,quantize", [("llama:tiny", "none"), ("llama:tiny", "int8"),
                                           ("llama:tiny", "int4"), ("gptoss:tiny", "none")])
def test_a_gpu_mesh_prefills_in_cudnn_and_runs_nothing_cpu_or_tpu_only(tripwires, spec, quantize):
    """Every switch of the CPU and TPU kernels on, as a config could leave them: on a GPU mesh a
    prefill's attention goes to cuDNN (except with GPT-OSS's sinks), a decode step's to XLA, the
    products to XLA (quantised ones too)."""
    rules = gpu_rules()
    model = Model.named(spec)
    policy = Policy(params="bfloat16", activations="bfloat16", kv_cache="bfloat16", matmul="default",
                    quantize=quantize, kernels=True, pallas_attention=True, pallas_prefill=True,
                    pallas_moe=True, cudnn_prefill=True).on(rules)
    assert policy.backend == Backend("gpu", flash_prefill="cudnn")
    decl = model.declare()
    params = jax.eval_shape(lambda: weights.init(decl, jax.random.key(0), rules, jnp.bfloat16))
    if quantize != "none":  # the quantised layout, without quantising anything
        from models import quant
        params = quant.abstract_tree(decl, rules, jnp.dtype(jnp.bfloat16), quantize)
    cache = jax.eval_shape(lambda: model.new_cache(2, 24, jnp.bfloat16, rules))
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def prefill(params, tokens, positions, cache):
        return model.forward(params, tokens, positions, cache, rules, policy, Mode.PREFILL, 0, Output.LAST_LOGITS)

    def step(params, tokens, positions, cache, slots):
        return model.forward(params, tokens, positions, cache, rules, policy, Mode.APPEND, slots, Output.LAST_LOGITS)

    jax.make_jaxpr(prefill)(params, ids, ids, cache)
    layers = model.num_layers
    assert len(tripwires) == (0 if spec.startswith("gptoss") else layers)
    one = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    jax.make_jaxpr(step)(params, one, one, cache, jax.ShapeDtypeStruct((2,), jnp.int32))
    assert len(tripwires) == (0 if spec.startswith("gptoss") else layers)  # none in the step


@pytest.mark.parametrize("name,batch", [("llama3_h100.py", 128), ("gptoss_h100.py", 64)])
def test_the_h100_deployments_fit_the_card_with_room_for_activations(name, batch):
    s = from_config(load(os.path.join(ROOT, "configs", name)).get_config())
    assert s.mesh.size() == 1 and s.device_memory_gib == 80.0 and s.generation.batch_size == batch
    f = footprint(s, Model.named(s.checkpoint_model))
    assert f.per_device < 0.65 * f.device_memory, f


def test_the_transformers_peer_builds_the_same_architecture():
    """benchmarks/hf_generate_peer.py's Llama config, read back by podrun's own HF import, is the
    preset runner.tools.bench measures."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from hf_generate_peer import hf_config
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    for spec in ("llama:llama3.1-8b", "llama:smollm2-135m", "llama:llama2-7b"):
        assert Model.from_hf_config(hf_config(spec).to_dict()) == Model.named(spec), spec
    with pytest.raises(SystemExit, match="only Llama presets"):
        hf_config("llama:qwen2.5-0.5b")


@pytest.mark.slow
def test_the_device_check_runs_its_steps_on_a_tiny_model(tmp_path):
    """benchmarks/gpu_check.py --small on this CPU: every podrun step runs and lands in the JSON
    (cuDNN's attention check fails here, so the later steps fall back to XLA's attention)."""
    import json
    import subprocess

    out = tmp_path / "out"
    env = dict(os.environ, HOME=str(tmp_path))  # its compilation cache, not the user's
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py", f"--out={out}", "--small"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads((out / "gpu_check.json").read_text())
    steps = got["steps"]
    assert steps["attention"]["rc"] != 0  # no cuDNN on a CPU
    for name in ("preflight", "tiny", "decode", "prefill", "scan_dsf", "job"):
        assert steps[name]["rc"] == 0, (name, steps[name].get("log_tail"))
    assert "--config.precision.cudnn_prefill=False" in steps["decode"]["command"]
    assert sorted(r["batch_size"] for r in steps["decode"]["records"]) == [1, 2, 4, 8]
    assert steps["job"]["records"]["requests"] == 40 == steps["job"]["workload"]["requests"]
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
