"""AOT compilation for TPU topologies on this CPU-only machine (libtpu's topology descriptions)."""

import collections
import dataclasses
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs.base import base_config
from models import gptoss
from models.registry import Model
from models.weights import is_weight
from runner.settings import from_config
from tests.test_configs import CONFIGS, ROOT, load

# A program these tests compile for TPU a second time is found in the run's compilation cache
# (conftest.py) but cannot be loaded without a TPU client: jax says so and compiles it again.
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")


def tiny_tpu_settings(scan_layers: bool = False, **generation):
    """A tiny GPT-OSS for v5e:2x2, pages of 16 tokens."""
    c = base_config()
    c.programs.scan_layers = scan_layers
    c.checkpoint.update(path="/unused", model="gptoss:tiny")
    c.mesh.update(data=1, expert=2, model=2, num_cpu_devices=0, device_memory_gib=16.0,
                  tpu_topology="v5e:2x2")
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16", matmul="default")
    c.generation.update({"batch_size": 4, "max_prompt_len": 32, "max_new_tokens": 16, "page_size": 16,
                         **generation})
    return from_config(c)


# A small GPT-OSS whose dimensions fill TPU tiles (128 lanes), so that padding does not blur the
# bytes a chip holds.
SMALL = Model("gptoss", gptoss.Config(vocab_size=1024, hidden_size=256, intermediate_size=256,
                                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                                      num_experts=4, experts_per_token=2, sliding_window=16))


def mosaic_kernels(lowered: str) -> collections.Counter:
    """The Pallas kernels a lowered TPU program calls, by their functions' names, a count per call
    site (a kernel in both branches of a conditional is two)."""
    return collections.Counter(re.findall(r'kernel_name = "([^"]+)"', lowered))


def kernel_calls(hlo: str) -> collections.Counter:
    """The Pallas kernels a compiled TPU program calls, by name, as many times as they appear."""
    return collections.Counter(re.findall(r"%([a-z_]+)(?:\.\d+)? = [^\n]*custom_call_target=\"tpu_custom_call\"", hlo))


def test_a_deployment_compiles_its_mixed_and_decode_programs_for_a_v5e_topology():
    """runner.tools.compile builds the job's engine and compiles each chunk bucket's mixed step and
    the decode call, each taking the weights and the page pools as runner.tools.memory declares
    them: 1 MiB a chip, of pages of 1 layer (of the 2, one full and one windowed) x (k, v) x 1 kv
    head (2 over model) x 16 slots x 128 x 2 bytes. The window pool has room for every row's
    window: 16 - 1 + a chunk of 32 positions, 3 pages, and 2 more; the full layer's pool takes the
    rest. The experts and heads are split over the chips."""
    from runner.tools.compile import compile_deployment, report
    from runner.tools.memory import footprint

    s = tiny_tpu_settings(kv_cache_gib=2**-10, chunk_tokens=32)
    engine, compiled = compile_deployment(s, SMALL)
    L = engine.layout
    assert {d.platform for d in engine.rules.mesh.devices.flat} == {"tpu"}
    assert engine.rules.mesh.devices.size == 4
    assert sorted(compiled) == ["decode_8", "mixed_32"]
    assert [SMALL.config.window(i) for i in range(2)] == [16, None]
    page = 2 * 1 * 1 * 16 * 128 * 2
    window_pages = 4 * (-(-(16 - 1 + 32) // 16) + 2)
    assert (L.window_pages, L.pages) == (window_pages, 2**20 // page - window_pages) == (20, 108)
    declared = footprint(s, SMALL)
    assert (declared.pages, declared.window_pages) == (L.pages, L.window_pages)
    assert declared.kv_cache == engine.pools.bytes == 128 * page
    total = sum(math.prod(w.shape) * 2 for w in jax.tree.leaves(SMALL.declare(), is_leaf=is_weight))
    assert declared.weights < 0.75 * total  # the experts and heads really are split
    for c in compiled.values():
        assert declared.per_device <= c.argument_bytes <= declared.per_device * 1.02 + 2**14, c
        assert 4 * c.argument_bytes >= total  # everything is on some chip
        assert c.peak_bytes <= 16 * 2**30 and c.flops > 0
    assert compiled["decode_8"].alias_bytes >= declared.kv_cache  # the pools are donated
    # Each layer writes its keys and values and attends in the Pallas kernels (the mixed step
    # attends twice: the rows' tokens, then the chunk), on the pools as they are: no copy of one;
    # its experts run in the experts kernel (once, or in both branches of the overfull test).
    hlo = {name: lowered.compile().as_text() for name, lowered in engine.lower().items()}
    layers = SMALL.config.num_layers
    calls = {name: kernel_calls(text) for name, text in hlo.items()}
    assert calls["decode_8"]["write_pages"] == calls["decode_8"]["paged_attention"] * 2 == 2 * layers
    assert calls["mixed_32"]["write_pages"] == calls["mixed_32"]["paged_attention"] == 2 * layers
    for name in hlo:
        assert layers <= calls[name]["experts"] <= 2 * layers, calls[name]
        assert set(calls[name]) == {"write_pages", "paged_attention", "experts"}

    text = report(s, engine, compiled)
    assert "pool of 108 + 20 window pages x 16 tokens per group" in text and "mixed per call" in text


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_pools_of_head_dim_64_reach_the_tpu_kernels_without_a_copy(scan):
    """GPT-OSS's head_dim of 64 on TPU: the pools are stored folded, two slots a row of 128
    lanes, and the decode program hands them to the Pallas kernels as they are. Unfolded
    ([.., 16, 64]), XLA lays a pool out pages minor-most and copies it, whole, around every
    kernel call (checked by hand: a copy of each pool per layer and step). scan: 4 layers in a
    loop over pools stacked 2 deep, which it carries: its body (once in the program) calls the
    kernels for one period of 2 layers, on neither a copy of a pool nor of one layer's pages."""
    from runner.tools.compile import compile_deployment

    config = dataclasses.replace(SMALL.config, head_dim=64, num_layers=4 if scan else 2)
    model = dataclasses.replace(SMALL, config=config)
    s = tiny_tpu_settings(scan, kv_cache_gib=2**-10, chunk_tokens=32)
    engine, _ = compile_deployment(s, model, only=("decode_8",))
    assert engine.cache.k[0].shape[3:] == (8, 128)
    depth = 2 if scan else 1
    L = engine.layout
    assert [x.shape[1] for x in engine.cache.k] == [depth * L.window_pages, depth * L.pages]
    # a chip's: 1 of the 2 kv heads, and of those one layer's
    pools = {math.prod(x.shape) // 2 // n for x in engine.cache.k for n in {1, depth}}
    text = engine.lower()["decode_8"].compile().as_text()
    calls = kernel_calls(text)
    assert (calls["write_pages"], calls["paged_attention"]) == (2 * 2, 2), calls
    copies = {math.prod(int(d) for d in m.group(1).split(",")) for m in re.finditer(
        r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", text)}
    assert not copies & pools


def test_a_program_too_large_for_the_chip_is_reported_as_not_fitting():
    """A pool of 20 GiB a chip: XLA:TPU refuses the decode program, and the report says so in its
    row instead of a traceback."""
    from runner.tools.compile import compile_deployment, report

    s = tiny_tpu_settings(kv_cache_gib=20.0)
    engine, compiled = compile_deployment(s, SMALL, only=("decode_8",))
    assert "Ran out of memory" in compiled["decode_8"].error
    assert "does not fit: Ran out of memory" in report(s, engine, compiled)


def test_a_two_slice_deployment_compiles_with_data_across_the_slices():
    from runner.tools.compile import compile_deployment

    c = base_config()
    c.checkpoint.update(path="/unused", model="gptoss:tiny")
    c.mesh.update(data=2, expert=2, model=2, num_cpu_devices=0, tpu_topology="v5e:2x2")
    c.mesh.dcn.data = 2
    c.generation.update(batch_size=4, max_prompt_len=16, max_new_tokens=8)
    engine, compiled = compile_deployment(from_config(c))
    mesh = engine.rules.mesh
    assert mesh.devices.size == 8 and {d.slice_index for d in mesh.devices[0].flat} == {0}
    assert {d.slice_index for d in mesh.devices[1].flat} == {1}
    assert sorted(compiled) == ["decode_8", "mixed_24"]  # the paged engine's, one chunk of 24


def test_asking_for_a_program_the_deployment_lacks_names_it_and_compiles_nothing():
    from runner.tools.compile import compile_deployment

    with pytest.raises(ValueError, match=r"no program \['mixed_7'\] to compile; .*'decode_8'"):
        compile_deployment(tiny_tpu_settings(), SMALL, only=("decode_8", "mixed_7"))


def run_compile(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "runner.tools.compile", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("override,message", [
    ("--config.mesh.tpu_topology=", "sets no mesh.tpu_topology"),
    ("--config.mesh.expert=8", "are visible"),  # 8*2 chips asked of a v5e:2x4 (8 chips)
    ("--config.mesh.tpu_topology=v5e:3x3x3", "tpu_topology='v5e:3x3x3'"),
    # GPT-OSS's pools on TPU hold two slots of head_dim 64 a row
    ("--config.generation.page_size=15", "generation.page_size=15 must be a multiple of 2"),
])
def test_bad_compile_requests_fail_in_one_line(override, message):
    r = run_compile("--config=configs/gptoss_v5e.py", override)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("podrun compile: error:") and message in last, r.stderr[-2000:]


TPU_CONFIGS = [p for p in CONFIGS if load(p).get_config().mesh.tpu_topology]


def test_the_gptoss_deployments_name_a_topology_with_as_many_chips_as_their_mesh():
    assert {os.path.basename(p) for p in TPU_CONFIGS} >= {"gptoss_v5e.py", "gptoss_120b_v5e.py"}
    for p in TPU_CONFIGS:
        m = load(p).get_config().mesh
        chips = np.prod([int(n) for n in m.tpu_topology.split(":")[1].split("x")])
        assert m.data * m.expert * m.model * m.sequence == chips, p


@pytest.mark.slow
@pytest.mark.parametrize("path", TPU_CONFIGS, ids=os.path.basename)
def test_every_shipped_tpu_config_compiles_and_fits(path):
    r = run_compile(f"--config={os.path.relpath(path, ROOT)}")
    assert r.returncode == 0, r.stderr[-3000:]
    programs = re.compile(r"\s+(decode|mixed_)\S*\s+\d")  # a program's row of figures
    rows = [line.split() for line in r.stdout.splitlines() if programs.match(line)]
    assert any(row[0] == "decode_8" for row in rows), r.stdout
    assert all(float(row[4].rstrip("%")) <= 100 for row in rows), r.stdout



def gptoss_20b_settings(**policy):
    """configs/gptoss_v5e.py with 64 rows of 1,024 + 1,024 tokens, one decode step a call, its
    pool holding every row at its longest, and `policy` changes."""
    s = from_config(load(os.path.join(ROOT, "configs", "gptoss_v5e.py")).get_config())
    g = dataclasses.replace(s.generation, batch_size=64, max_prompt_len=1024, max_new_tokens=1024,
                            steps_per_dispatch=1, kv_cache_gib=0.0)
    return dataclasses.replace(s, generation=g, policy=dataclasses.replace(s.policy, **policy))


def gptoss_20b_decode(options=None, layers=2, **policy):
    """gptoss_20b_settings' decode step (GPT-OSS-20B cut to `layers`) compiled for v5e with XLA
    `options`: (model, rules, compiled)."""
    from jax.experimental import topologies

    from runner.engine.build import build_engine
    from sharding.mesh import make_mesh
    from sharding.rules import Rules

    s = gptoss_20b_settings(**policy)
    model = Model.named(s.checkpoint_model)
    # Two of its 24 layers (one sliding-window, one full): every layer's tensors keep their real
    # sizes and shardings, and the program compiles in a third of the time (46-62 s -> 12-19 s).
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, num_layers=layers))
    topo = topologies.get_topology_desc(platform="tpu", topology_name=s.tpu_topology)
    rules = Rules.make(make_mesh(s.mesh, topo.devices), s.rules)
    engine = build_engine(s, model, model.abstract_params(rules, s.policy), rules, allocate=False)
    return model, rules, engine.lower()["decode_1"].compile(compiler_options=options)


@pytest.mark.slow  # GPT-OSS-20B's decode step compiled for v5e (about a minute)
def test_the_gptoss_embedding_reaches_the_decode_step_row_major_and_is_not_copied():
    """GPT-OSS-20B's decode step for v5e (one step per call): the embedding table is an input laid
    out row-major, as its gather reads it. Left to choose, XLA:TPU laid it out column-major and
    copied the whole table (1.2 GB per chip) back to row-major on every step."""
    import re

    model, rules, compiled = gptoss_20b_decode()
    embed = compiled.input_formats[0][0][0]["embed"]  # the first argument: (params, screen)
    assert embed.layout.major_to_minor == (0, 1), embed
    rows = model.config.vocab_size // rules.shards("vocab")
    table = rf"bf16\[{rows},{model.config.hidden_size}\]"
    assert not re.search(rf"= {table}\{{[^}}]*\}} copy\(", compiled.as_text())


def test_int8_gptoss_experts_are_not_dequantised_into_a_copy_on_every_decode_step():
    """GPT-OSS-20B's decode step for v5e with int8 experts: no instruction of the program (outside
    the fusions, whose insides stay on chip) writes a bf16 tensor as large as a layer's experts on
    a chip; the conversion stays folded into the products. Converted outside the conditional that
    picks the capacity, every layer's experts were written out dequantised on every step (14.0 GB
    accessed per step against 4.3)."""
    import re

    _, _, compiled = gptoss_20b_decode(quantize="int8")
    text = compiled.as_text()
    fused = set(re.findall(r"calls=%([\w.\-]+)", text))
    largest, computation = 0, None
    for line in text.splitlines():
        if (m := re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)) and "(" in line:
            computation = m.group(1)
        elif computation not in fused and (m := re.match(r"\s*(?:ROOT )?%\S+ = bf16\[([\d,]+)\]", line)):
            if not re.search(r" (parameter|bitcast|get-tuple-element)\(", line):
                largest = max(largest, math.prod(int(d) for d in m.group(1).split(",")))
    experts = 8 * 2 * 1440 * 2880  # a layer's w_gate_up on a chip: 8 experts, F over 2
    assert largest < experts, largest


# slow (2-3 minutes each on 2 cores): GPT-OSS-20B's whole decode step compiled for v5e
@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_gptoss_decode_step_accesses_at_most_a_quarter_more_than_its_floor_on_v5e(quantize):
    """The TPU target: GPT-OSS-20B's decode step for v5e (batch 64, all 24 layers, as two layers
    understate it), by XLA's cost analysis with VMEM prefetches off (it counts each as extra
    traffic), accesses at most 1.25x the bytes a chip must read: its weights and KV cache as
    declared (runner.tools.memory)."""
    from runner.tools.memory import footprint

    s = gptoss_20b_settings(quantize=quantize)
    model, _, compiled = gptoss_20b_decode({"xla_vf_vmem_memory_space_assignment": False},
                                           layers=24, quantize=quantize)
    cost = compiled.cost_analysis()
    accessed = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
    assert accessed <= 1.25 * footprint(s, model).per_device, (accessed, footprint(s, model))


def test_the_programs_a_request_compiles_when_it_asks_compile_for_a_v5e_topology():
    """With variants, runner.tools.compile also compiles what log-probabilities compile: the decode
    call's, and the largest mixed step's with every chunk token's. Each takes the weights and pools
    as declared, and fits the chip."""
    from runner.tools.compile import compile_deployment
    from runner.tools.memory import footprint

    s = tiny_tpu_settings(kv_cache_gib=2**-10, chunk_tokens=32)
    variants = ("decode_8_logprobs", "mixed_32_logprobs_prompt_logprobs")
    engine, compiled = compile_deployment(s, SMALL, only=variants, variants=True)
    assert sorted(compiled) == sorted(variants)
    assert "mixed_32" in engine.lower(variants=True)
    declared = footprint(s, SMALL)
    for c in compiled.values():
        assert declared.per_device <= c.argument_bytes <= declared.per_device * 1.02 + 2**14, c
        assert c.peak_bytes <= 16 * 2**30
    # the token log-probabilities: the [rows, steps, 20] top ids and values come out of the decode
    assert compiled["decode_8_logprobs"].output_bytes >= 4 * 8 * 20 * 2 * 4


def test_without_donation_the_decode_step_writes_a_new_cache():
    """programs.donate_cache=False: no output of the decode program reuses an input buffer, and
    the program never needs less memory; donated (the default), the cache is aliased. How much
    more the copy costs is the compiler's to decide (up to a whole cache)."""
    from runner.tools.compile import compile_deployment
    from runner.tools.memory import footprint

    s = tiny_tpu_settings()
    kept = dataclasses.replace(s, policy=dataclasses.replace(s.policy, donate_cache=False))
    _, donated = compile_deployment(s, SMALL, only=("decode_8",))
    _, copied = compile_deployment(kept, SMALL, only=("decode_8",))
    cache = footprint(s, SMALL).kv_cache
    assert donated["decode_8"].alias_bytes >= cache and copied["decode_8"].alias_bytes == 0
    assert copied["decode_8"].peak_bytes >= donated["decode_8"].peak_bytes


def test_pinning_the_lookup_tables_keeps_their_values_and_shards(monkeypatch):
    """The TPU-only step of Model.prepare and abstract_params, run on CPU arrays with the rules
    told they are on TPU. Abstract: the GPT-OSS embedding gets an explicit row-major layout (None
    without the pin). Restored: it is re-placed with that layout (CPU's default already, so what
    this checks is that the re-placement keeps sharding and values); the unembedding, a product,
    is left alone."""
    import jax.numpy as jnp

    from models.policy import Policy
    from models.weights import pin_tables_row_major
    from sharding.rules import Rules
    from tests.conftest import rules_for
    from tests.reference import tiny_hf, to_podrun

    rules = rules_for("data2_model4")
    model, params = to_podrun(tiny_hf("gptoss"), rules)
    before = np.asarray(params["embed"])
    monkeypatch.setattr(Rules, "platform", property(lambda self: "tpu"))
    assert Policy().on(rules).backend.row_major_tables
    pinned = pin_tables_row_major(model.declare(), params)
    assert pinned["embed"].format.layout.major_to_minor == (0, 1)
    assert pinned["embed"].sharding == params["embed"].sharding
    np.testing.assert_array_equal(np.asarray(pinned["embed"]), before)
    assert pinned["unembed"] is params["unembed"]
    abstract = model.abstract_params(rules, Policy())  # pinned by the backend
    assert abstract["embed"].format.layout.major_to_minor == (0, 1)
    assert abstract["unembed"].dtype == jnp.float32


def test_on_tpu_the_experts_down_projection_is_held_for_the_experts_kernel(monkeypatch):
    """The TPU step of Model.prepare and abstract_params for the experts kernel, run on CPU arrays
    with the rules told they are on a TPU v5e (the kernel's chips: v5e, v6e): each layer's w_down
    [E, D, F] becomes w_down_rows [E, F, D], its transpose, sharded over the same mesh axes; other
    weights are left alone."""
    from models import gptoss
    from models.policy import Policy
    from sharding.rules import Rules
    from tests.conftest import rules_for
    from tests.reference import tiny_hf, to_podrun

    rules = rules_for("data2_model4")
    model, params = to_podrun(tiny_hf("gptoss"), rules)
    before = [np.asarray(layer["w_down"]) for layer in params["layers"]]
    spec = params["layers"][0]["w_down"].sharding.spec
    monkeypatch.setattr(Rules, "platform", property(lambda self: "tpu"))
    monkeypatch.setattr(Rules, "device_kind", property(lambda self: "TPU v4"))
    assert not Policy().on(rules).backend.experts_kernel  # another chip: XLA's experts
    monkeypatch.setattr(Rules, "device_kind", property(lambda self: "TPU v5 lite"))
    assert Policy().on(rules).backend.experts_kernel
    assert not Policy(pallas_moe=True).on(rules).backend.experts_kernel
    assert not Policy(quantize="int8").on(rules).backend.experts_kernel
    held = gptoss.for_backend(params, rules, Policy().on(rules).backend)
    for layer, w in zip(held["layers"], before):
        assert "w_down" not in layer
        np.testing.assert_array_equal(np.asarray(layer["w_down_rows"]), np.swapaxes(w, 1, 2))
        assert tuple(layer["w_down_rows"].sharding.spec) == (spec[0], spec[2], spec[1])
    abstract = model.abstract_params(rules, Policy())["layers"][0]
    assert "w_down" not in abstract
    assert abstract["w_down_rows"].shape == (model.config.num_experts, model.config.intermediate_size,
                                             model.config.hidden_size)


def test_gptoss_20b_experts_read_little_more_than_their_weights_in_a_256_row_step_on_v5e():
    """One layer's mixture of experts of configs/gptoss_v5e.py, 256 decode tokens, compiled for
    v5e:2x4 (XLA's AOT cost analysis, VMEM prefetches off): the experts kernel reads each local
    expert's weights once and writes only the tokens' outputs, so the block's bytes per chip stay
    within 1.12x its experts' (tiled: D and F are no multiples of 128 lanes). XLA's buckets
    (kernels.enabled=False) wrote and read each expert's rows, products and outputs: 1.21x."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import tpu_moe_bytes

    for kernels, low, high in [(True, 1.0, 1.12), (False, 1.15, 2.0)]:
        accessed, experts = tpu_moe_bytes.measure(os.path.join(ROOT, "configs", "gptoss_v5e.py"), 256,
                                                  f"kernels.enabled={kernels}")
        assert low * experts <= accessed <= high * experts, (kernels, accessed / experts)


def test_the_experts_compile_as_the_pallas_grouped_matmul_for_tpu():
    """With kernels.pallas_moe (podrun's own TPU kernels off, so that no other Mosaic call is
    there) the programs that route many tokens (a mixed step; the decode call at batch 4 x 2
    experts over 2 local experts) run the experts in megablox's grouped matmul, a Mosaic custom
    call, in the program compiled for v5e; without it, none."""
    from runner.tools.compile import compile_deployment

    for moe in (True, False):
        s = tiny_tpu_settings()
        s = dataclasses.replace(s, policy=dataclasses.replace(s.policy, pallas_moe=moe, kernels=False))
        engine, _ = compile_deployment(s, SMALL, only=("decode_8",))
        lowered = engine.lower()
        assert sorted(lowered) == ["decode_8", "mixed_48"]  # a chunk: the 32 + 16 tokens of a row
        for name, program in lowered.items():
            assert ("tpu_custom_call" in program.as_text()) == moe, (name, moe)


def test_update_weights_moves_each_chips_declared_shards_from_fsdp():
    """The move of a trainer's FSDP weights onto the deployment's shardings, compiled for v5e:2x2:
    what a chip receives is its shards of every weight as the rules split them (numpy over the
    declared shapes), and what it gives is a quarter of each weight that the chip count divides."""
    from jax.experimental import topologies

    from runner.tools.compile import compile_update
    from sharding.mesh import make_mesh
    from sharding.rules import Rules

    s = tiny_tpu_settings()
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    rules = Rules.make(make_mesh(s.mesh, topo.devices), s.rules)
    u = compile_update(s, SMALL, rules)
    decl = [w for w in jax.tree.leaves(SMALL.declare(), is_leaf=is_weight)]
    shard = lambda w: math.prod(d // math.prod(rules.mesh.shape[a] for a in (
        (axes,) if isinstance(axes, str) else axes or ())) for d, axes in zip(
        w.shape, rules.spec(*w.axes, shape=w.shape)))
    # bfloat16; XLA:TPU pads small arrays (biases, sinks) to its tiles: under 1%
    assert u.output_bytes == pytest.approx(2 * sum(shard(w) for w in decl), rel=0.01)
    split = lambda w: math.prod(w.shape) // (4 if any(d % 4 == 0 for d in w.shape) else 1)
    assert u.argument_bytes == pytest.approx(2 * sum(split(w) for w in decl), rel=0.01)
