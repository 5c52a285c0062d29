"""Cases that need 8 devices; `test_distributed.py` runs this file, with
`training_loops.py`, in one subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (never set globally)."""

from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import force_branch
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_probes import F16
from test_probes import PARAMS
from test_probes import mlp
from test_probes import with_probes

import jax_lossscale as jls
from jax_lossscale import diagnostics
from jax_lossscale import probes as pr

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 devices")


@pytest.fixture(params=["auto", "explicit"])
def mesh(request):
  """Both sharding modes: classic (Auto axes) and explicit sharding under `set_mesh`."""
  if request.param == "auto":
    yield jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  else:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
      yield mesh


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def sharded_params(mesh):
  return {
      "w": jax.device_put(jnp.linspace(-1, 1, 64).reshape(16, 4), NamedSharding(mesh, P("data"))),
      "b": jax.device_put(jnp.zeros(4), NamedSharding(mesh, P())),
  }


def test_spmd_jit_inf_in_one_shard_makes_every_device_skip(mesh):
  params = sharded_params(mesh)
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0))
  state = jax.jit(tx.init)(params)
  grads = jax.device_put(jnp.ones((16, 4)).at[11, 2].set(jnp.inf), params["w"].sharding)
  grads = {"w": grads, "b": jax.device_put(jnp.ones(4), params["b"].sharding)}
  # Exactly one device holds the inf.
  assert sum(not np.isfinite(s.data).all() for s in grads["w"].addressable_shards) == 1

  updates, new_state = jax.jit(tx.update)(grads, state, params)

  for shard in updates["w"].addressable_shards + updates["b"].addressable_shards:
    assert (np.asarray(shard.data) == 0).all()
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert float(new_state.loss_scale()) == 4.0 and int(new_state.skipped_steps) == 1


@pytest.mark.parametrize("branch", ["cpu", "cuda", "default"])
def test_apply_gradients_skips_an_inf_in_one_shard_and_keeps_the_sharding(mesh, branch):
  params = sharded_params(mesh)
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0))
  state = jax.jit(tx.init)(params)
  ones = {"w": jnp.ones((16, 4)), "b": jnp.ones(4)}
  good = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), ones, params)
  bad = dict(good, w=jax.device_put(ones["w"].at[5, 1].set(jnp.inf), params["w"].sharding))
  with force_branch(branch):  # the select and CUDA branches too, traced here
    step = jax.jit(tx.apply_gradients)
    skipped_params, state = step(bad, state, params)
    applied_params, state = step(good, state, skipped_params)

  chex.assert_trees_all_equal(skipped_params, params)
  assert applied_params["w"].sharding.is_equivalent_to(params["w"].sharding, 2)
  assert not np.allclose(np.asarray(applied_params["w"]), np.asarray(params["w"]))
  assert int(state.skipped_steps) == 1 and float(state.loss_scale()) == 4.0


def test_shared_clipping_takes_the_global_norm_of_sharded_gradients(mesh):
  params = sharded_params(mesh)
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(2.0), clip_by_global_norm=1.0)
  twos = {"w": jnp.full((16, 4), 2.0), "b": jnp.full(4, 2.0)}
  grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), twos, params)
  new_params, state = jax.jit(tx.apply_gradients)(grads, jax.jit(tx.init)(params), params)

  # Unscaled, every gradient is 1: the global norm is sqrt(68) over all shards.
  expected = jax.tree.map(lambda p: np.asarray(p) - 1 / np.sqrt(68.0), params)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, new_params), expected, rtol=1e-6)
  assert new_params["w"].sharding.is_equivalent_to(params["w"].sharding, 2)
  assert bool(state.last_applied)


def test_state_sharding_scalars_replicated_inner_state_like_params(mesh):
  params = sharded_params(mesh)
  tx = jls.loss_scaling(optax.adam(1e-2))
  state = jax.jit(tx.init)(params)
  x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))

  @jax.jit
  def step(params, state, x):
    _, grads = jls.scaled_value_and_grad(loss_fn)(state, params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = step(params, state, x)
  for leaf in jax.tree.leaves(state.loss_scale) + [state.skipped_steps, state.last_applied]:
    assert leaf.sharding.is_fully_replicated
  mu = state.inner_state[0].mu
  assert mu["w"].sharding.is_equivalent_to(params["w"].sharding, 2)
  assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


def test_init_works_on_abstract_parameters():
  abstract = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  tx = jls.loss_scaling(optax.adam(1e-3), jls.DynamicLossScale(2.0**10))
  state = jax.eval_shape(tx.init, abstract)
  assert state.loss_scale.current_loss_scale.dtype == jnp.float32
  assert state.inner_state[0].mu["w"].shape == (1024, 1024)
  assert state.loss_scale.get_config()["initial_loss_scale"] == 2.0**10


def shard_map_update(tx, mesh, state_specs):
  return jax.jit(jax.shard_map(
      lambda g, s, p: tx.update(g, s, p), mesh=mesh,
      in_specs=(P("data"), state_specs, P("data")), out_specs=(P("data"), state_specs),
  ))


def per_device_case(mesh):
  """Parameters sharded over devices (ZeRO/FSDP style): each device updates its own
  shard with its own gradients, and device 5 alone sees an inf."""
  params = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P("data")))
  grads = jax.device_put(jnp.ones((8, 3)).at[5, 0].set(jnp.inf), NamedSharding(mesh, P("data")))
  return params, grads


def state_specs(state):
  """What is shaped like the (2-D) parameters is split along "data", the rest replicated."""
  return jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), state)


@pytest.mark.parametrize("axis_name", ["data", ("data",)])
def test_shard_map_axis_name_makes_every_device_agree_to_skip(mesh, axis_name):
  params, grads = per_device_case(mesh)
  tx = jls.loss_scaling(optax.sgd(0.1, momentum=0.9), jls.DynamicLossScale(8.0),
                        axis_name=axis_name)
  state = tx.init(params)
  update = shard_map_update(tx, mesh, state_specs(state))
  updates, new_state = update(grads, state, params)
  chex.assert_trees_all_equal(updates, -jnp.zeros((8, 3)))
  assert float(new_state.loss_scale()) == 4.0
  # The next, clean step applies everywhere with the agreed scale.
  clean = jax.device_put(jnp.ones((8, 3)), params.sharding)
  updates, new_state = update(clean, new_state, params)
  assert (np.asarray(updates) != 0).all() and int(new_state.skipped_steps) == 1


@pytest.mark.parametrize("check_vma", [True, False])
def test_without_axis_name_shard_map_replicas_agree_by_construction(mesh, check_vma):
  # Were each device to decide alone, only device 5 would skip and the scales would diverge.
  params, grads = per_device_case(mesh)
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(8.0))
  state = tx.init(params)
  per_device = jax.jit(jax.shard_map(
      lambda g, s, p: tx.update(g, s, p)[1].loss_scale()[None], mesh=mesh,
      in_specs=(P("data"), state_specs(state), P("data")), out_specs=P("data"),
      check_vma=check_vma))
  assert list(np.asarray(per_device(grads, state, params))) == [4.0] * 8


def pmap_step(tx, axis_name, loss_fn):
  """flax's and haiku's data-parallel step: gradients pmean-ed, each replica's own loss."""
  def step(params, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    grads = jax.lax.pmean(state.loss_scale.scale(grads), axis_name)
    return tx.apply_gradients(grads, state, params, loss=loss)
  return jax.pmap(step, axis_name=axis_name)


@pytest.mark.parametrize("branch", ["cpu", "cuda", "default"])
def test_pmap_replicas_never_disagree_when_one_replica_has_a_nan_loss(branch):
  # Replica 3's loss is NaN (kept scale) while the pmean-ed gradients are NaN everywhere
  # (backoff): the replicas used to take different decisions and drift apart.
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(8.0))
  params = jax.tree.map(lambda a: jnp.stack([a] * 8), {"w": jnp.ones(3)})
  state = jax.pmap(tx.init)(params)
  x = jnp.ones((8, 3)).at[3, 0].set(jnp.nan)
  with force_branch(branch):
    step = pmap_step(tx, "batch", lambda p, x: jnp.sum(p["w"] * x))
    new_params, new_state = step(params, state, x)
  for leaf in jax.tree.leaves((new_params, new_state)):
    assert (np.asarray(leaf) == np.asarray(leaf)[0]).all() or np.isnan(np.asarray(leaf)).all()
  assert list(np.asarray(new_state.loss_scale())) == [8.0] * 8  # the forward pass is blamed
  assert list(np.asarray(new_state.nonfinite_loss_steps)) == [1] * 8
  chex.assert_trees_all_equal(new_params, params)


def test_scaled_value_and_grad_axis_name_gives_every_replica_the_same_loss_and_grads():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(8.0))
  params = jax.tree.map(lambda a: jnp.stack([a] * 8), {"w": jnp.ones(3)})
  state = jax.pmap(tx.init)(params)
  grad_fn = jls.scaled_value_and_grad(lambda p, x: jnp.sum(p["w"] * x), axis_name="batch")

  def step(params, state, x):
    loss, grads = grad_fn(state, params, x)
    return (*tx.apply_gradients(grads, state, params, loss=loss), loss)

  x = jnp.arange(24.0).reshape(8, 3).at[3, 0].set(jnp.nan)
  new_params, new_state, loss = jax.pmap(step, axis_name="batch")(params, state, x)
  assert np.isnan(np.asarray(loss)).all()  # the mean of the losses, on every replica
  chex.assert_trees_all_equal(new_params, params)
  assert list(np.asarray(new_state.loss_scale())) == [8.0] * 8


def test_pmap_axis_name_makes_every_replica_agree():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(8.0), axis_name="batch")
  params = jnp.ones((8, 3))
  state = jax.pmap(tx.init)(params)
  grads = jnp.ones((8, 3)).at[2, 1].set(jnp.nan)
  updates, new_state = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name="batch")(
      grads, state, params)
  chex.assert_trees_all_equal(updates, -jnp.zeros((8, 3)))
  assert list(np.asarray(new_state.loss_scale())) == [4.0] * 8


def test_loss_scale_update_and_all_finite_take_axis_name(mesh):
  grads = jax.device_put(jnp.ones(8).at[3].set(jnp.inf), NamedSharding(mesh, P("data")))

  def per_device(g):
    finite = jls.all_finite(g, axis_name="data")
    loss_scale, should_apply = jls.DynamicLossScale(16.0).update(g, axis_name="data")
    return finite[None], should_apply[None], loss_scale()[None]

  finite, apply, scale = jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(grads)
  assert not np.asarray(finite).any() and not np.asarray(apply).any()
  assert (np.asarray(scale) == 8.0).all()


@pytest.mark.parametrize("dtype, clip, loss_scale, collectives", [
    (jnp.float32, None, "dynamic", 1), (jnp.float32, 1.0, "dynamic", 1),
    (jnp.float16, None, "dynamic", 2), (jnp.bfloat16, 1.0, "dynamic", 2),  # narrow updates
    (jnp.float32, None, jls.MeasuredLossScale(), 2)])  # and the largest gradient's pmax
def test_finiteness_is_agreed_with_one_scalar_collective(mesh, dtype, clip, loss_scale,
                                                          collectives):
  params, grads = jax.tree.map(lambda x: x.astype(dtype), per_device_case(mesh))
  tx = jls.loss_scaling(optax.adam(0.1), loss_scale, axis_name="data",
                        clip_by_global_norm=clip)
  state = tx.init(params)
  update = jax.jit(jax.shard_map(
      lambda g, s, p, loss: tx.update(g, s, p, loss=loss), mesh=mesh,
      in_specs=(P("data"), state_specs(state), P("data"), P("data")),
      out_specs=(P("data"), state_specs(state))))
  losses = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))  # one per device
  hlo = update.lower(grads, state, params, losses).as_text()
  reductions = [line for line in hlo.splitlines() if "all_reduce" in line or "all-reduce" in line]
  assert len([r for r in reductions if "=" in r]) == collectives, reductions


@pytest.mark.parametrize("branch", ["cpu", "default"])
def test_float16_updates_are_checked_on_every_device_and_agreed(mesh, branch):
  # Adam's eps=1e-8 is 0 in float16: device 5's zero gradient gives 0/0 there only.
  # The update check's collective runs inside the step's branch; every device skips.
  params = jax.device_put(jnp.ones((8, 3), jnp.float16), NamedSharding(mesh, P("data")))
  grads = jax.device_put(jnp.ones((8, 3), jnp.float16).at[5].set(0),
                         NamedSharding(mesh, P("data")))
  tx = jls.loss_scaling(optax.adam(1e-3), jls.DynamicLossScale(8.0), axis_name="data")
  state = tx.init(params)
  with force_branch(branch):
    update = shard_map_update(tx, mesh, state_specs(state))
    updates, new_state = update(grads, state, params)
  chex.assert_trees_all_equal(updates, -jnp.zeros((8, 3), jnp.float16))
  assert int(new_state.nonfinite_update_steps) == 1 and float(new_state.loss_scale()) == 8.0


def test_axis_name_restricts_the_agreement_to_the_named_axis_of_a_2d_mesh():
  # Replicas along "b" agree; the two groups along "a" decide on their own (e.g. two
  # ensemble members, each data-parallel over "b").
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(8.0), axis_name="b")
  spec = P(("a", "b"))
  params = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, spec))
  grads = jax.device_put(jnp.ones((8, 3)).at[1, 0].set(jnp.inf), NamedSharding(mesh, spec))

  def step(g, p):
    _, state = tx.update(g, tx.init(p), p)
    return state.loss_scale()[None], state.skipped_steps[None]

  scales, skipped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec),
                                          out_specs=(spec, spec), check_vma=False))(grads, params)
  assert np.asarray(scales).reshape(2, 4).tolist() == [[4.0] * 4, [8.0] * 4]
  assert np.asarray(skipped).reshape(2, 4).tolist() == [[1] * 4, [0] * 4]


def test_the_jmp_drop_in_all_finite_answers_per_device_as_jmp_does():
  # It agreed over every mapped axis, coupling independent runs jmp keeps apart.
  import jmp as deepmind_jmp

  import jax_lossscale.jmp as ours

  grads = jnp.ones((8, 3)).at[2, 0].set(jnp.inf)
  for module in (deepmind_jmp, ours):
    scales = jax.pmap(lambda g, m=module: m.DynamicLossScale(jnp.float32(2.0**15)).adjust(
        m.all_finite(g)).loss_scale)(grads)
    assert scales.tolist() == [2.0**15] * 2 + [2.0**14] + [2.0**15] * 5, module.__name__
  assert jax.pmap(jls.all_finite, axis_name="i")(grads).tolist() == [False] * 8


def test_raise_if_stuck_reads_a_pmapped_state():
  # It failed with "Only scalar arrays can be converted to Python scalars".
  tx = jls.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.ones((8, 4))}
  state = jax.pmap(tx.init)(params)
  step = jax.pmap(tx.apply_gradients, axis_name="batch")
  for _ in range(3):
    params, state = step({"w": jnp.full((8, 4), jnp.inf)}, state, params)
  with pytest.raises(jls.LossScaleStuckError, match=r"\b3\b.*max_consecutive_skips=2\b"):
    jls.raise_if_stuck(state, max_consecutive_skips=2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_probes_in_a_shard_map_of_the_loss_measure_every_device_and_change_nothing(mesh, jit):
  w = jax.device_put(jnp.linspace(-1, 1, 64).reshape(8, 8) / 4, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.linspace(-2, 2, 128).reshape(16, 8), NamedSharding(mesh, P("data")))

  def loss(w, x):
    def per_device(w, x):
      hidden = jls.diagnostics.probe(jnp.tanh(x @ w), "hidden")
      return jax.lax.pmean(jnp.mean(hidden**2), "data")
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(w, x)

  state = jls.loss_scaling(optax.sgd(0.1)).init(w)
  grad_fn = jls.scaled_value_and_grad(loss, probes=True)
  value, grads, probes = (jax.jit(grad_fn) if jit else grad_fn)(state, w, x)
  chex.assert_trees_all_equal((value, grads),
                              jax.jit(jls.scaled_value_and_grad(loss))(state, w, x))
  assert int(probes["hidden"].hits) == 8

def test_a_named_vmap_inside_or_around_shard_map_agrees_over_the_devices_only(mesh):
  # Inside a mesh the replicas are its devices: a named vmap there (an ensemble per
  # device) keeps its members apart, as before named vmaps agreed outside meshes.
  g = jnp.ones((8, 2)).at[:, 0].set(jnp.nan)  # member 0 of every device's pair is bad
  g = jax.device_put(g, NamedSharding(mesh, P("data")))
  inside = jax.jit(jax.shard_map(
      lambda x: jax.vmap(jls.all_finite, axis_name="ens")(x[0])[None], mesh=mesh,
      in_specs=P("data"), out_specs=P("data")))(g)
  assert np.asarray(inside).tolist() == [[False, True]] * 8
  rows = jnp.ones((3, 8)).at[1, 5].set(jnp.inf)
  rows = jax.device_put(rows, NamedSharding(mesh, P(None, "data")))
  around = jax.vmap(jax.shard_map(lambda x: jls.all_finite(x)[None], mesh=mesh,
                                  in_specs=P("data"), out_specs=P("data")), axis_name="ens")
  assert np.asarray(around(rows)).tolist() == [[True] * 8, [False] * 8, [True] * 8]
  # A tree with nothing to check gives a constant, whose type carries no mesh.
  ints = jax.device_put(jnp.ones((8, 2), jnp.int32), NamedSharding(mesh, P("data")))
  constant = jax.jit(jax.shard_map(
      lambda x: jax.vmap(jls.all_finite, axis_name="ens")(x[0])[None], mesh=mesh,
      in_specs=P("data"), out_specs=P("data")))(ints)
  assert np.asarray(constant).tolist() == [[True, True]] * 8


def test_a_named_vmap_over_arrays_sharded_by_an_explicit_mesh_keeps_its_members_apart():
  # The mesh's devices are the replicas there; agreeing over the vmap too would need a
  # collective over a sharded axis.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    xs = jax.device_put(jnp.ones((8, 4)).at[1, 0].set(jnp.nan), P("data"))
    flags = jax.jit(jax.vmap(jls.all_finite, axis_name="b"))(xs)
  assert np.asarray(flags).tolist() == [True, False] + [True] * 6


def test_a_vmap_axis_named_inside_shard_map_with_check_vma_is_refused_naming_axis_name(mesh):
  g = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P("data")))
  per_device = lambda x: jax.vmap(lambda t: jls.all_finite(t, axis_name="v"),
                                  axis_name="v")(x[0])[None]
  with pytest.raises(ValueError, match="`axis_name`.*'v'"):
    jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(g)


def test_the_recorded_gradient_norm_is_the_largest_devices_so_replicas_keep_one_state(mesh):
  params = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P("data")))
  unscaled = jnp.arange(24.0).reshape(8, 3) / 10  # device i holds row i
  scaled = jax.device_put(unscaled * 4.0, NamedSharding(mesh, P("data")))
  tx = jls.loss_scaling(optax.adam(0.1), jls.DynamicLossScale(4.0), axis_name="data",
                        grad_norm=True)
  state = tx.init(params)
  _, new_state = shard_map_update(tx, mesh, state_specs(state))(scaled, state, params)
  largest = float(np.max(np.linalg.norm(np.asarray(unscaled), axis=1)))
  assert float(jls.metrics(new_state)["grad_norm"]) == pytest.approx(largest, rel=1e-6)


# --- probes and autocast on 8 devices -------------------------------------------------


def test_probes_under_shard_map_and_pmap_count_every_devices_hits():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  xs = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), F16)
  headroom = diagnostics.headroom

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  def sharded(params, x):
    return pr.all_reduce_probes(with_probes(mlp)(params, x)[2], "data")

  probes, whole = sharded(PARAMS, xs), with_probes(mlp)(PARAMS, xs)[2]
  assert int(probes["layer_0"].hits) == 8
  # Each device's loss is a mean over 16 elements instead of 128: gradients 8 times larger.
  assert headroom(probes) == {n: h - 3 for n, h in headroom(whole).items()}

  def sharded_loss(params, x):  # probes outside: the transposition sums the devices
    shard = partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    return shard(lambda p, x: lax.pmean(mlp(p, x), "data"))(params, x)

  probes = jax.jit(with_probes(sharded_loss))(PARAMS, xs)[2]
  assert int(probes["layer_0"].hits) == 8 and headroom(probes) == headroom(whole)

  def pmapped(params, x):
    return pr.all_reduce_probes(with_probes(mlp)(params, x)[2], "data")

  probes = jax.pmap(pmapped, axis_name="data", in_axes=(None, 0))(PARAMS, xs.reshape(8, 2, 8))
  assert list(np.asarray(probes["layer_0"].hits)) == [8] * 8
  on_device_0 = jax.tree.map(lambda leaf: leaf[0], probes)
  assert headroom(on_device_0) == {n: h - 3 for n, h in headroom(whole).items()}

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  def replicated(w, x):  # a tensor the same on every device, beside a sharded one
    def loss(w, x):
      return jnp.sum(pr.probe(jnp.sin(w), "replicated")) + jnp.sum(pr.probe(x * w[0], "x"))
    return pr.all_reduce_probes(with_probes(loss)(w, x)[2], "data")

  probes = replicated(jnp.ones(4), jnp.ones(8))
  assert int(probes["replicated"].hits) == 8 and int(probes["x"].hits) == 8
  assert float(probes["replicated"].forward.max_abs) == 0.5  # sin(1)'s binade, 8 hits


def test_shard_map_and_pmap_bodies_are_autocast():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  w, x = jnp.eye(4) / 2, jnp.arange(32.0).reshape(8, 4) / 32

  def loss(w, x):
    def body(w, x):
      h = lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=2)[0]
      return lax.psum(jnp.sum(h ** 2), "data")
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(w, x)

  ran = jls.precision_summary(jls.autocast(loss), w, x)
  assert {d for p, d, f, b in ran.rows if p == "dot_general"} == {"float16"}, ran
  grads = jax.jit(jax.grad(jls.autocast(loss)))(w, x)
  assert grads.dtype == jnp.float32
  np.testing.assert_allclose(grads, jax.grad(loss)(w, x), rtol=2e-2, atol=2e-3)
  pmapped = jax.pmap(jls.autocast(lambda w, x: jnp.tanh(x @ w)), in_axes=(None, 0))(w, x[:, None])
  np.testing.assert_allclose(pmapped[:, 0], jnp.tanh(x @ w), rtol=2e-2, atol=2e-3)


def test_stochastic_rounding_draws_equal_bits_for_replicas_and_other_bits_for_shards():
  # Every shard holds the same values: only the device's index can tell them apart.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  n = 512
  params = {"replicated": jnp.ones(n, jnp.bfloat16), "sharded": jnp.ones(8 * n, jnp.bfloat16)}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, -1e-3, p.dtype), params)
  tx = jls.loss_scaling(optax.sgd(1.0), jls.NoOpLossScale(), rounding="stochastic")
  state = tx.init(params)
  specs = {"replicated": P(), "sharded": P("data")}

  def step(g, s, p):
    new = tx.apply_gradients(g, s, p)[0]
    return new["replicated"][None], new["sharded"]  # each device's copy of the replicated one

  replicas, shards = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(specs, jax.tree.map(lambda _: P(), state), specs),
      out_specs=(P("data"), P("data"))))(grads, state, params)
  replicas, shards = np.asarray(replicas, np.float32), np.asarray(shards, np.float32)
  assert len(np.unique(replicas[0])) == 2  # rounded up here, down there
  assert all(np.array_equal(row, replicas[0]) for row in replicas)
  shards = shards.reshape(8, n)
  assert len({row.tobytes() for row in shards}) == 8


def test_stochastic_rounding_under_pmap_draws_equal_bits_for_every_replica():
  # pmap says nothing of which arrays are sharded: replicas of one parameter, equal values,
  # draw equal bits and stay replicas; one replica's overflow skips every replica's step,
  # the rounding counter included.
  tx = jls.loss_scaling(optax.sgd(1.0), jls.NoOpLossScale(), rounding="stochastic")
  params = {"w": jnp.ones(512, jnp.bfloat16)}
  state = tx.init(params)
  replicated = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * 8), tree)
  step = jax.pmap(tx.apply_gradients, axis_name="batch")
  grads = replicated({"w": jnp.full(512, -1e-3, jnp.bfloat16)})
  new, new_state = step(grads, replicated(state), replicated(params))
  rows = np.asarray(new["w"], np.float32)
  assert len(np.unique(rows[0])) == 2  # rounded up here, down there
  assert all(np.array_equal(row, rows[0]) for row in rows)
  assert np.asarray(new_state.rounding_counter).tolist() == [1] * 8
  skipped, skipped_state = step({"w": grads["w"].at[3, 7].set(jnp.inf)}, new_state, new)
  chex.assert_trees_all_equal(skipped, new)
  chex.assert_trees_all_equal(skipped_state.rounding_counter, new_state.rounding_counter)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "compensated"])
def test_a_data_by_model_mesh_steps_on_gradients_averaged_over_data(rounding):
  # The usual data- and model-parallel step: the gradients, averaged over "data", vary
  # over "model" only. The check's collective over both axes failed (JAX refuses to sum
  # a value over an axis it does not vary over).
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  params = {"w": jnp.linspace(-1, 1, 2 * 64).astype(jnp.bfloat16)}
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0), rounding=rounding,
                        state_dtype=jnp.bfloat16)
  state = tx.init(params)
  model = lambda x: P("model") if x.shape == (2 * 64,) else P()
  state_specs = jax.tree.map(model, state)

  def step(batch, s, p):
    grads = jax.grad(lambda p: jnp.mean((batch * p["w"]) ** 2))(p)
    return tx.apply_gradients(jax.lax.pmean(grads, "data"), s, p)

  sharded = jax.jit(jax.shard_map(step, mesh=mesh,
                                  in_specs=(P("data", "model"), state_specs, {"w": P("model")}),
                                  out_specs=({"w": P("model")}, state_specs)))
  batch = jnp.linspace(0.5, 1.5, 8 * 2 * 64).reshape(8, 2 * 64).astype(jnp.bfloat16)
  new, new_state = sharded(batch, state, params)
  assert not np.array_equal(np.asarray(new["w"]), np.asarray(params["w"]))
  assert float(new_state.loss_scale()) == 8.0 and int(new_state.skipped_steps) == 0
  if rounding != "stochastic":  # elementwise from averaged gradients: as on one device
    grads = jax.grad(lambda p: jnp.mean((batch * p["w"]) ** 2))(params)
    alone, _ = jax.jit(lambda g, s, p: tx.apply_gradients(g, s, p))(grads, state, params)
    np.testing.assert_allclose(np.asarray(new["w"], np.float32),
                               np.asarray(alone["w"], np.float32), atol=2**-8)
  # One device's rows overflow: every device skips, and nothing it keeps moves.
  skipped, skipped_state = sharded(batch.at[5, 70].set(jnp.inf), state, params)
  chex.assert_trees_all_equal(skipped, params)
  chex.assert_trees_all_equal(skipped_state.inner_state, state.inner_state)
  chex.assert_trees_all_equal(skipped_state.compensation, state.compensation)
  chex.assert_trees_all_equal(skipped_state.rounding_counter, state.rounding_counter)
  assert float(skipped_state.loss_scale()) == 4.0 and int(skipped_state.skipped_steps) == 1


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16])
def test_bfloat16_writes_under_shard_map_of_sharded_and_replicated_parameters(
    rounding, state_dtype):
  # What orders the in-place writes reads a sharded parameter's entries: never into a
  # replicated parameter's or the state's writes, which would then vary over the devices.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params = {"a": jnp.linspace(-1, 1, 8 * 64).astype(jnp.bfloat16),
            "b": jnp.linspace(-1, 1, 64).astype(jnp.bfloat16)}
  specs = {"a": P("data"), "b": P()}
  grads = jax.tree.map(lambda p: (p * 0.1).astype(p.dtype), params)
  tx = jls.loss_scaling(optax.adam(1e-2), jls.NoOpLossScale(), rounding=rounding,
                        state_dtype=state_dtype)
  state = tx.init(params)
  state_specs = jax.tree.map(lambda _: P(), state)
  state_specs = state_specs._replace(
      inner_state=jax.tree.map(lambda x: P("data") if x.shape == (8 * 64,) else P(),
                               state.inner_state),
      compensation=None if state.compensation is None else specs)
  step = jax.jit(jax.shard_map(lambda g, s, p: tx.apply_gradients(g, s, p), mesh=mesh,
                               in_specs=(specs, state_specs, specs),
                               out_specs=(specs, state_specs)))
  new, _ = step(grads, state, params)
  alone, _ = jax.jit(lambda g, s, p: tx.apply_gradients(g, s, p))(grads, state, params)
  if rounding == "compensated":  # elementwise, no random bits: as on one device
    chex.assert_trees_all_equal(new, alone)
  else:
    for name in params:
      np.testing.assert_allclose(np.asarray(new[name], np.float32),
                                 np.asarray(alone[name], np.float32), atol=2**-7)


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_bfloat16_writes_of_parameters_sharded_by_an_explicit_mesh(rounding):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  values = jnp.linspace(-1, 1, 64).reshape(16, 4).astype(jnp.bfloat16)
  tx = jls.loss_scaling(optax.adam(1e-2), jls.NoOpLossScale(), rounding=rounding,
                        state_dtype=jnp.bfloat16)
  step = jax.jit(lambda g, s, p: tx.apply_gradients(g, s, p))
  alone, _ = step({"w": values * 0.1}, tx.init({"w": values}), {"w": values})
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(values, NamedSharding(mesh, P("data")))}
    grads = jax.tree.map(lambda x: x * 0.1, params)
    new, _ = jax.jit(lambda g, s, p: tx.apply_gradients(g, s, p),
                     donate_argnums=(1, 2))(grads, jax.jit(tx.init)(params), params)
  assert new["w"].sharding.spec == P("data", None)
  if rounding == "compensated":
    chex.assert_trees_all_equal(jax.device_get(new), jax.device_get(alone))


def test_fp8_in_a_data_parallel_shard_map_scales_each_devices_shard_on_its_own():
  # Replicated weights, the batch sharded: each device computes its operands' amax from its
  # own shard, so one device's outlier rows leave the other devices at float8's error.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (8 * 32, 64)).at[:32].multiply(1e5)  # device 0's rows
  w = jax.random.normal(kw, (64, 48)) / 8
  matmul = jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8="tensorwise")
  sharded = jax.jit(jax.shard_map(matmul, mesh=mesh, in_specs=(P("data"), P()),
                                  out_specs=P("data")))

  def others_error(out):
    return float(jnp.linalg.norm(out[32:] - (x @ w)[32:]) / jnp.linalg.norm((x @ w)[32:]))

  assert others_error(sharded(x, w)) < 0.05
  assert others_error(jax.jit(matmul)(x, w)) > 0.2  # one amax for the whole batch


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gradients_of_a_data_parallel_shard_map_and_pmap_are_within_float8s_error(recipe):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  kx, kw, kc = jax.random.split(jax.random.key(1), 3)
  x, w = jax.random.normal(kx, (8 * 32, 64)), jax.random.normal(kw, (64, 48)) / 8
  c = jax.random.normal(kc, (8 * 32, 48))

  def per_device(w, x, c):
    return lax.pmean(jnp.mean(jnp.tanh(x @ w) * c), "data")

  def sharded_loss(w, x, c):
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=P())(w, x, c)

  def error(got, want):
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))

  fp8 = partial(jls.autocast, compute_dtype=jnp.bfloat16, fp8=recipe)
  expected = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) * c))(w)
  single_device = jax.jit(jax.grad(fp8(lambda w, x, c: jnp.mean(jnp.tanh(x @ w) * c))))(w, x, c)
  sharded = jax.jit(jax.grad(fp8(sharded_loss)))(w, x, c)
  pmapped = jax.pmap(lambda *args: lax.pmean(jax.grad(fp8(per_device))(*args), "data"),
                     axis_name="data", in_axes=(None, 0, 0))(
      w, x.reshape(8, 32, 64), c.reshape(8, 32, 48))
  assert sharded.dtype == jnp.float32
  assert error(single_device, expected) < 0.07
  assert error(sharded, expected) < 0.07
  # Per-shard scales round differently from one device's: two float8 errors apart, no more.
  assert 0 < error(sharded, single_device) < 0.1
  for replica in pmapped:
    np.testing.assert_allclose(replica, sharded, rtol=1e-5, atol=1e-7)
  ran = jls.precision_summary(fp8(sharded_loss), w, x, c)
  grad_format = jnp.float8_e5m2 if recipe == "tensorwise" else jnp.float8_e4m3fn
  assert ran.count("dot_general", jnp.float8_e4m3fn) == 1
  assert ran.count("dot_general", grad_format, backward=True) == 2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_an_explicit_mesh_shards_each_gradient_as_its_operand(recipe):
  # The weight's gradient of a batch-sharded matmul contracts the sharded batch: JAX must
  # be told its sharding (the weight's), as its own transpose of `dot_general` tells it;
  # and a forward matmul's own `out_sharding` is kept.
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  kx, kw = jax.random.split(jax.random.key(2))
  x, w = jax.random.normal(kx, (64, 256)), jax.random.normal(kw, (256, 64)) / 16
  loss = jls.autocast(lambda w, x: jnp.mean((x @ w) ** 2), jnp.bfloat16, fp8=recipe)
  unsharded = jax.jit(jax.grad(loss))(w, x)
  with jax.set_mesh(mesh):
    for x_spec, w_spec in [(P("data"), P()), (P("data"), P(None, "model"))]:
      sharded_w = jax.device_put(w, w_spec)
      grads = jax.jit(jax.grad(loss))(sharded_w, jax.device_put(x, x_spec))
      assert grads.sharding.is_equivalent_to(sharded_w.sharding, w.ndim)
      np.testing.assert_array_equal(grads, unsharded)
    matmul = jls.autocast(lambda x, w: jnp.matmul(x, w, out_sharding=P()), jnp.bfloat16,
                          fp8=recipe)
    out = jax.jit(matmul)(jax.device_put(x, P(None, "model")), jax.device_put(w, P("model")))
    assert out.sharding.spec == P(None, None)
    assert float(jnp.linalg.norm(out - x @ w) / jnp.linalg.norm(x @ w)) < 0.06


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_convolutions_on_an_explicit_mesh_shard_each_gradient_as_its_operand(recipe):
  # The kernel's gradient of a batch-sharded convolution contracts the sharded batch.
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x = jax.random.normal(jax.random.key(0), (8, 16, 16, 32))
  w = jax.random.normal(jax.random.key(1), (3, 3, 32, 32)) / 16
  conv = lambda w, x: jnp.mean(lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)
  loss = jls.autocast(conv, jnp.bfloat16, fp8=jls.Float8Recipe.from_name(recipe, convolutions=True))
  unsharded = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, x)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(w, P()), jax.device_put(x, P("data"))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*sharded)
  for grad, operand, expected in zip(grads, sharded, unsharded, strict=True):
    assert grad.sharding.is_equivalent_to(operand.sharding, operand.ndim)
    np.testing.assert_array_equal(grad, expected)
