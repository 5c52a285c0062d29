"""Specification of the tree utilities: floating leaves, partition, select, `-0.0`."""

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Wrapped

import jax_lossscale as jls
from jax_lossscale import _numerics
from jax_lossscale import _trees


def test_python_floats_are_floating_leaves_and_ints_bools_and_strings_are_not():
  tree = {"f": 3.0, "c": 1j, "i": 3, "b": True, "s": "x", "a": jnp.ones(2), "n": None,
          "k": jnp.arange(2)}
  assert [np.asarray(x).dtype.kind for x in _trees.float_leaves(tree)] == ["f", "c", "f"]


def test_floating_leaves_are_rescaled_python_floats_included():
  # A Python float is a number like any other: jmp and Keras multiply it too.
  out = _trees.rescale_floats({"f": 3.0, "i": 3, "a": jnp.ones(2)},
                              _numerics.Rescale((jnp.float32(2.0),)))
  assert float(out["f"]) == 6.0 and out["i"] == 3
  chex.assert_trees_all_equal(out["a"], jnp.full(2, 2.0))


def test_partition_and_combine_are_inverse_and_keep_static_leaves_out_of_arrays():
  tree = {"w": jnp.ones(2), "name": "mlp", "act": jax.nn.relu, "none": None}
  arrays, static = _trees.partition(tree)
  assert jax.tree.leaves(static) == [jax.nn.relu, "mlp"] and len(jax.tree.leaves(arrays)) == 1
  out = _trees.combine(arrays, static)
  assert out["name"] == "mlp" and out["act"] is jax.nn.relu and out["none"] is None
  chex.assert_trees_all_equal(out["w"], tree["w"])


def test_replaceable_gives_the_chosen_leaves_and_copies_holding_others_in_their_place():
  w, b = jnp.ones(2), jnp.zeros(2, jnp.int32)
  tree = ({"w": w, "b": b, "name": "layer"}, 0.5)
  chosen, replace = _trees.replaceable(tree, lambda leaf: _trees.is_array(leaf) and leaf.ndim)
  assert chosen[0] is b and chosen[1] is w
  new = [jnp.full(2, 3), jnp.full(2, 4.0)]
  copy = replace(new)
  assert copy[0]["b"] is new[0] and copy[0]["w"] is new[1]
  assert copy[0]["name"] == "layer" and copy[1] == 0.5 and tree[0]["w"] is w


def test_arrays_of_refuses_a_function_that_changes_the_static_leaves():
  f = _trees.arrays_of(lambda: {"name": "other", "w": jnp.ones(1)}, {"name": "mlp", "w": None})
  with pytest.raises(TypeError, match="changed the non-array leaves"):
    f()


def test_select_tree_picks_whole_trees_without_leaking_nan(maybe_jit):
  good = {"m": jnp.ones(3), "count": jnp.array(4, jnp.int32)}
  bad = {"m": jnp.full(3, jnp.nan), "count": jnp.array(5, jnp.int32)}
  select = maybe_jit(jls.select_tree)
  chex.assert_trees_all_equal(select(jnp.array(False), bad, good), good)
  chex.assert_trees_all_equal(select(jnp.array(True), good, bad), good)
  chex.assert_trees_all_equal(select(False, bad, good), good)


def test_select_tree_rejects_a_non_scalar_predicate():
  with pytest.raises(ValueError, match="`pred`"):
    jls.select_tree(jnp.array([True, False]), [jnp.ones(2)], [jnp.ones(2)])


@pytest.mark.parametrize("pred", [0.5, 1, jnp.float32(0.0), jnp.int32(1)])
def test_select_tree_rejects_a_predicate_that_is_not_a_boolean(pred):
  with pytest.raises(TypeError, match="`pred`"):
    jls.select_tree(pred, {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})


def test_select_tree_rejects_mismatched_leaves():
  with pytest.raises(TypeError, match="float32.*float16"):
    jls.select_tree(True, [jnp.ones(2)], [jnp.ones(2, jnp.float16)])


def test_select_tree_keeps_non_array_leaves_of_the_first_tree():
  out = jls.select_tree(False, {"f": jax.nn.relu, "x": jnp.ones(1)},
                        {"f": jax.nn.relu, "x": jnp.zeros(1)})
  assert out["f"] is jax.nn.relu and float(out["x"][0]) == 0


def test_negative_zeros_are_the_additive_identity_even_for_negative_zero():
  params = {"w": jnp.array([-0.0, 0.0, -1.5, jnp.inf]), "h": jnp.array([-0.0], jnp.float16),
            "c": jnp.array([complex(-0.0, -0.0)], jnp.complex64), "n": None}
  updates = _trees.negative_zeros_like(params)
  after = optax.apply_updates(params, updates)
  for name in ("w", "h"):
    np.testing.assert_array_equal(np.signbit(after[name]), np.signbit(params[name]))
  assert np.signbit(after["c"].real[0]) and np.signbit(after["c"].imag[0])
  shapes = _trees.negative_zeros_like(jax.eval_shape(lambda: params))
  chex.assert_trees_all_equal(shapes, updates)
  from_template = jax.jit(lambda p: _trees.negative_zeros_like(shapes, like=p))(params)
  bits = lambda tree: jax.tree.map(lambda x: np.asarray(x).tobytes(), tree)
  assert bits(from_template) == bits(updates)


def test_cast_like_widens_a_state_to_the_dtypes_of_another():
  # bfloat16 parameters with float32 gradients: optax's moments become float32.
  old = {"mu": jnp.array([1.5, -2.0], jnp.bfloat16), "count": jnp.array(3, jnp.int32)}
  like = {"mu": jax.ShapeDtypeStruct((2,), jnp.float32), "count": jnp.zeros([], jnp.int32)}
  out = _trees.cast_like(old, like)
  assert out["mu"].dtype == jnp.float32 and out["count"] is old["count"]
  np.testing.assert_array_equal(np.float32(out["mu"]), np.float32(old["mu"]))


def test_apply_updates_takes_a_whole_module_with_static_leaves():
  # As eqx.apply_updates: only the arrays are updated; `None` updates leave them alone.
  params = {"w": jnp.ones(2), "frozen": jnp.ones(1), "act": jax.nn.relu, "name": "mlp"}
  updates = {"w": jnp.full(2, 0.5), "frozen": None, "act": None, "name": None}
  out = _trees.apply_updates(params, updates)
  assert out["act"] is jax.nn.relu and out["name"] == "mlp"
  chex.assert_trees_all_equal(out["w"], jnp.full(2, 1.5))
  chex.assert_trees_all_equal(out["frozen"], jnp.ones(1))


def test_unwrap_replaces_single_array_wrappers_by_their_arrays():
  tree = {"a": Wrapped(jnp.ones(2)), "b": [Wrapped(jnp.zeros(1))], "c": jnp.ones(3)}
  out = _trees.unwrap(tree, ())
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(out))
  assert isinstance(out["a"], jax.Array) and isinstance(out["b"][0], jax.Array)


def test_registered_dataclasses_keep_every_static_field_and_skip_their_constructor():
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Checked:
    value: object
    floor: float = 4.0

    def __post_init__(self):
      if not isinstance(self.value, (int, float)) or self.value < self.floor:
        raise ValueError("refused")

  assert _trees.register_dataclass(Checked, ("value",)) == ("floor",)
  # vmap's in_axes puts None in the leaves: the constructor's check must not run.
  out = jax.tree.map(lambda _: None, Checked(8.0, floor=2.0))
  assert out.value is None and out.floor == 2.0
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      Checked(8.0))]
  assert paths == [".value"]


def test_apply_updates_wraps_narrow_integers_as_optax_and_widens_only_float8():
  # The float8 path (add in float32, round back) caught int8 and uint8 parameters too,
  # which then saturated where optax's rule wraps.
  params = {"c": jnp.array([100, 0, -100], jnp.int8), "u": jnp.array([0, 200, 5], jnp.uint8),
            "f": jnp.array([1.0, -2.0], jnp.float8_e4m3fn)}
  updates = {"c": jnp.array([100, 2**24 + 1, -100], jnp.int32),
             "u": jnp.array([2**24 + 1, 100, -10], jnp.int32), "f": jnp.array([0.5, 0.25])}
  ours = _trees.apply_updates(params, updates)
  integers = lambda tree: {k: tree[k] for k in ("c", "u")}
  chex.assert_trees_all_equal(integers(ours),
                              optax.apply_updates(integers(params), integers(updates)))
  chex.assert_trees_all_equal(ours["f"], jnp.array([1.5, -1.75], jnp.float8_e4m3fn))


class Unkeyed:
  """A pytree node registered without keys: its children get `FlattenedIndexKey`s."""

  def __init__(self, a, b):
    self.a, self.b = a, b


jax.tree_util.register_pytree_node(Unkeyed, lambda u: ((u.a, u.b), None),
                                   lambda _, children: Unkeyed(*children))


def test_a_key_path_is_named_by_its_entries_and_leads_back_to_its_leaf():
  # Every key JAX makes (dict, attribute, sequence and unkeyed-node keys) and the plain
  # parts of an NNX module path: named as nonfinite_leaf_paths and the probes name them.
  Point = collections.namedtuple("Point", "x y")
  tree = {"params": [Point(jnp.zeros(()), {3: jnp.ones(())})], "u": Unkeyed(1.0, 2.0)}
  paths = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
  assert [_trees.path_name(path) for path, _ in paths] == [
      "params/0/x", "params/0/y/3", "u/0", "u/1"]
  for path, leaf in paths[:2]:  # an unkeyed node's children are not its items
    node = tree
    for key in path:
      node = _trees.child(node, key)
    assert node is leaf
  assert _trees.path_name(("blocks", 0, "linear")) == "blocks/0/linear"
