"""Deterministic cost checks from XLA's own analysis (no timing in the test suite)."""

import jax
import jax.numpy as jnp
import optax

import jax_lossscale as jls

PARAMS = {f"layer_{i}": jnp.ones((256, 256)) for i in range(8)}


def compile_step(tx, fused=False, params=PARAMS):
  def step(params, state, grads):
    if fused:
      return tx.apply_gradients(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), params).compile()


def bytes_accessed(tx, fused=False, params=PARAMS) -> float:
  cost = compile_step(tx, fused, params).cost_analysis()
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


def test_apply_gradients_on_cpu_copies_neither_parameters_nor_optimizer_state():
  # Adam in one leaf: plain Adam moves 10 parameter-sized arrays through memory here
  # (XLA's count). The fused step adds three gradient-sized passes, no more: the
  # finiteness check, and the unscaled gradients written once and read back by the
  # optimizer (read from memory, as they would be without loss scaling, so that the
  # optimizer's own arithmetic compiles the same). Its only temporary is those
  # unscaled gradients.
  params = {"w": jnp.ones((1 << 18,))}
  grads_bytes = 4 * params["w"].size
  plain = bytes_accessed(optax.adam(1e-3), params=params)
  fused = bytes_accessed(jls.loss_scaling(optax.adam(1e-3)), fused=True, params=params)
  assert fused <= plain + 3 * grads_bytes + 4096, (fused - plain) / grads_bytes
  temps = compile_step(jls.loss_scaling(optax.adam(1e-3)), True, params).memory_analysis()
  assert temps.temp_size_in_bytes <= 1.01 * grads_bytes
