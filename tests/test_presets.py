"""Specification of `presets`: other systems' scalers, in their own vocabulary.

Their step-by-step parity with each system is `test_parity.py`'s.
"""

import jax.numpy as jnp
import optax
import pytest
import reference_models as ref

import jax_lossscale as jls
from jax_lossscale import presets


@pytest.mark.parametrize("build, message", [
    # presets.flax(growth_interval=-1) used to say "`increment_period` ... got 0".
    (lambda: presets.flax(growth_interval=-1), r"`growth_interval`.*-1\b"),
    (lambda: presets.pytorch(init_scale=1e39), r"`init_scale` must be at most 3.4"),
    # It said ">= 0" for -1, then refused 0 as not positive.
    (lambda: presets.pytorch(init_scale=-1.0), r"`init_scale`.*-1\.0\b"),
    (lambda: presets.pytorch(init_scale=0.0), r"`init_scale`.*\b0\.0\b"),
    (lambda: presets.pytorch(growth_factor=1 + 1e-9), r"`growth_factor` must exceed 1"),
    (lambda: presets.deepspeed(delayed_shift=0), r"`delayed_shift` must be >= 1"),
    (lambda: presets.megatron(min_scale=8.0, initial_scale=4.0),
     r"`initial_scale` must be >= `min_scale` \(8.0\)"),
    (lambda: presets.jmp(period=2**31), r"`period` must be"),
    (lambda: presets.keras(dynamic_growth_steps=0), r"`dynamic_growth_steps` must be >= 1")])
def test_presets_name_their_own_arguments_in_errors(build, message):
  with pytest.raises(ValueError, match=message):
    build()


def test_flax_growth_interval_zero_grows_on_every_finite_step_as_flax_does():
  # It was refused; flax accepts it.
  assert presets.flax(growth_interval=0).increment_period == 1


def overflow_steps(loss_scale, losses):
  """The scale after each step of overflowing gradients, with `loss=` as given."""
  tx = jls.loss_scaling(optax.sgd(0.1), loss_scale)
  params = {"w": jnp.ones(2)}
  state, scales = tx.init(params), []
  for loss in losses:
    extra = {} if loss is None else {"loss": loss}
    _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state, params, **extra)
    scales.append(float(state.loss_scale()))
  return scales


def test_parity_holds_without_loss_and_with_finite_losses_only():
  # A forward-pass NaN passed as `loss=` keeps the scale; flax and jmp back off, as the
  # library does when the loss is not passed (README's parity table says so).
  jmp_model = ref.Jmp(loss_scale=64.0)
  expected = []
  for _ in range(3):
    jmp_model.step(False)
    expected.append(float(jmp_model.scale))
  assert overflow_steps(presets.jmp(loss_scale=64.0), [None] * 3) == expected
  assert overflow_steps(presets.jmp(loss_scale=64.0), [1.0] * 3) == expected
  assert overflow_steps(presets.jmp(loss_scale=64.0), [float("nan")] * 3) == [64.0] * 3
