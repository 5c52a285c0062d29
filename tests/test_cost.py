"""Deterministic cost checks from XLA's own analysis (no timing in the test suite).

On CPU, the step the platform branch compiles here. Byte counts are XLA's
`cost_analysis()["bytes accessed"]`; temporaries are `memory_analysis()`'s, for a step
whose parameters and optimizer state are donated, as in training.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls

PARAMS = {f"layer_{i}": jnp.ones((256, 256)) for i in range(8)}
ONE_LEAF = {"w": jnp.ones((1 << 18,))}


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


def temporaries(tx, fused=False, params=PARAMS) -> int:
  return compile_step(tx, fused, params).memory_analysis().temp_size_in_bytes


def gradient_bytes(params) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(params))


def reduction_slack(params) -> int:
  """Bytes the check may add beyond its input: scalars on CPU; on GPU, XLA reduces in
  two passes and writes the first pass's partial results (about 4 KB a leaf)."""
  if jax.default_backend() == "cpu":
    return 4096
  return 4096 + 8192 * len(jax.tree.leaves(params))


@pytest.mark.parametrize("params", [ONE_LEAF, PARAMS], ids=["one_leaf", "eight_leaves"])
@pytest.mark.parametrize("options", [{}, {"loss_scale": jls.NoOpLossScale()}],
                         ids=["dynamic", "noop"])
def test_default_apply_gradients_reads_the_gradients_once_more_than_plain_optax(
    params, options):
  # The floor: a correct skip needs the finiteness of all gradients before anything
  # is written, so one extra read of the gradients; the unscaling runs inside Adam's
  # own loop and the donated step needs no temporary.
  tx = jls.loss_scaling(optax.adam(1e-3), **options)
  plain = bytes_accessed(optax.adam(1e-3), params=params)
  grads = gradient_bytes(params)
  fused = bytes_accessed(tx, fused=True, params=params)
  assert plain + grads <= fused <= plain + grads + reduction_slack(params), (fused - plain) / grads
  assert temporaries(tx, True, params) <= 0.01 * grads


@pytest.mark.parametrize("params", [ONE_LEAF, PARAMS], ids=["one_leaf", "eight_leaves"])
def test_update_plus_apply_updates_costs_at_most_three_gradient_passes_and_one_temporary(
    params):
  # What optax.chain, flax's TrainState and nnx.Optimizer call. On CPU the inner
  # update runs under lax.cond, so the optimizer state is updated in place; its
  # updates leave the branch as one array that apply_updates reads back.
  tx = jls.loss_scaling(optax.adam(1e-3))
  plain = bytes_accessed(optax.adam(1e-3), params=params)
  grads = gradient_bytes(params)
  assert bytes_accessed(tx, params=params) <= plain + 3 * grads + 4096
  assert temporaries(tx, params=params) <= 1.01 * grads


@pytest.mark.parametrize("params", [ONE_LEAF, PARAMS], ids=["one_leaf", "eight_leaves"])
def test_shared_clipping_reads_the_gradients_no_more_than_plain_clipped_optax(params):
  # The clip's norm is the finiteness check, and the clip factor joins the unscaling
  # multiplication inside Adam's loop, where optax's clip writes the clipped
  # gradients out: fewer bytes than plain clipped Adam, and no temporary.
  plain = bytes_accessed(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                         params=params)
  tx = jls.loss_scaling(optax.adam(1e-3), clip_by_global_norm=1.0)
  assert bytes_accessed(tx, fused=True, params=params) <= 1.02 * plain
  assert temporaries(tx, True, params) <= 0.01 * gradient_bytes(params)


def test_the_check_reads_each_leaf_once():
  # One variadic (max, min) reduction per large leaf, with NaN replaced by +inf
  # inside it, not in a pass in front: the bytes of the leaves, plus scalars.
  from jax_lossscale import _finite

  grads = {"a": jnp.ones((1000, 100)), "b": jnp.ones((77_777,), jnp.float16)}
  compiled = jax.jit(lambda g: [m for _, m in _finite.largest_magnitudes(g)]).lower(
      grads).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  limit = 256 if jax.default_backend() == "cpu" else reduction_slack(grads)
  assert gradient_bytes(grads) <= cost["bytes accessed"] <= gradient_bytes(grads) + limit


def opcodes(compiled) -> list[str]:
  """XLA's opcode of every instruction of a compiled program ("reduce", "maximum"), in
  every computation (fusions' included)."""
  [module] = compiled.runtime_executable().hlo_modules()
  return [instruction.opcode.name.removeprefix("k").lower()
          for computation in module.computations()
          for instruction in computation.instructions()]


def reductions(compiled) -> int:
  return opcodes(compiled).count("reduce")


def mlir_operations(operation):
  """The names of `operation` and of every operation nested in it ("stablehlo.sqrt")."""
  operation = operation.operation
  yield operation.name
  for region in operation.regions:
    for block in region.blocks:
      for inner in block.operations:
        yield from mlir_operations(inner)


def test_small_leaves_share_their_reductions():
  # Compile time follows the number of kernels: 1000 small leaves are checked with
  # 16 reductions (64 leaves to a concatenation), large leaves with one each.
  from jax_lossscale import _finite

  small = [jnp.ones((16, 16)) for _ in range(1000)]
  assert reductions(jax.jit(_finite.all_finite).lower(small).compile()) <= 1000 // 64 + 2
  large = [jnp.ones((1 << 15,)) for _ in range(10)]
  assert reductions(jax.jit(_finite.all_finite).lower(large).compile()) <= 10 + 1


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_the_decision_is_compiled_once_not_into_every_kernel_that_reads_it(fused):
  # XLA turned a max over the per-leaf maxima into a chain of scalar maxima and
  # copied it into each of the 7 kernels that read the decision (956 maxima for 64
  # leaves, 5x plain Adam's compile time); the variadic combining reduction keeps it
  # to one reduction per leaf and a few more.
  params = {f"leaf_{i}": jnp.ones((20_000,)) for i in range(64)}
  compiled = compile_step(jls.loss_scaling(optax.adam(1e-3)), fused, params)
  assert opcodes(compiled).count("maximum") <= 2 * 64 + 16


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_the_inner_optimizer_is_lowered_into_the_step_not_called_as_a_function(fused):
  # Called as a function, which XLA inlines later, Adam's loops came out ordered by kind
  # on XLA:CPU (every leaf's first moment, then every second moment), so each gradient's
  # second read missed the cache; lowered inline they run leaf by leaf (benchmarks/
  # RESULTS.md, "The optimizer's loops leaf by leaf").
  tx = jls.loss_scaling(optax.adam(1e-3))

  def step(params, state, grads):
    if fused:
      return tx.apply_gradients(grads, state, params)
    return tx.update(grads, state, params)

  module = jax.jit(step).lower(PARAMS, tx.init(PARAMS), PARAMS).compiler_ir("stablehlo")
  functions = [(function.operation.attributes["sym_name"].value, list(mlir_operations(function)))
               for function in module.body.operations]
  assert [name for name, _ in functions][:1] == ["main"]
  assert "stablehlo.sqrt" in functions[0][1]  # Adam's denominator, in the step itself
  assert [name for name, operations in functions[1:] if "stablehlo.sqrt" in operations] == []
