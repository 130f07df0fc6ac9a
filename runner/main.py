"""podrun's entry point.

    python -m runner.main --config=configs/<deployment>.py[:arg] [--config.generation.batch_size=16 ...]
"""

from __future__ import annotations

import gc
import sys

import jax
from absl import app

from runner import job, log
from runner.cli import (DistributedError, cache_counts, config_flag, interrupted, parse_flags, read_config,
                        setup_devices)
from runner.errors import USER_ERRORS
from runner.settings import from_config

_CONFIG = config_flag()
INTERRUPTED = 130  # a shell's status for a command that SIGINT ended (128 + 2)


def main(argv: list[str]) -> None:
    config = read_config(argv, _CONFIG.value, "podrun")
    read: list = []  # the job's settings, once read: what an interruption reports on
    try:
        return answer(config, read)
    except KeyboardInterrupt:
        pass  # leaving the handler drops the traceback, and with it the job's frames
    gc.collect()  # the job's progress bar, freed with them, ends its line before this one
    print(interrupted(read[0] if read else None), file=sys.stderr, flush=True)
    sys.exit(INTERRUPTED)


def answer(config, read: list) -> None:
    """The job of `config`, its settings appended to `read` once they are."""
    try:
        settings = from_config(config)
        read.append(settings)
        setup_devices(settings)
        log.info(f"{jax.device_count()} {jax.devices()[0].platform} devices, {jax.process_count()} process(es)")
        job.answer(settings)
        hits, misses = cache_counts()
        if settings.compilation_cache_dir and hits + misses:  # misses: compiled by XLA, not in the cache
            log.info(f"compilation cache: {hits} hits, {misses} misses")
    except (*USER_ERRORS, DistributedError) as e:
        sys.exit(f"podrun: error: {e}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
