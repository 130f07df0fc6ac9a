"""runner/engine/hugepages.py: the engine's CPU arrays moved onto 2 MiB pages, their values untouched.
What the kernel says (/proc/self/smaps) is the reference, not the function's own count."""

import os
import sys

import jax
import numpy as np

from models.policy import Policy
from runner.engine import Engine, Request, generate, hugepages
from tests.conftest import rules_for
from tests.reference import VOCAB, hf_greedy, tiny_hf, to_podrun


def system_gives_huge_pages() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE) with transparent huge pages not turned off."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return (major, minor) >= (6, 1) and "[never]" not in mode


def huge_kib_around(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_xla_buffer_moves_onto_huge_pages_with_its_values():
    values = np.arange(6 << 20, dtype=np.float32) * 0.5  # 24 MiB
    x = jax.jit(lambda a: a * 2.0)(jax.device_put(values, jax.devices()[0]))  # XLA's allocation
    x.block_until_ready()
    pointer = x.unsafe_buffer_pointer()
    interior = (pointer + x.nbytes) // hugepages.HUGE * hugepages.HUGE - \
        -(-pointer // hugepages.HUGE) * hugepages.HUGE  # whole 2 MiB pages inside the buffer
    done, asked = hugepages.collapse({"w": x})
    np.testing.assert_array_equal(np.asarray(x), values * 2.0)
    assert asked >= x.nbytes
    if system_gives_huge_pages():
        assert done >= interior, (done, interior)
        assert huge_kib_around(pointer + x.nbytes // 2) * 1024 >= interior
    else:
        assert done == 0


def test_an_engine_generates_the_same_on_huge_pages():
    """A tiny Llama's weights and cache through the engine with and without huge pages: what
    transformers generates either way; with them the engine reports what it moved."""
    rules = rules_for("1dev")
    m = tiny_hf("llama", seed=3)
    prompt = tuple(int(t) for t in np.random.RandomState(5).randint(0, VOCAB, 12))
    want = hf_greedy(m, prompt, 10)
    for on in (False, True):
        model, params = to_podrun(m, rules)
        engine = Engine(model, params, rules, Policy(huge_pages=on), batch_size=1, max_prompt_len=16,
                        max_new_tokens=10, page_size=16)
        assert generate(engine, [Request(prompt, 10)])[0].token_ids == want
        if not on:
            assert engine.huge_pages == (0, 0)
        else:
            assert engine.huge_pages[1] > 0
            assert (engine.huge_pages[0] > 0) == system_gives_huge_pages()
