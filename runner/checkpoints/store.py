"""podrun checkpoints: an Orbax tree of the model's weights plus `podrun.json` (architecture,
tokenizer, chat template). Restore reads each weight straight into its target sharding.

Layout of a converted checkpoint directory (local or gs://):
    podrun.json          {"format": 1, "model": {...}, "tokenizer": {...}, "source": "..."}
    params/              Orbax (StandardCheckpointer) tree: flat {"layers.0.wq": array, ...}
    tokenizer.json | tokenizer.model | tokenizer_config.json | generation_config.json
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from models.registry import Model
from models.weights import Weight, is_weight
from runner.storage import check_bucket
from sharding.rules import Rules

FORMAT = 1
METADATA = "podrun.json"


class CheckpointError(ValueError):
    """The checkpoint is missing, unreadable, or disagrees with its metadata."""


@dataclasses.dataclass(frozen=True)
class Metadata:
    model: Model
    tokenizer: dict  # bos/eos/chat_template/add_bos and which tokenizer file is present
    source: str = ""

    def to_json(self) -> dict:
        return {"format": FORMAT, "model": self.model.to_json(), "tokenizer": self.tokenizer,
                "source": self.source}


def flatten(tree: Any) -> dict[str, Any]:
    """{"layers.0.wq": leaf, ...}; absent optional weights (None) are left out."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_weight):
        out[".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = leaf
    return out


def unflatten(decl: Any, flat: dict[str, Any]) -> Any:
    names = list(flatten(decl))
    treedef = jax.tree.structure(decl, is_leaf=is_weight)
    return jax.tree.unflatten(treedef, [flat[n] for n in names])


def save(directory: str, meta: Metadata, params: Any, files: dict[str, bytes] | None = None) -> None:
    """Writes weights (a tree shaped like model.declare(); numpy or sharded jax leaves, each
    process writing its own shards) and metadata."""
    out = epath.Path(directory)
    flat = flatten(params)
    declared = flatten(meta.model.declare())
    missing = sorted(set(declared) - set(flat))
    if missing:
        raise CheckpointError(f"{directory}: weights {missing[:3]} are declared but were not converted")
    for name, w in declared.items():
        if tuple(flat[name].shape) != w.shape:
            raise CheckpointError(
                f"{directory}: weight {name} has shape {tuple(flat[name].shape)}, model declares {w.shape}"
            )
    if "://" in directory:  # object stores have no directories; a missing bucket is an error
        check_bucket(directory, "checkpoint", CheckpointError)
    else:
        out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        tree = {k: v if isinstance(v, jax.Array) else np.asarray(v) for k, v in flat.items()}
        ckptr.save(out / "params", tree, force=True)
    for name, data in (files or {}).items():
        (out / name).write_bytes(data)
    (out / METADATA).write_text(json.dumps(meta.to_json(), indent=1))


def load_metadata(directory: str) -> Metadata:
    path = epath.Path(directory)
    meta_file = path / METADATA
    if not path.exists():
        raise CheckpointError(
            f"checkpoint.path={directory}: no such directory; convert a model first "
            "(python -m runner.tools.convert --source=... --output=...)"
        )
    if not meta_file.exists():
        raise CheckpointError(
            f"checkpoint.path={directory}: no {METADATA} in it; is this a podrun checkpoint? "
            "Convert one with python -m runner.tools.convert"
        )
    try:
        d = json.loads(meta_file.read_text())
        if d.get("format") != FORMAT:
            raise CheckpointError(f"{meta_file}: format {d.get('format')!r}, expected {FORMAT}")
        return Metadata(Model.from_json(d["model"]), d.get("tokenizer", {}), d.get("source", ""))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{meta_file}: unreadable metadata ({e}); re-convert the checkpoint") from e


def check_matches(meta: Metadata, spec: str, directory: str) -> None:
    """The checkpoint has the weight shapes of the architecture the deployment was sized for."""
    want = {k: w.shape for k, w in flatten(Model.named(spec).declare()).items()}
    have = {k: w.shape for k, w in flatten(meta.model.declare()).items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:2]
        raise CheckpointError(
            f"checkpoint.path={directory} holds a different architecture than checkpoint.model={spec} "
            f"(first differences: {diff}); fix one of the two"
        )


def restore(directory: str, model: Model, rules: Rules, dtype: Any) -> Any:
    """Restores every weight directly into the shards its declaration and the rules give it."""
    decl = model.declare()
    flat_decl: dict[str, Weight] = flatten(decl)
    params_dir = epath.Path(directory) / "params"
    with ocp.StandardCheckpointer() as ckptr:
        try:
            stored = ckptr.metadata(params_dir).item_metadata.tree
        except Exception as e:  # orbax raises several kinds for a missing or corrupt tree
            raise CheckpointError(f"{params_dir}: cannot read the weights ({type(e).__name__}: {e})") from e
        for name, w in flat_decl.items():
            if name not in stored:
                raise CheckpointError(f"{params_dir}: weight {name} is missing; re-convert the checkpoint")
            if tuple(stored[name].shape) != w.shape:
                raise CheckpointError(
                    f"{params_dir}: weight {name} has shape {tuple(stored[name].shape)} but the "
                    f"metadata's architecture needs {w.shape}; the checkpoint and {METADATA} disagree"
                )
        target = {
            name: jax.ShapeDtypeStruct(w.shape, dtype, sharding=rules.sharding(*w.axes))
            for name, w in flat_decl.items()
        }
        try:
            flat = ckptr.restore(params_dir, target)
        except Exception as e:
            raise CheckpointError(f"{params_dir}: restore failed ({type(e).__name__}: {e})") from e
    return unflatten(decl, flat)
