"""One line per message on stderr, naming the process that speaks (several hosts share a log),
and nothing else there unless asked: the libraries' own chatter is kept quiet."""

import glob
import importlib.util
import os
import sys

import jax
from absl import logging


def info(message: str) -> None:
    """One line on stderr: `podrun[<process index>]: <message>`."""
    print(f"podrun[{jax.process_index()}]: {message}", file=sys.stderr, flush=True)


def quiet() -> None:
    """Before the backend starts. libtpu, when installed on a machine with no TPU chips (the test
    requirements install it for AOT compiles), prints three lines of warnings in every process
    that starts jax and writes /tmp/tpu_logs; on such a machine jax is kept to its CPU (and
    NVIDIA GPUs: `platforms`). An explicit JAX_PLATFORMS or jax_platforms wins. absl's INFO
    logging (Orbax's progress lines) stays off, as does everything below WARNING unless
    --verbosity asks for it."""
    if not _asked_for_verbosity():
        logging.set_verbosity(logging.WARNING)
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if chosen := platforms():
        jax.config.update("jax_platforms", chosen)


def platforms() -> str | None:
    """The jax platforms for this machine: None on a TPU VM (its chips are jax's default), else
    the NVIDIA GPUs where there are some and jax's CUDA plugin is installed, and the CPU."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):  # TPU VMs' chips (v4; v5e on)
        return None
    nvidia = os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*")
    cuda = bool(nvidia) and any(
        importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return "cuda,cpu" if cuda else "cpu"


def _asked_for_verbosity() -> bool:
    return any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:])
