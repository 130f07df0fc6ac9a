"""What of the GPU deployment a CPU can check: the platform chosen on an NVIDIA machine, the
kernels a GPU mesh runs (traced over stand-in GPU devices: the Pallas (Triton) attention over
pages, nothing CPU- or TPU-only), the H100 configs' fit, and the transformers peer's architecture.
The speed is benchmarks/gpu_check.py's, on a real GPU (docs/benchmarks/gpu-h100.md)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from models import weights
from models.backend import Backend
from models.decoder import Output
from models.kernels import cpu, gpu, tpu
from models.policy import Policy
from models.registry import Model
from runner import log
from runner.settings import from_config
from runner.tools.memory import footprint
from sharding.mesh import MESH_AXES
from sharding.rules import Rules
from tests.conftest import rules_for
from tests.forward import Rows
from tests.reference import hf_logits, ragged_batch, tiny_hf, to_podrun
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
    """Every CPU- and TPU-only kernel fails if a GPU program reaches it; the GPU kernel's calls
    are counted."""
    def forbidden(*a, **k):
        raise AssertionError("a CPU- or TPU-only kernel on a GPU mesh")

    monkeypatch.setattr(cpu, "available", forbidden)
    for name in ("ragged_paged_attention", "paged_attention", "write_pages", "experts"):
        monkeypatch.setattr(tpu, name, forbidden)
    calls = {"paged_attention": 0}
    real = gpu.paged_attention

    def counted(*args, **kw):
        calls["paged_attention"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(gpu, "paged_attention", counted)
    return calls


@pytest.mark.parametrize("spec,quantize,kv", [("llama:tiny", "none", "bfloat16"),
                                              ("llama:tiny", "int8", "int8"),
                                              ("llama:tiny", "int4", "bfloat16"),
                                              ("gptoss:tiny", "none", "bfloat16")])
@pytest.mark.parametrize("pallas", [True, False], ids=["pallas_attention", "xla_attention"])
def test_a_gpu_mesh_runs_its_kernels_and_nothing_cpu_or_tpu_only(tripwires, spec, quantize, kv,
                                                                  pallas):
    """Every switch of the CPU and TPU kernels on, as a config could leave them: on a GPU mesh the
    attention over pages of a mixed step (decode rows and a prompt's chunk) and of a decode step
    goes to the Triton kernel with kernels.pallas_attention (sinks, windows and an int8 pool
    included) and to XLA without, the page writes and the products to XLA (quantised ones too)."""
    rules = gpu_rules()
    model = Model.named(spec)
    policy = Policy(params="bfloat16", activations="bfloat16", kv_cache=kv, matmul="default",
                    quantize=quantize, kernels=True, pallas_attention=pallas,
                    pallas_moe=True).on(rules)
    assert policy.backend == Backend("gpu", pallas_paged="gpu" if pallas else "")
    decl = model.declare()
    params = jax.eval_shape(lambda: weights.init(decl, jax.random.key(0), rules, jnp.bfloat16))
    if quantize != "none":  # the quantised layout, without quantising anything
        from models import quant
        params = quant.abstract_tree(decl, rules, jnp.dtype(jnp.bfloat16), quantize)
    pool, tables = jax.eval_shape(lambda: model.paged_cache(1, 2, 24, rules, policy))

    def run(params, tokens, positions, rows, pool, tables):
        return model.forward(params, tokens, positions, pool.at(tables, tables, rows), rules,
                             policy, Output.LOGITS)

    layers = model.num_layers
    for calls, T in ((1, 2 + 16), (2, 2)):  # a mixed step's 2 decode rows and 16 chunk tokens
        ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
        jax.make_jaxpr(run)(params, ids, ids, ids, pool, tables)
        assert tripwires == {"paged_attention": calls * layers if pallas else 0}


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
    (the Triton kernel's check fails here, so the later steps keep XLA's attention over pages)."""
    import json
    import subprocess

    out = tmp_path / "out"
    env = dict(os.environ, HOME=str(tmp_path))  # its compilation cache, not the user's
    p = subprocess.run([sys.executable, "benchmarks/gpu_check.py", f"--out={out}", "--small"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads((out / "gpu_check.json").read_text())
    steps = got["steps"]
    # no Triton on a CPU: the kernel's A/B steps are left out, the rest keep XLA's attention
    assert steps["paged_kernel"]["rc"] != 0
    ran = ["preflight", "tiny", "throughput", "plan", "decode", "prefill", "fused", "scan_dsf", "gptoss"]
    assert sorted(steps) == sorted(ran + ["paged_kernel"])
    for name in ran:
        assert steps[name]["rc"] == 0, (name, steps[name].get("log_tail"))
    assert "pallas_attention" not in steps["throughput"]["command"]
    assert sorted(r["batch_size"] for r in steps["decode"]["records"]) == [1, 2, 4]
    assert sorted(r["batch_size"] for r in steps["gptoss"]["records"]) == [1, 2]
    # vLLM's throughput workload, shrunk: every answer runs its max_tokens
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
    """A GPU backend's attention over pages (kernels.pallas_attention) on CPU devices, the Triton
    kernel run by Pallas' interpreter inside the model's shard_map: ragged prompts in chunks of 5
    over pages of 4, then decoded token by token; every prompt position's and every step's logits
    against transformers'. GPT-OSS brings sinks and windowed layers (a window of 8)."""
    calls = []
    real = gpu.paged_attention

    def interpreted(*args, **kw):
        calls.append(args[1].shape)
        return real(*args, **kw, interpret=True)

    monkeypatch.setattr(gpu, "paged_attention", interpreted)
    # the backend a GPU mesh resolves, on this mesh of CPU devices
    monkeypatch.setattr(Backend, "resolve", classmethod(lambda cls, policy, rules: cls(
        "gpu", pallas_paged="gpu")))
    rules = rules_for(mesh)
    m = tiny_hf(kind)
    model, params = to_podrun(m, rules)
    B, P, steps = 8, 12, 6
    lengths, seqs = ragged_batch(4, B, P, steps, shortest=2)
    rows = Rows(model, params, rules, Policy(), B, P + steps)
    prompts = rows.prefill([seqs[b, :n] for b, n in enumerate(lengths)], chunk=5)
    got = [rows.step([seqs[b, n + i] for b, n in enumerate(lengths)]) for i in range(steps)]
    assert len(calls) == 2 * model.num_layers  # a mixed step and a decode step, each layer's
    for b, n in enumerate(lengths):
        ref = hf_logits(m, seqs[b: b + 1, : n + steps])[0]
        np.testing.assert_allclose(prompts[b], ref[:n], atol=3e-4, rtol=1e-4)
        for i in range(steps):
            np.testing.assert_allclose(got[i][b], ref[n + i], atol=3e-4, rtol=1e-4)


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
