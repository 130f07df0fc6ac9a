"""podrun in the shared peer benchmark kit (../shared/peers): driven by the kit's own harness
(bench_common.run) exactly like transformers, llama.cpp and MaxText, so compare.py lists it beside
them with its greedy agreement against the transformers reference.

    python benchmarks/peer_podrun.py [--config=configs/cpu.py] [--config.precision.params=bfloat16 ...]

It runs on one CPU device, as the kit's other engines run in one process, unless the command line
sets --config.mesh.num_cpu_devices or --config.mesh.data.

The kit's random Llama ($PEER_MODEL, default $PEERS_HOME/model, written by make_model.py) is
converted once into podrun-<its folder name> beside it ($PEERS_HOME/podrun-model by default, as
`python -m runner.tools.convert` would) unless
--config.checkpoint.path names a converted checkpoint. The kit's environment applies
(PEER_BATCHES, PEER_PROMPT_LEN, PEER_NEW_TOKENS, PEER_REPS, PEER_OUT); results go to
$PEERS_HOME/results/podrun-<params dtype>[-int8].json. The kit is found at $PEERS_KIT, default
../shared/peers next to this repository.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.environ.get("PEERS_KIT", os.path.join(os.path.dirname(ROOT), "shared", "peers"))
sys.path[:0] = [ROOT, KIT]
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the kit compares CPU engines

import bench_common as bc  # noqa: E402
import jax  # noqa: E402
from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from runner.checkpoints import convert  # noqa: E402
from runner.checkpoints.load import load_model  # noqa: E402
from runner.cli import parse_flags, setup_devices  # noqa: E402
from runner.engine import Request, generate  # noqa: E402
from runner.settings import from_config  # noqa: E402
from runner.tools import bench  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(ROOT, "configs", "cpu.py"), "deployment config file", lock_config=True)


def main(argv: list[str]) -> None:
    # the kit's engines each run as one process on the machine's cores: one device, not the
    # config's simulated eight
    c = bench.tool_config("peer_podrun", argv, _CONFIG.value)
    from_kit = not c.checkpoint.path
    if from_kit:
        model_dir = os.path.normpath(bc.MODEL_DIR)
        c.checkpoint.path = os.path.join(os.path.dirname(model_dir), "podrun-" + os.path.basename(model_dir))
    s = from_config(c)
    setup_devices(s)  # before anything starts the backend (converting does)
    if from_kit and not os.path.exists(s.checkpoint_path):
        if not os.path.exists(os.path.join(bc.MODEL_DIR, "config.json")):
            sys.exit(f"peer_podrun: error: no kit model at {bc.MODEL_DIR}; run the kit's make_model.py "
                     "(or setup_all.sh) first, or set PEER_MODEL")
        convert.convert(bc.MODEL_DIR, s.checkpoint_path)
    meta, rules, params = load_model(s)
    model = meta.model
    engines: dict[int, object] = {}

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        """Greedy, no stop ids: exactly n new ids per row."""
        if len(prompts) not in engines:
            engines.clear()  # one engine (and KV cache) alive at a time
            gc.collect()
            engines[len(prompts)] = bench.make_engine(s, model, params, rules, len(prompts),
                                                      (bc.PROMPT_LEN,), bc.NEW_TOKENS)
        out = generate(engines[len(prompts)], [Request(tuple(p), n) for p in prompts], stop_ids=())
        return [c.token_ids for c in out]

    quant = "" if s.policy.quantize == "none" else f"-{s.policy.quantize}"
    bc.run(f"podrun-{s.policy.params}{quant}", gen, {
        "jax": jax.__version__, "devices": jax.device_count(), "mesh": dict(rules.mesh.shape),
        "precision": dataclasses.asdict(s.policy.on(rules)), "steps_per_dispatch": s.generation.steps_per_dispatch,
        "checkpoint": s.checkpoint_path,
    })


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
