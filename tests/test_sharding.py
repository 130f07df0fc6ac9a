"""Rules and mesh arithmetic: no compilation."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from models.registry import Model
from models.weights import WeightError, check_divisible
from sharding.mesh import MeshError, MeshShape, make_mesh
from sharding.rules import Rules, RulesError


def test_minus_one_fills_the_remaining_devices():
    assert MeshShape(data=-1, model=4).resolve(8) == {"data": 2, "sequence": 1, "expert": 1, "model": 4}


def test_mesh_product_must_equal_the_device_count():
    with pytest.raises(MeshError, match="data=2.*model=2.*= 4 devices but 8 are visible"):
        make_mesh(MeshShape(data=2, model=2))
    with pytest.raises(MeshError, match="does not divide the 8 visible devices"):
        make_mesh(MeshShape(data=-1, model=3))
    with pytest.raises(MeshError, match="at most one axis"):
        make_mesh(MeshShape(data=-1, model=-1))


def test_rules_map_logical_names_to_mesh_axes():
    rules = Rules.make(make_mesh(MeshShape(data=2, model=4)))
    assert rules.spec("batch", "seq", "act_heads", None) == P("data", None, "model", None)
    assert rules.spec("embed", "vocab") == P(None, "model")


def test_rules_refuse_one_mesh_axis_for_two_dimensions():
    rules = Rules.make(make_mesh(MeshShape(data=2, model=4)), {"embed": "model"})
    with pytest.raises(RulesError, match="both map to mesh axis 'model'"):
        rules.spec("embed", "vocab")
    with pytest.raises(RulesError, match="names a mesh axis twice"):
        Rules.make(make_mesh(MeshShape(data=2, model=4)), {"embed": ("data", "data")})
    with pytest.raises(RulesError, match="unknown mesh axis 'tensor'"):
        Rules.make(make_mesh(MeshShape(data=8)), {"embed": "tensor"})


def test_activation_specs_drop_axes_that_do_not_divide():
    rules = Rules.make(make_mesh(MeshShape(data=8)))
    assert rules.spec("batch", "seq", shape=(3, 5)) == P(None, None)
    assert rules.spec("batch", "seq", shape=(16, 5)) == P("data", None)


def test_heads_that_do_not_divide_over_model_are_refused():
    rules = Rules.make(make_mesh(MeshShape(data=2, model=4)))
    smollm = Model.preset("llama", "smollm2-135m")  # 9 query heads, 3 kv heads
    with pytest.raises(WeightError, match=r"heads' of size [39] does not divide over mesh axes model"):
        check_divisible(smollm.declare(), rules)


def test_rules_are_hashable_static_arguments():
    mesh = make_mesh(MeshShape(data=8))
    assert hash(Rules.make(mesh)) == hash(Rules.make(mesh))
    assert jax.jit(lambda x, r: x, static_argnums=1)(1, Rules.make(mesh)) == 1
