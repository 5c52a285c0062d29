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


def test_fused_unscaling_reaches_the_floor_one_extra_read_of_the_gradients():
  # With `fuse_unscale=True` the unscaling runs inside the optimizer's own loop: the
  # only pass over the gradients beyond plain Adam is the finiteness check, and the
  # donated step needs no temporary at all.
  params = {"w": jnp.ones((1 << 18,))}
  grads_bytes = 4 * params["w"].size
  tx = jls.loss_scaling(optax.adam(1e-3), fuse_unscale=True)
  plain = bytes_accessed(optax.adam(1e-3), params=params)
  fused = bytes_accessed(tx, fused=True, params=params)
  assert fused <= plain + grads_bytes + 4096, (fused - plain) / grads_bytes
  temps = compile_step(tx, True, params).memory_analysis()
  assert temps.temp_size_in_bytes <= 0.01 * grads_bytes


def test_streaming_max_magnitude_reads_each_leaf_once():
  # The check: max |x| from one variadic (max, min) reduction per leaf, with NaN
  # replaced by +inf inside it, not in a pass in front: the bytes of the leaves,
  # plus scalars.
  from jax_lossscale import _tree

  grads = {"a": jnp.ones((1000, 100)), "b": jnp.ones((777,), jnp.float16)}
  compiled = jax.jit(_tree.max_magnitude_per_dtype).lower(grads).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  grads_bytes = sum(x.nbytes for x in jax.tree.leaves(grads))
  assert grads_bytes <= cost["bytes accessed"] <= grads_bytes + 256


def test_shared_clipping_reads_the_gradients_no_more_than_plain_clipped_optax():
  # With `clip_by_global_norm` the clip's norm is the finiteness check, so the
  # only reduction over the gradients is the one plain clipped Adam makes; with
  # `fuse_unscale` unscaling and clipping are one multiplication inside Adam's own
  # loop, where optax's clip writes the clipped gradients out: fewer bytes than
  # plain, and no temporary.
  params = {"w": jnp.ones((1 << 18,))}
  grads_bytes = 4 * params["w"].size
  plain = bytes_accessed(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                         params=params)
  tx = jls.loss_scaling(optax.adam(1e-3), fuse_unscale=True, clip_by_global_norm=1.0)
  shared = bytes_accessed(tx, fused=True, params=params)
  assert shared <= 1.02 * plain, shared / plain
  assert compile_step(tx, True, params).memory_analysis().temp_size_in_bytes <= 0.01 * grads_bytes
  # The exact default reads fewer bytes than clipping inside `inner`.
  inside = jls.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
  exact = jls.loss_scaling(optax.adam(1e-3), clip_by_global_norm=1.0)
  assert bytes_accessed(exact, True, params) < bytes_accessed(inside, True, params)
