"""Specification of the step's decision: the check, the loss, the clip."""

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._transform import decide
from jax_lossscale._transform import global_norm


def test_global_norm_is_optax_norm_for_float32_and_squares_narrow_leaves_in_float32():
  rng = np.random.default_rng(0)
  f32 = {"a": jnp.asarray(rng.normal(size=(7, 9)), jnp.float32), "b": jnp.arange(5.0)}
  chex.assert_trees_all_equal(global_norm(f32), optax.tree.norm(f32))
  # float16 squares overflow beyond 256; the norm does not.
  mixed = {"h": jnp.full(4, 300.0, jnp.float16), "i": jnp.arange(3), "n": None, "s": "name"}
  norm = global_norm(mixed)
  assert norm.dtype == jnp.float32 and float(norm) == 600.0
  assert float(global_norm({})) == 0.0 and global_norm({}).dtype == jnp.float32
  assert not np.isfinite(float(global_norm([jnp.ones(3).at[1].set(jnp.nan)])))


@pytest.mark.parametrize("loss, finite", [(None, True), (1.5, True), (float("nan"), False),
                                          (jnp.array([1.0, jnp.inf]), False)])
def test_a_loss_is_checked_whatever_its_kind(loss, finite):
  decision = decide({"g": jnp.ones(2)}, jls.FixedLossScale(2.0), loss, None, None)
  assert bool(decision.loss_finite) == finite and bool(decision.grads_finite)
  assert bool(decision.should_apply) == finite


def test_the_clip_factor_joins_the_unscaling():
  # Scaled gradients of norm 10 at scale 2: unscaled norm 5, clipped to 1.
  grads = {"g": jnp.array([6.0, 8.0])}
  decision = decide(grads, jls.FixedLossScale(2.0), None, None, 1.0)
  np.testing.assert_allclose(decision.unscaling(grads["g"]), [0.6, 0.8], rtol=1e-6)
  assert bool(decision.grads_finite)


@pytest.mark.parametrize("loss_scale", [jls.MeasuredLossScale(), jls.DynamicLossScale()],
                         ids=["measuring", "not_measuring"])
def test_probes_that_are_not_the_measured_probes_are_refused_by_name(loss_scale):
  # A scale that does not read them refuses them too: nothing given is silently dropped.
  with pytest.raises(TypeError, match=r"`probes`.*probes=True.*\bdict\b"):
    decide({"g": jnp.ones(2)}, loss_scale, None, None, None, probes={"layer": 1.0})
