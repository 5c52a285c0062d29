"""Specification of `serialize`, `deserialize` and `get` (TensorFlow's rules)."""

import json

import jax
import pytest

import jax_lossscale as jls
from jax_lossscale import tensorflow as jls_tf


@pytest.mark.parametrize(
    "loss_scale",
    [jls.NoOpLossScale(), jls.FixedLossScale(3.5),
     jls.DynamicLossScale(8, 3, 4.0, min_loss_scale=2, hysteresis=2)],
    ids=lambda ls: type(ls).__name__,
)
def test_serialize_round_trips_through_json(loss_scale):
  data = json.loads(json.dumps(jls_tf.serialize(loss_scale)))
  assert data["class_name"] == type(loss_scale).__name__
  assert jls_tf.deserialize(data) == loss_scale


def test_get_turns_a_number_into_a_fixed_loss_scale():
  assert jls_tf.get(128) == jls.FixedLossScale(128)
  assert jls_tf.get(2.5) == jls.FixedLossScale(2.5)


def test_get_turns_dynamic_into_the_default_dynamic_loss_scale():
  assert jls_tf.get("dynamic") == jls.DynamicLossScale()


def test_get_returns_loss_scales_and_none_as_they_are():
  loss_scale = jls.DynamicLossScale(4)
  assert jls_tf.get(loss_scale) is loss_scale
  assert jls_tf.get(None) is None


def test_get_deserializes_a_dict():
  assert jls_tf.get(jls_tf.serialize(jls.FixedLossScale(64))) == jls.FixedLossScale(64)


@pytest.mark.parametrize("identifier", ["static", True, [1.0], object()])
def test_get_rejects_anything_else(identifier):
  with pytest.raises(ValueError, match="`identifier`"):
    jls_tf.get(identifier)


def test_get_passes_value_errors_of_bad_numbers_through_in_its_own_words():
  with pytest.raises(ValueError, match=r"`identifier`.*\b0\.5\b"):
    jls_tf.get(0.5)


@pytest.mark.parametrize(
    "data, match",
    [({"class_name": "Nope", "config": {}}, "'Nope'"),
     ({"config": {}}, "'class_name'.*'config'"),
     ("FixedLossScale", "'class_name'.*'config'")],
)
def test_deserialize_rejects_malformed_input(data, match):
  with pytest.raises(ValueError, match=match):
    jls_tf.deserialize(data)


def test_serialize_rejects_non_loss_scales():
  with pytest.raises(ValueError, match=r"LossScale.*\b2\.0\b"):
    jls_tf.serialize(2.0)


def _define_loss_scale_class(name="NotebookLossScale", base=jls.FixedLossScale):
  """A loss-scale class `name`, as a notebook cell defines it: run again, the same name."""
  return jls.loss_scale_dataclass(type(name, (base,), {"__module__": "notebook"}))


def test_a_loss_scale_class_defined_again_replaces_the_first():
  first, second = _define_loss_scale_class(), _define_loss_scale_class()
  restored = jls_tf.deserialize(json.loads(json.dumps(jls_tf.serialize(first(4.0)))))
  assert type(restored) is second
  assert restored == second(4.0)


def test_a_class_of_your_own_named_like_ours_is_serialized_as_yours():
  mine = _define_loss_scale_class("DynamicLossScale", base=jls.DynamicLossScale)
  data = jls_tf.serialize(mine(8.0))
  assert data["class_name"] == "notebook.DynamicLossScale"
  assert type(jls_tf.deserialize(data)) is mine
  ours = jls_tf.deserialize(jls_tf.serialize(jls.DynamicLossScale(8.0)))
  assert type(ours) is jls.DynamicLossScale


@pytest.mark.parametrize("class_name", ["DynamicLossScale", "jax_lossscale.DynamicLossScale"])
def test_our_classes_are_read_by_bare_and_by_qualified_name(class_name):
  data = {"class_name": class_name, "config": jls.DynamicLossScale(8.0).get_config()}
  assert jls_tf.deserialize(data) == jls.DynamicLossScale(8.0)


def test_an_exported_function_of_a_class_defined_again_deserializes_to_the_latest():
  from jax import export

  _define_loss_scale_class("ExportedLossScale")
  latest = _define_loss_scale_class("ExportedLossScale")
  exported = export.export(jax.jit(lambda ls: ls()))(latest(4.0))
  restored = export.deserialize(exported.serialize())
  assert restored.in_tree == jax.tree.structure(((latest(4.0),), {}))
  assert restored.call(latest(4.0)) == 4.0
