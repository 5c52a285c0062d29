"""The public names: what the top of the package holds, and where the porting names live."""

import subprocess
import sys

import pytest

import jax_lossscale as jls
from jax_lossscale import tensorflow as jls_tf

TENSORFLOW_NAMES = ["ExponentialUpdateLossScaleManager", "FixedLossScaleManager",
                    "LossScaleManager", "deserialize", "get", "serialize"]


def test_tensorflows_porting_names_live_in_their_own_module_not_at_the_top():
  assert sorted(jls_tf.__all__) == TENSORFLOW_NAMES
  assert not set(TENSORFLOW_NAMES) & set(jls.__all__)


@pytest.mark.parametrize("name", TENSORFLOW_NAMES)
def test_a_moved_name_still_imports_from_the_top_as_the_same_object(name):
  namespace = {}
  exec(f"from jax_lossscale import {name}", namespace)  # noqa: S102
  assert namespace[name] is getattr(jls, name) is getattr(jls_tf, name)


def test_import_star_gives_the_top_levels_names_only():
  namespace = {}
  exec("from jax_lossscale import *", namespace)  # noqa: S102
  assert set(namespace) - {"__builtins__"} == set(jls.__all__)


def test_an_unknown_top_level_name_is_an_attribute_error_naming_it():
  with pytest.raises(AttributeError, match="'no_such_name'"):
    _ = jls.no_such_name


def test_a_managers_config_is_known_to_loss_scaling_without_importing_the_porting_module():
  code = ("import optax, jax_lossscale as jls, sys; "
          "tx = jls.loss_scaling(optax.sgd(1.0), {'class_name': 'FixedLossScaleManager', "
          "'config': {'loss_scale': 4.0}}); "
          "assert float(tx.init({'w': 1.0}).loss_scale()) == 4.0")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]
