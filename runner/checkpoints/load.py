"""A deployment's checkpoint: fetched and converted when it is an embedded model not yet here,
checked against the deployment and its mesh, restored straight into its shards."""

from __future__ import annotations

import os
from typing import Any

from etils import epath

from models.weights import check_divisible
from runner import log
from runner.checkpoints import convert, embedded, store
from runner.engine import hugepages
from runner.settings import Settings
from sharding.mesh import make_mesh
from sharding.rules import Rules

# Where checkpoint.fetch may write: a checkpoint.path elsewhere that does not exist is a mistake to
# report (a mistyped path), not a place to download and convert a model into.
FETCH_HOME = "~/.cache/podrun/checkpoints"


def ensure_checkpoint(s: Settings) -> None:
    """Fetches and converts an embedded model (checkpoints/embedded.py) into checkpoint.path when it
    is not there yet (`random:family:preset` initialises one randomly instead), if that path is in
    FETCH_HOME."""
    if not s.checkpoint_fetch or epath.Path(s.checkpoint_path).exists():
        return
    home = os.path.realpath(os.path.expanduser(FETCH_HOME))
    if "://" in s.checkpoint_path or not os.path.realpath(s.checkpoint_path).startswith(home + os.sep):
        raise store.CheckpointError(
            f"checkpoint.path={s.checkpoint_path} does not exist; checkpoint.fetch="
            f"{s.checkpoint_fetch} fetches only into {FETCH_HOME}/ (convert a checkpoint into that "
            "path with python -m runner.tools.convert, or leave checkpoint.path to the config)")
    if s.checkpoint_fetch.startswith("random:"):
        log.info(f"initialising {s.checkpoint_fetch} into {s.checkpoint_path}")
        convert.random_checkpoint(s.checkpoint_fetch.removeprefix("random:"), s.checkpoint_path)
        return
    embedded.fetch_model(s.checkpoint_fetch, s.checkpoint_path)


def open_checkpoint(s: Settings) -> tuple[store.Metadata, Rules]:
    """The checkpoint's metadata (an embedded model fetched and converted first), checked against
    the deployment, and the mesh's rules, its weights not yet read."""
    ensure_checkpoint(s)
    meta = store.load_metadata(s.checkpoint_path)
    if s.checkpoint_model:
        store.check_matches(meta, s.checkpoint_model, s.checkpoint_path)
    rules = Rules.make(make_mesh(s.mesh), s.rules)
    check_divisible(meta.model.declare(s.policy.fuse_projections), rules)
    return meta, rules


def restore(s: Settings, meta: store.Metadata, rules: Rules) -> Any:
    """The checkpoint's weights restored straight into their shards, prepared for the policy."""
    log.info(f"restoring {s.checkpoint_path} ({meta.model.family}) onto mesh {dict(rules.mesh.shape)}")
    params = store.restore(s.checkpoint_path, meta.model, rules, s.policy.params)
    params = meta.model.prepare(params, rules, s.policy)
    hugepages.return_freed_memory()
    return params


def load_model(s: Settings) -> tuple[store.Metadata, Rules, Any]:
    """open_checkpoint, then restore: (metadata, rules, params)."""
    meta, rules = open_checkpoint(s)
    return meta, rules, restore(s, meta, rules)
