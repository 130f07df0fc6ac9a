"""How the CPU kernels read their weights (models/kernels/cpu_kernels.h's options: kChain, the next
product's weights asked for between products; kSingleRows, short rows of W swept one at a time at
batch 1; kBalance, the rows in parts that the threads claim as they go; kPrefetchRows, at batch 1
each line of W asking for one a few KB on; kChainAttention, decode attention in that chain, its
cache rows asked for before it and the next weights during it; kOwnShareAhead, each helper asking
only for its own share of what comes next), each on and off, alternated round by round in one
process, so that the machine's swings of speed from one minute to the next fall on every setting
alike.

    python benchmarks/product_options.py --config=configs/cpu.py:<checkpoint> [--batch_size=1] \
        [--prompt_len=128] [--new_tokens=128] [--rounds=8] [--config.precision.quantize=int8] \
        [--settings="all five,all six"]

One CPU device unless the command line sets the mesh (these belong to the one-device product
kernel). With float32 weights in panels (precision.panel_weights, the default) only kChain,
kChainAttention and kOwnShareAhead concern their products: --config.precision.panel_weights=False
measures the others on W[K, N]. Per round and setting: one warm generation, then one timed; prints
the median decode step (the engine's clock, as runner.tools.bench's decode_step_s) of each setting over
the rounds, and the median over rounds of its step against the first setting's ('none' by default)
in the same round. Random prompts, no stop ids.
"""

from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from runner.cli import parse_flags, setup_devices  # noqa: E402
from runner.job import load_model  # noqa: E402
from runner.settings import from_config  # noqa: E402
from runner.tools import bench  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "deployment config file", lock_config=True)
_BATCH = flags.DEFINE_integer("batch_size", 1, "rows")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "prompt length (tokens)")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "tokens generated per row")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "rounds of every setting")
_ONLY = flags.DEFINE_list("settings", None, "the settings to alternate, the first as the base "
                          "(default: all, against 'none')")

SETTINGS = {"none": (False,) * 6, "chain": (True,) + (False,) * 5,
            "single_rows": (False, True) + (False,) * 4, "both": (True, True) + (False,) * 4,
            "both+balance": (True,) * 3 + (False,) * 3, "all four": (True,) * 4 + (False,) * 2,
            "all five": (True,) * 5 + (False,), "all six": (True,) * 6}


def main(argv: list[str]) -> None:
    c = bench.tool_config("product_options", argv, _CONFIG.value)
    s = from_config(c)
    setup_devices(s)
    from models.kernels import cpu

    if not cpu.available():
        sys.exit("product_options: error: podrun's CPU kernels cannot be built here")
    meta, rules, params = load_model(s)
    n = _NEW_TOKENS.value
    engine = bench.make_engine(s, meta.model, params, rules, _BATCH.value, (_PROMPT_LEN.value,), n)
    workload = bench.Workload((_BATCH.value,), (_PROMPT_LEN.value,), n)
    prompts = workload.prompts(_PROMPT_LEN.value, meta.model.config.vocab_size)
    requests = bench.greedy_requests(prompts, n, s)
    chosen = _ONLY.value or list(SETTINGS)
    unknown = [name for name in chosen if name not in SETTINGS]
    if unknown:
        sys.exit(f"product_options: error: unknown --settings {unknown}; one of {list(SETTINGS)}")
    settings = {name: SETTINGS[name] for name in chosen}
    steps: dict[str, list[float]] = {name: [] for name in settings}
    engine.generate(requests, stop_ids=())  # compiles
    for _ in range(_ROUNDS.value):
        for name, options in settings.items():
            cpu.set_product_options(*options)
            engine.generate(requests, stop_ids=())  # the chain learns this setting's order
            done = engine.generate(requests, stop_ids=())
            steps[name].append(done[0].decode_s / (n - 1) * 1e3)
    cpu.set_product_options()
    print(f"{meta.model.family}, batch {_BATCH.value}, {_PROMPT_LEN.value}-token prompts, "
          f"{n} new tokens, {_ROUNDS.value} rounds; ms per decode step:")
    base = steps[chosen[0]]
    for name, ms in steps.items():
        paired = statistics.median(m / b for m, b in zip(ms, base))  # robust to the machine's drift
        rounds = ", ".join(f"{x:.2f}" for x in ms)
        print(f"  {name:12s} median {statistics.median(ms):7.3f}, {paired:.3f}x {chosen[0]}'s "
              f"in the same round (median)   [{rounds}]")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
