"""Specification of `serialize`, `deserialize` and `get` (TensorFlow's rules)."""

import json

import pytest

import jax_lossscale as jls


@pytest.mark.parametrize(
    "loss_scale",
    [jls.NoOpLossScale(), jls.FixedLossScale(3.5),
     jls.DynamicLossScale(8, 3, 4.0, min_loss_scale=2, hysteresis=2)],
    ids=lambda ls: type(ls).__name__,
)
def test_serialize_round_trips_through_json(loss_scale):
  data = json.loads(json.dumps(jls.serialize(loss_scale)))
  assert data["class_name"] == type(loss_scale).__name__
  assert jls.deserialize(data) == loss_scale


def test_get_turns_a_number_into_a_fixed_loss_scale():
  assert jls.get(128) == jls.FixedLossScale(128)
  assert jls.get(2.5) == jls.FixedLossScale(2.5)


def test_get_turns_dynamic_into_the_default_dynamic_loss_scale():
  assert jls.get("dynamic") == jls.DynamicLossScale()


def test_get_returns_loss_scales_and_none_as_they_are():
  loss_scale = jls.DynamicLossScale(4)
  assert jls.get(loss_scale) is loss_scale
  assert jls.get(None) is None


def test_get_deserializes_a_dict():
  assert jls.get(jls.serialize(jls.FixedLossScale(64))) == jls.FixedLossScale(64)


@pytest.mark.parametrize("identifier", ["static", True, [1.0], object()])
def test_get_rejects_anything_else(identifier):
  with pytest.raises(ValueError, match="Could not interpret loss scale identifier"):
    jls.get(identifier)


def test_get_passes_value_errors_of_bad_numbers_through_in_its_own_words():
  with pytest.raises(ValueError, match="`identifier` must be >= 1, got 0.5"):
    jls.get(0.5)


@pytest.mark.parametrize(
    "data, match",
    [({"class_name": "Nope", "config": {}}, "Unknown loss scale class_name 'Nope'"),
     ({"config": {}}, "keys 'class_name' and 'config'"),
     ("FixedLossScale", "keys 'class_name' and 'config'")],
)
def test_deserialize_rejects_malformed_input(data, match):
  with pytest.raises(ValueError, match=match):
    jls.deserialize(data)


def test_serialize_rejects_non_loss_scales():
  with pytest.raises(ValueError, match="expects a LossScale"):
    jls.serialize(2.0)
