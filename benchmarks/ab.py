"""A boolean precision switch off and on, alternated round by round in one process, so that the
machine's swings of speed from one minute to the next fall on both settings alike.

    python benchmarks/ab.py --config=configs/cpu.py:<checkpoint> --switch=greedy_screen \
        [--batch_size=1] [--prompt_len=128] [--new_tokens=128] [--rounds=10]

One engine per setting (each restores and prepares the weights as its policy says), one CPU device
unless the command line sets the mesh. Per round and setting, in alternating order: a 1-token
generation (prefill, wall time) and a new_tokens generation (decode step on the engine's clock, as
runner.tools.bench's decode_step_s). Prints the medians of each setting and the median over rounds of
on / off within a round, and whether both settings gave the same greedy tokens. Random prompts,
no stop ids. Each round first measures the machine's read bandwidth (runner.tools.bench's probe,
--probe_mib, 0 for none), and the on / off ratios are given again for the rounds above and below
its median: on the 2-core VM the bandwidth moved between about 33 and 60 GB/s from one minute to
the next, and what a change gains can depend on which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from runner.checkpoints.load import load_model  # noqa: E402
from runner.cli import parse_flags, setup_devices  # noqa: E402
from runner.engine import generate  # noqa: E402
from runner.settings import from_config  # noqa: E402
from runner.tools import bench  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "deployment config file", lock_config=True)
_SWITCH = flags.DEFINE_string("switch", None, "a boolean field of the precision policy")
_BATCH = flags.DEFINE_integer("batch_size", 1, "rows")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "prompt length (tokens)")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "tokens generated per row")
_ROUNDS = flags.DEFINE_integer("rounds", 10, "rounds of both settings")
_PROBE_MIB = flags.DEFINE_integer("probe_mib", 256, "MiB the bandwidth probe reads (0: none)")


def main(argv: list[str]) -> None:
    c = bench.tool_config("ab", argv, _CONFIG.value)
    s = from_config(c)
    switch = _SWITCH.value
    if not isinstance(getattr(s.policy, switch or "", None), bool):
        booleans = [f.name for f in dataclasses.fields(s.policy)
                    if isinstance(getattr(s.policy, f.name), bool) and f.name != "backend"]
        sys.exit(f"ab: error: --switch={switch} is not a boolean precision field; one of {booleans}")
    setup_devices(s)
    n, B, P = _NEW_TOKENS.value, _BATCH.value, _PROMPT_LEN.value
    engines, requests = {}, None
    for on in (False, True):
        s_on = dataclasses.replace(s, policy=dataclasses.replace(s.policy, **{switch: on}))
        meta, rules, params = load_model(s_on)
        engines[on] = bench.make_engine(s_on, meta.model, params, rules, B, (P,), n)
        if requests is None:
            prompts = bench.Workload((B,), (P,), n).prompts(P, meta.model.config.vocab_size)
            requests = bench.greedy_requests(prompts[:B], n, s)
    tokens = {}
    for on, engine in engines.items():  # compiles, and the tokens to compare
        generate(engine, requests, stop_ids=())
        tokens[on] = [c.token_ids for c in generate(engine, requests, stop_ids=())]
    first = [dataclasses.replace(r, max_tokens=1) for r in requests]
    prefill = {False: [], True: []}
    step = {False: [], True: []}
    gbps = []
    with (bench.BandwidthProbe(_PROBE_MIB.value) if _PROBE_MIB.value
          else contextlib.nullcontext()) as probe:
        for i in range(_ROUNDS.value):
            gbps.append(probe() if probe else 0.0)
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                generate(engines[on], first, stop_ids=())
                prefill[on].append(time.perf_counter() - t0)
                done = generate(engines[on], requests, stop_ids=())
                step[on].append(done[0].decode_s / (n - 1))

    def paired(x: dict, rounds: list[int]) -> str:
        if not rounds:
            return "-"
        return f"{statistics.median(x[True][i] / x[False][i] for i in rounds):.3f}"

    everything = list(range(_ROUNDS.value))
    middle = statistics.median(gbps)
    fast = [i for i in everything if gbps[i] > middle]
    slow = [i for i in everything if gbps[i] <= middle]
    print(f"{switch} off / on, batch {B}, {P}-token prompts, {n} new tokens, {_ROUNDS.value} "
          f"rounds, alternated in one process")
    if probe:
        print(f"  read bandwidth {min(gbps):.1f}-{max(gbps):.1f} GB/s, median {middle:.1f}")
    for name, x in (("prefill", prefill), ("decode step", step)):
        print(f"  {name:11s} off {1e3 * statistics.median(x[False]):8.3f} ms, on "
              f"{1e3 * statistics.median(x[True]):8.3f} ms; on / off in a round (median) "
              f"{paired(x, everything)}" + (f" (rounds above the median bandwidth "
                                            f"{paired(x, fast)}, the others {paired(x, slow)})"
                                            if probe else ""))
    print(f"  greedy tokens the same: {tokens[False] == tokens[True]}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
