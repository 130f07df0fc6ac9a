"""One line per message on stderr, naming the process that speaks (several hosts share a log)."""

import sys

import jax


def say(message: str) -> None:
    print(f"podrun[{jax.process_index()}]: {message}", file=sys.stderr, flush=True)
