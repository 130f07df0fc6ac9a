"""Conversion and Orbax restore: straight into the target shards, onto any mesh."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from runner.checkpoints import store
from runner.checkpoints.convert import convert
from tests.conftest import rules_for
from tests.reference import tiny_hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    m = tiny_hf("qwen2", seed=1)
    hf_dir = tmp_path_factory.mktemp("hf")
    m.save_pretrained(hf_dir)
    out = tmp_path_factory.mktemp("ck") / "qwen2"
    convert(str(hf_dir), str(out))
    return m, out


@pytest.mark.parametrize("mesh_name", ["1dev", "data8", "data2_model4"])
def test_restore_onto_a_different_mesh(converted, mesh_name):
    m, path = converted
    meta = store.load_metadata(str(path))
    rules = rules_for(mesh_name)
    params = store.restore(str(path), meta.model, rules, "float32")
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    wq = params["layers"][1]["wq"]  # [D, N, H] from torch's [N*H, D]
    np.testing.assert_array_equal(np.asarray(wq), sd["model.layers.1.self_attn.q_proj.weight"].T.reshape(wq.shape))
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["bk"]).reshape(-1), sd["model.layers.0.self_attn.k_proj.bias"])
    np.testing.assert_array_equal(np.asarray(params["embed"]), sd["model.embed_tokens.weight"])
    assert params["unembed"] is None  # tied
    expected = P(None, "model", None) if mesh_name == "data2_model4" else P(None, None, None)
    assert wq.sharding.spec == expected
    if mesh_name == "data2_model4":  # each device holds only its quarter of the heads
        assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], wq.shape[1] // 4, wq.shape[2])}


def test_restore_casts_to_the_policy_dtype(converted):
    m, path = converted
    meta = store.load_metadata(str(path))
    params = store.restore(str(path), meta.model, rules_for("data8"), "bfloat16")
    leaf = params["layers"][0]["w_up"]
    assert leaf.dtype == jax.numpy.bfloat16
    ref = m.state_dict()["model.layers.0.mlp.up_proj.weight"].numpy().T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(leaf), ref)


def test_restore_refuses_shapes_that_disagree_with_the_metadata(converted, tmp_path):
    _, path = converted
    meta = json.loads((path / "podrun.json").read_text())
    meta["model"]["config"]["intermediate_size"] = 128
    (path / "podrun.json").write_text(json.dumps(meta))
    try:
        bad = store.load_metadata(str(path))
        with pytest.raises(store.CheckpointError, match=r"w_down has shape \(96, 64\).*needs \(128, 64\)"):
            store.restore(str(path), bad.model, rules_for("data8"), "float32")
    finally:
        meta["model"]["config"]["intermediate_size"] = 96
        (path / "podrun.json").write_text(json.dumps(meta))


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(store.CheckpointError, match=f"{tmp_path}/none: no such directory"):
        store.load_metadata(str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(store.CheckpointError, match="no podrun.json"):
        store.load_metadata(str(tmp_path / "empty"))


def test_a_checkpoint_saved_from_one_mesh_restores_onto_another(converted, tmp_path):
    """Saved from weights sharded over data=2 x model=4, restored over data=8 and one device."""
    m, path = converted
    meta = store.load_metadata(str(path))
    sharded = store.restore(str(path), meta.model, rules_for("data2_model4"), "float32")
    store.save(str(tmp_path / "resaved"), meta, sharded)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    for mesh_name in ("data8", "1dev"):
        params = store.restore(str(tmp_path / "resaved"), meta.model, rules_for(mesh_name), "float32")
        np.testing.assert_array_equal(np.asarray(params["layers"][1]["w_down"]),
                                      sd["model.layers.1.mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(np.asarray(params["layers"][0]["wo"]).reshape(-1, 64),
                                      sd["model.layers.0.self_attn.o_proj.weight"].T)
