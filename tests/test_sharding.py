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


def tpu_slices(n: int):
    """Devices of n v5e:2x2 slices, from libtpu's topology descriptions (nothing to run on)."""
    import os

    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", num_slices=n).devices


def test_across_slices_only_the_dcn_part_of_an_axis_leaves_a_slice():
    mesh = make_mesh(MeshShape(data=4, model=2, dcn=(2, 1, 1, 1)), tpu_slices(2))
    grid = mesh.devices.reshape(4, 2)  # [data, model]
    slices = [[d.slice_index for d in row] for row in grid]
    assert slices == [[0, 0], [0, 0], [1, 1], [1, 1]]  # data crosses slices once, model never
    assert len({d.id for d in grid.flat}) == 8


def test_dcn_sizes_must_match_the_slices_and_divide_their_axes():
    with pytest.raises(MeshError, match="asks for 4 slices but the devices come from 2 slice"):
        make_mesh(MeshShape(data=4, model=2, dcn=(4, 1, 1, 1)), tpu_slices(2))
    with pytest.raises(MeshError, match="mesh.dcn.model=2 does not divide mesh.model=1"):
        make_mesh(MeshShape(data=8, dcn=(1, 1, 1, 2)), tpu_slices(2))
    with pytest.raises(MeshError, match="come from 1 process"):  # CPU devices: a process is a slice
        make_mesh(MeshShape(data=8, dcn=(2, 1, 1, 1)))
