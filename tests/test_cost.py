"""Deterministic cost checks from XLA's own analysis (no timing in the test suite)."""

import jax
import jax.numpy as jnp
import optax

import jax_lossscale as jls

PARAMS = {f"layer_{i}": jnp.ones((256, 256)) for i in range(8)}


def bytes_accessed(tx) -> float:
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(PARAMS, tx.init(PARAMS), PARAMS).compile()
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"]


def test_noop_loss_scale_compiles_to_no_extra_work():
  # The bfloat16 / TPU setting: only a few scalar counters are added.
  plain = bytes_accessed(optax.adam(1e-3))
  wrapped = bytes_accessed(
      jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), skip_nonfinite=False))
  assert wrapped / plain < 1.0001, wrapped / plain


def test_skipping_reads_the_gradients_once_more_at_least():
  # The floor: correct skipping needs the finiteness of all gradients first.
  plain = bytes_accessed(optax.adam(1e-3))
  grads_bytes = 4 * sum(p.size for p in jax.tree.leaves(PARAMS))
  assert bytes_accessed(jls.loss_scaling(optax.adam(1e-3))) >= plain + grads_bytes
