"""Every shipped config loads, locks, says how to launch it, and its model's weights divide over
its mesh (no compiling)."""

import ast
import glob
import importlib.util
import os

import pytest

from models.registry import Model
from models.weights import check_divisible
from runner.settings import from_config
from sharding.mesh import abstract_mesh
from sharding.rules import Rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if os.path.basename(p) not in ("__init__.py", "base.py"))


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_weights_divide_over_its_mesh(path):
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    assert f"python -m runner.main --config=configs/{os.path.basename(path)}" in doc
    c = load(path).get_config("/a/checkpoint" if os.path.basename(path) == "cpu.py" else "")
    c.lock()
    with pytest.raises(AttributeError):
        c.generation.batchsize = 3  # a misspelt key fails loudly
    s = from_config(c)
    if s.checkpoint_model:  # otherwise the architecture comes from whichever checkpoint is given
        rules = Rules.make(abstract_mesh(s.mesh, s.mesh.size() or s.num_cpu_devices), s.rules)
        check_divisible(Model.named(s.checkpoint_model).declare(), rules)


def test_the_default_runs_on_one_device_and_mesh8_on_eight():
    """The README's first command takes the fast path (one device, where the CPU kernels apply);
    `:mesh8` shards the same job over 8 simulated devices."""
    config = load(os.path.join(ROOT, "configs", "smollm2_cpu.py"))
    one, eight = from_config(config.get_config()), from_config(config.get_config("mesh8"))
    assert (one.mesh.size(), one.num_cpu_devices) == (1, 1)
    assert (eight.mesh.size(), eight.num_cpu_devices, eight.mesh.data) == (8, 8, 8)
    with pytest.raises(ValueError, match="mesh8"):
        config.get_config("mesh4")


@pytest.mark.parametrize("path", ["/a/checkpoint", "gs://bucket/checkpoint", "relative/ck"])
def test_any_checkpoint_runs_on_one_device_and_mesh8_on_eight(path):
    """configs/cpu.py:<dir> takes the fast path too (one device); `<dir>:mesh8` fills a data axis
    of 8 simulated devices; a path's own ":" (gs://) is not taken for a variant."""
    config = load(os.path.join(ROOT, "configs", "cpu.py"))
    one, eight = from_config(config.get_config(path)), from_config(config.get_config(f"{path}:mesh8"))
    data = lambda s: abstract_mesh(s.mesh, s.num_cpu_devices).shape["data"]
    assert (one.checkpoint_path, one.num_cpu_devices, data(one)) == (path, 1, 1)
    assert (eight.checkpoint_path, eight.num_cpu_devices, data(eight)) == (path, 8, 8)


def test_memory_report_of_the_gptoss_deployments():
    """Weights per the model cards (gpt-oss-20b: 20.9B parameters, 120b: 116.8B), and both fit
    a v5e chip's 16 GiB with room for activations."""
    from runner.tools.memory import footprint

    for name, params in (("gptoss_v5e.py", 20.9e9), ("gptoss_120b_v5e.py", 116.8e9)):
        s = from_config(load(os.path.join(ROOT, "configs", name)).get_config())
        f = footprint(s, Model.named(s.checkpoint_model))
        assert abs(f.total_weights / 2 - params) / params < 0.01  # bf16
        assert f.weights < f.total_weights / 4  # experts really are spread out
        assert f.per_device < 0.75 * 16 * 2**30 == f.device_memory * 0.75


def test_the_gptoss_20b_deployment_splits_its_kv_cache_over_all_8_chips():
    """configs/gptoss_v5e.py shards the 8 kv heads over model x expert: each chip holds 1/8 of
    every page, counted here from the architecture, where heads over model alone leave the 4
    expert shards each a copy of half of it."""
    from runner.tools.memory import footprint

    s = from_config(load(os.path.join(ROOT, "configs", "gptoss_v5e.py")).get_config())
    model = Model.named(s.checkpoint_model)
    c, g = model.config, s.generation
    slot = c.num_kv_heads * c.head_dim * 2 * 2  # a token's keys and values in one layer, bf16
    full = sum(1 for i in range(c.num_layers) if not c.window(i))
    chips = s.mesh.size()
    f = footprint(s, model)
    assert chips == 8 and 0 < full < c.num_layers
    assert f.page_bytes * chips == g.page_size * slot * full
    assert f.window_page_bytes * chips == g.page_size * slot * (c.num_layers - full)
    # the pool is the GiB the config gives it, whole pages
    assert g.kv_cache_gib * 2**30 - f.page_bytes - f.window_page_bytes < f.kv_cache <= g.kv_cache_gib * 2**30
