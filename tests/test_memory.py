"""runner.tools.memory: the page pools' bytes per device and the rows the KV memory admits,
against arithmetic from the model's declared shapes."""

import os
import subprocess
import sys

from configs.base import base_config
from models.registry import Model
from runner.settings import from_config
from tests.test_configs import ROOT, load

GiB = 2**30


def gptoss_v5e(**generation):
    """configs/gptoss_v5e.py (GPT-OSS-20B on v5e:2x4, 16 GiB a chip) with 64 rows of up to 1,024
    prompt and 16,384 new tokens, its pool sized for them (kv_cache_gib 0), unless given."""
    c = load(os.path.join(ROOT, "configs", "gptoss_v5e.py")).get_config()
    c.generation.update({"batch_size": 64, "max_prompt_len": 1024, "max_new_tokens": 16384,
                         "kv_cache_gib": 0.0, **generation})
    s = from_config(c)
    return s, Model.named(s.checkpoint_model)


def test_a_deployments_kv_cache_is_its_pools_of_pages_per_device():
    """GPT-OSS-20B: 12 full-attention and 12 windowed layers (128 positions); a page of 12 layers
    x (k, v) x 1 kv head a chip (8 over model x expert) x 16 slots x 64 x 2 bytes in either pool.
    The window pool has room for every row's window (127 + a chunk of 256 positions: 24 pages, and
    2 more); the full layers' pool takes the rest of 6 GiB. At a mean of 3,000 tokens (188 pages)
    a row, that pool admits 555 of 1,024 rows; device memory beside the weights admits the rows
    of 188 + 26 pages it holds. The prefix pool does not exist (pages are shared)."""
    from runner.tools.memory import describe, footprint

    s, model = gptoss_v5e(page_size=16, kv_cache_gib=6.0, batch_size=1024)
    c = model.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (24, 8, 64)
    windowed = [i for i in range(24) if c.window(i)]
    assert len(windowed) == 12 and {c.window(i) for i in windowed} == {128}
    page = 2 * 12 * (8 // 8) * 16 * 64 * 2
    row_window = -(-(128 - 1 + 256) // 16) + 2
    window_pages = 1024 * row_window
    pages = (6 * GiB - window_pages * page) // page
    assert (row_window, window_pages, pages) == (26, 26624, 104448)
    f = footprint(s, model)
    assert (f.page_size, f.pages, f.page_bytes) == (16, pages, page)
    assert (f.window_pages, f.window_page_bytes, f.window_row_pages) == (window_pages, page, 26)
    assert f.kv_cache == (pages + window_pages) * page == 6 * GiB
    assert f.per_device == f.weights + 6 * GiB

    per_row = -(-3000 // 16)
    assert per_row == 188
    assert f.pool_rows(3000) == pages // per_row == 555  # a batch of 1,024: the pool decides
    assert footprint(gptoss_v5e(page_size=16, kv_cache_gib=6.0, batch_size=256)[0],
                     model).pool_rows(3000) == 256  # the batch decides
    in_memory = (16 * GiB - f.weights) // ((per_row + 26) * page)
    assert f.memory_rows(3000) == in_memory and in_memory > 1000

    text = describe(f, model, mean_tokens=3000)
    assert f"pool of {pages} + {window_pages} window pages x 16 tokens per group" in text
    assert f"page pool {pages} pages per group, {pages} in all (1 group): {pages * 16} tokens" in text
    assert f"window pool {window_pages} pages per group, 26 a row" in text
    assert ("rows admitted at a mean of 3000 tokens (188 pages a row, + 26 window pages): 555 of "
            "batch 1024") in text
    assert f"rows admitted in device memory at a mean of 3000 tokens: {in_memory} " in text
    assert "rows admitted" not in describe(f, model)  # no --mean_tokens, no rows
    assert "fewer pages" not in text


def test_without_kv_cache_gib_the_pool_holds_every_row_at_its_longest():
    """kv_cache_gib=0: as the Engine without kv_bytes, rows per group x pages of the longest
    request in the full layers' pool; too little for one request is said."""
    from runner.tools.memory import describe, footprint, pools
    from sharding.mesh import abstract_mesh
    from sharding.rules import Rules

    s, model = gptoss_v5e(page_size=16, batch_size=64)
    longest = -(-(1024 + 16384) // 16)
    f = footprint(s, model)
    assert (f.pages, f.window_pages, f.max_pages) == (64 * longest, 64 * 26, longest)
    assert f.kv_cache == (64 * longest + 64 * 26) * 2 * 12 * 1 * 16 * 64 * 2
    rules = Rules.make(abstract_mesh(s.mesh, 8), s.rules)
    p = pools(s, model, rules)
    assert (p.pages, p.window_pages) == (f.pages, f.window_pages)

    small, _ = gptoss_v5e(page_size=16, kv_cache_gib=0.05)
    assert f"fewer pages than the {longest} of one request" in describe(footprint(small, model), model)


def test_groups_over_the_data_axis_each_hold_their_own_pages():
    """data=2: two groups of 3 rows, a device holding its group's pages; rows admitted count both.
    int8 keys and values add a float32 scale per slot and head."""
    from runner.tools.memory import footprint

    c = base_config()
    c.checkpoint.update(path="/unused", model="gptoss:tiny")
    c.mesh.update(data=2, model=2, expert=1, num_cpu_devices=4, device_memory_gib=1.0)
    c.precision.kv_cache = "int8"
    c.generation.update(batch_size=6, max_prompt_len=32, max_new_tokens=32, page_size=8,
                        chunk_tokens=16, kv_cache_gib=2**-10)  # 1 MiB per device
    s = from_config(c)
    model = Model.named("gptoss:tiny")  # 2 layers (one windowed, of 8), 4 kv heads of 16
    page = 2 * 1 * (4 // 2) * 8 * (16 + 4)
    window_pages = 3 * (-(-(8 - 1 + 16) // 8) + 2)
    pages = (2**20 - window_pages * page) // page
    f = footprint(s, model)
    assert (f.page_bytes, f.window_page_bytes, f.data_shards, f.batch_size) == (page, page, 2, 6)
    assert (f.pages, f.window_pages) == (pages, window_pages) == (pages, 15)
    assert f.kv_cache == (pages + window_pages) * page
    assert f.pool_rows(40) == min(6, 2 * (pages // 5)) == 6
    assert f.pool_rows(8 * pages) == 2  # one row a group
    assert f.memory_rows(40) == (GiB - f.weights) // ((5 + 5) * page) * 2


def test_the_memory_command_takes_mean_tokens():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "runner.tools.memory", "--config=configs/gptoss_v5e.py",
                        "--config.generation.batch_size=64", "--config.generation.max_prompt_len=1024",
                        "--config.generation.page_size=16", "--config.generation.kv_cache_gib=6",
                        "--mean_tokens=3000"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pool of 129408 + 1664 window pages x 16 tokens per group" in r.stdout
    assert "(188 pages a row, + 26 window pages): 64 of batch 64 by the pool" in r.stdout
