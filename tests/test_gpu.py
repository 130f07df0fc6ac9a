"""What of the GPU deployment a CPU can check: the platform chosen on an NVIDIA machine, the
kernels a GPU mesh runs (traced over stand-in GPU devices: cuDNN's prefill attention, the Pallas
(Triton) decode attention, nothing CPU- or TPU-only), the H100 configs' fit, and the transformers peer's architecture. The speed is
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
    """Every CPU- and TPU-only kernel fails if a GPU program reaches it; the GPU kernels' calls
    are counted by name (cuDNN's attention traced through XLA's implementation of the same call,
    as there is no cuDNN on a CPU)."""
    def forbidden(*a, **k):
        raise AssertionError("a CPU- or TPU-only kernel on a GPU mesh")

    monkeypatch.setattr(cpu, "available", forbidden)
    for name in ("flash_prefill", "decode_attention"):
        monkeypatch.setattr(tpu, name, forbidden)
    calls = {"flash_prefill": 0, "decode_attention": 0}

    def counted(name, real, **fixed):
        def call(*args, **kw):
            calls[name] += 1
            return real(*args, **kw, **fixed)
        return call

    monkeypatch.setattr(gpu, "flash_prefill", counted("flash_prefill", gpu.flash_prefill,
                                                      implementation="xla"))
    monkeypatch.setattr(gpu, "decode_attention", counted("decode_attention", gpu.decode_attention))
    return calls


@pytest.mark.parametrize("spec,quantize,kv", [("llama:tiny", "none", "bfloat16"),
                                              ("llama:tiny", "int8", "int8"),
                                              ("llama:tiny", "int4", "bfloat16"),
                                              ("gptoss:tiny", "none", "bfloat16")])
@pytest.mark.parametrize("pallas", [True, False], ids=["pallas_attention", "xla_attention"])
def test_a_gpu_mesh_runs_its_kernels_and_nothing_cpu_or_tpu_only(tripwires, spec, quantize, kv,
                                                                  pallas):
    """Every switch of the CPU and TPU kernels on, as a config could leave them: on a GPU mesh a
    prefill's attention goes to cuDNN (except with GPT-OSS's sinks), a decode step's to the Triton
    kernel with kernels.pallas_attention (sinks, windows and an int8 cache included) and to XLA
    without, the products to XLA (quantised ones too)."""
    rules = gpu_rules()
    model = Model.named(spec)
    policy = Policy(params="bfloat16", activations="bfloat16", kv_cache=kv, matmul="default",
                    quantize=quantize, kernels=True, pallas_attention=pallas, pallas_prefill=True,
                    pallas_moe=True, cudnn_prefill=True).on(rules)
    assert policy.backend == Backend("gpu", pallas_decode="gpu" if pallas else "",
                                     flash_prefill="cudnn", pallas_paged="gpu" if pallas else "")
    decl = model.declare()
    params = jax.eval_shape(lambda: weights.init(decl, jax.random.key(0), rules, jnp.bfloat16))
    if quantize != "none":  # the quantised layout, without quantising anything
        from models import quant
        params = quant.abstract_tree(decl, rules, jnp.dtype(jnp.bfloat16), quantize)
    cache = jax.eval_shape(lambda: model.new_cache(2, 24, jnp.dtype(kv), rules))
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def prefill(params, tokens, positions, cache):
        return model.forward(params, tokens, positions, cache, rules, policy, Mode.PREFILL, 0, Output.LAST_LOGITS)

    def step(params, tokens, positions, cache, slots):
        return model.forward(params, tokens, positions, cache, rules, policy, Mode.APPEND, slots, Output.LAST_LOGITS)

    jax.make_jaxpr(prefill)(params, ids, ids, cache)
    layers = model.num_layers
    flash = 0 if spec.startswith("gptoss") else layers
    assert tripwires == {"flash_prefill": flash, "decode_attention": 0}
    one = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    jax.make_jaxpr(step)(params, one, one, cache, jax.ShapeDtypeStruct((2,), jnp.int32))
    assert tripwires == {"flash_prefill": flash, "decode_attention": layers if pallas else 0}


@pytest.mark.parametrize("name", ["llama3_h100.py", "gptoss_h100.py"])
def test_the_h100_deployments_fit_the_card_with_room_for_activations(name):
    """Weights and the page pool leave at least 12 GiB of the card to the programs: at 256 rows
    and a chunk of 256 prompt tokens, their activations are a few hundred MiB."""
    s = from_config(load(os.path.join(ROOT, "configs", name)).get_config())
    assert s.mesh.size() == 1 and s.device_memory_gib == 80.0 and s.generation.batch_size == 256
    f = footprint(s, Model.named(s.checkpoint_model))
    assert s.generation.page_size and f.kv_cache == pytest.approx(s.generation.kv_cache_gib * 2**30, rel=1e-3)
    assert f.per_device < f.device_memory - 12 * 2**30, f


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
    # no cuDNN and no Triton on a CPU: the later steps run with XLA's attention
    assert steps["attention_kernel"]["rc"] != 0 and steps["decode_kernel"]["rc"] != 0
    assert steps["paged_kernel"]["rc"] != 0 and "throughput_ab" not in steps
    for name in ("preflight", "tiny", "throughput", "plan", "decode", "prefill", "fused", "scan_dsf",
                 "job", "gptoss"):
        assert steps[name]["rc"] == 0, (name, steps[name].get("log_tail"))
    assert "decode_pallas" not in steps
    assert "--config.kernels.cudnn_prefill=False" in steps["decode"]["command"]
    assert "--config.kernels.pallas_attention=False" in steps["job"]["command"]
    assert sorted(r["batch_size"] for r in steps["decode"]["records"]) == [1, 2, 4]
    assert sorted(r["batch_size"] for r in steps["gptoss"]["records"]) == [1, 2]
    assert steps["job"]["records"]["requests"] == 40 == steps["job"]["workload"]["requests"]
    # vLLM's throughput workload, shrunk: every answer runs its max_tokens, through the paged engine
    throughput = steps["throughput"]["records"]
    assert throughput["completion_tokens"] == 40 * 16 == steps["throughput"]["workload"]["max_tokens"]
    assert throughput["engine_pages"] > 0 and got["summary"]["targets"]["throughput_total_tokens_per_s"] > 0
    # the same job planned on the same devices: its schedule's tokens, and the plan against the run
    [plan] = steps["plan"]["records"]
    assert plan["completion_tokens"] == throughput["completion_tokens"] and plan["generate_s"] > 0
    assert got["summary"]["targets"]["plan_over_run_generate_s"] > 0
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]


@pytest.mark.parametrize("kind", ["llama", "gptoss"])
@pytest.mark.parametrize("mesh", ["1dev", "data2_model4"])
def test_decode_through_the_triton_kernel_matches_transformers(monkeypatch, kind, mesh):
    """A GPU backend's decode step (kernels.pallas_attention) on CPU devices, the Triton kernel
    run by Pallas' interpreter inside the model's shard_map: a ragged, left-padded batch prefilled,
    then decoded token by token; every step's logits against transformers' over the unpadded
    sequence. GPT-OSS brings sinks and windowed layers (rings of 8 slots, passed by the decode)."""
    from tests.conftest import rules_for
    from tests.reference import hf_logits, left_padded_batch, tiny_hf, to_podrun

    calls = []
    real = gpu.decode_attention

    def interpreted(*args, **kw):
        calls.append(args[1].shape)
        return real(*args, **kw, interpret=True)

    monkeypatch.setattr(gpu, "decode_attention", interpreted)
    # the backend a GPU mesh resolves, on this mesh of CPU devices
    monkeypatch.setattr(Backend, "resolve", classmethod(lambda cls, policy, rules: cls(
        "gpu", pallas_decode="gpu")))
    rules = rules_for(mesh)
    policy = Policy()
    m = tiny_hf(kind)
    model, params = to_podrun(m, rules)
    B, P, steps = 8, 12, 6
    lengths, seqs, tokens, positions = left_padded_batch(4, B, P, steps, shortest=2)
    cache = model.new_cache(B, P + steps, jnp.float32, rules)
    prefill = jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, c, rules, policy, Mode.PREFILL,
                                                         0, Output.LAST_LOGITS))
    step = jax.jit(lambda p, t, pos, c, s: model.forward(p, t, pos, c, rules, policy, Mode.APPEND,
                                                         s, Output.LAST_LOGITS))
    _, cache = prefill(params, tokens, positions, cache)
    got = []
    for i in range(steps):
        tok = np.array([seqs[b, n + i] for b, n in enumerate(lengths)], np.int32)[:, None]
        logits, cache = step(params, tok, (lengths + i)[:, None].astype(np.int32), cache,
                             np.int32(P + i))
        got.append(np.asarray(logits))
    assert len(calls) == model.num_layers  # traced once, every layer through the kernel
    for b, n in enumerate(lengths):
        ref = hf_logits(m, seqs[b: b + 1, : n + steps])[0]
        for i in range(steps):
            np.testing.assert_allclose(got[i][b], ref[n + i], atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("spec,kernels", [("llama:llama3.1-8b", 1), ("gptoss:20b", 2)])
def test_the_h100_decode_step_lowers_for_cuda_with_the_triton_kernel(monkeypatch, spec, kernels):
    """The H100 deployments' decode step at full size (abstract weights: nothing allocated), a GPU
    backend with kernels.pallas_attention, lowered for CUDA on this CPU: every layer's attention
    is a call of the Triton kernel (one kernel for Llama's layers, GPT-OSS's windowed and full
    layers one each), with the cache donated. What XLA:GPU then compiles needs the GPU
    (benchmarks/gpu_check.py). The mesh is one CPU device's, as lowering wants a real device."""
    from tests.conftest import rules_for

    monkeypatch.setattr(Backend, "resolve", classmethod(lambda cls, policy, rules: cls(
        "gpu", pallas_decode="gpu")))
    rules = rules_for("1dev")
    model = Model.named(spec)
    policy = Policy(params="bfloat16", activations="bfloat16", kv_cache="bfloat16", matmul="default")
    params = jax.eval_shape(lambda: weights.init(model.declare(), jax.random.key(0), rules,
                                                 jnp.bfloat16))
    B = 64
    cache = jax.eval_shape(lambda: model.new_cache(B, 2048, jnp.bfloat16, rules))
    rows = jax.ShapeDtypeStruct((B, 1), jnp.int32)
    step = jax.jit(lambda p, t, pos, c, s: model.forward(p, t, pos, c, rules, policy, Mode.APPEND,
                                                         s, Output.LAST_LOGITS), donate_argnums=3)
    text = step.trace(params, rows, rows, cache, jax.ShapeDtypeStruct((B,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == kernels
    assert text.count("call @decode_attention") == model.num_layers


@pytest.mark.parametrize("name,functions", [("llama3_h100.py", 1), ("gptoss_h100.py", 2)])
def test_the_h100_paged_programs_lower_for_cuda_with_the_triton_kernel(name, functions):
    """The H100 configs' paged engine (256 rows beside a chunk, their pools; weights and pools
    abstract: nothing allocated) with kernels.pallas_attention, its programs lowered for CUDA on
    this CPU: in each, every
    layer's attention over pages is a call of the Triton kernel (GPT-OSS's windowed and full
    layers one function each), a kernel for the decode rows and, in a mixed step, one for the
    chunk. What XLA:GPU then compiles needs the GPU (benchmarks/gpu_check.py)."""
    import dataclasses

    from runner.engine.build import build_engine
    from sharding.mesh import make_mesh

    s = from_config(load(os.path.join(ROOT, "configs", name)).get_config())
    s = dataclasses.replace(s, policy=dataclasses.replace(s.policy, pallas_attention=True))
    model = Model.named(s.checkpoint_model)
    rules = dataclasses.replace(Rules.make(make_mesh(s.mesh, jax.devices("cpu")[:1]), s.rules),
                                target="gpu")
    engine = build_engine(s, model, model.abstract_params(rules, s.policy), rules, allocate=False)
    assert engine.policy.backend.pallas_paged == "gpu" and engine.layout.batch_size == 256
    lowered = engine.lower(platforms=("cuda",))
    assert any(p.startswith("mixed_") for p in lowered) and any(p.startswith("decode_") for p in lowered)
    for program, low in lowered.items():
        text = low.as_text()
        assert text.count("call @paged_attention") == model.num_layers, program
        kernels = functions * (2 if program.startswith("mixed_") else 1)
        assert text.count("__gpu$xla.gpu.triton") == kernels, program
