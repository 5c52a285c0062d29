"""Real training loops, data parallel on 8 devices, one replica's data poisoned.

Each loop is a public example's shape with loss scaling ported in: flax linen's ImageNet
example (`pmap`, `TrainState` with `batch_stats`), dm-haiku's ImageNet example with jmp's
loss-scale API, flax NNX with `nnx.Optimizer` and an orbax checkpoint mid-run, and
gradient accumulation with `optax.MultiSteps`. On chosen steps one replica's batch holds
an inf (its forward pass) or an outlier (its backward pass overflows float16). Every
loop checks that the poisoned steps were skipped on every replica, that every replica
ends bit-identical (parameters, optimizer state, loss scale, BatchNorm statistics), that
nothing non-finite reached the state, and that the clean steps train.

`test_distributed.py` runs this file, with `multidevice_cases.py`, in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (never set globally).
"""

import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import jax_utils
from flax import linen as nn
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_lossscale as jls
import jax_lossscale.jmp as jmp
from jax_lossscale.flax import TrainState as LossScalingTrainState

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 devices")

REPLICAS = 8
F16 = jnp.float16


def assert_replicas_bit_identical(tree):
  """Every leaf of a `pmap` output (leading axis: replicas) has the same bytes everywhere."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    leaf = np.asarray(leaf)
    differ = [i for i in range(1, REPLICAS) if leaf[i].tobytes() != leaf[0].tobytes()]
    assert leaf.shape[0] == REPLICAS and not differ, (
        f"{jax.tree_util.keystr(path)} differs from replica 0 on replicas {differ}")


def assert_shards_bit_identical(tree):
  """Every array of `tree` is replicated, with the same bytes on every device."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    assert leaf.sharding.is_fully_replicated, jax.tree_util.keystr(path)
    copies = [np.asarray(shard.data).tobytes() for shard in leaf.addressable_shards]
    assert len(copies) == REPLICAS and len(set(copies)) == 1, jax.tree_util.keystr(path)


def assert_trees_bit_identical(actual, expected):
  """The same structure, and every leaf with the same dtype and bytes."""
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(actual)
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for (path, a), b in zip(paths_and_leaves, jax.tree.leaves(expected), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def assert_all_finite(tree):
  """No inf or NaN in any floating leaf."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    leaf = np.asarray(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert np.isfinite(leaf).all(), f"{jax.tree_util.keystr(path)} is not finite"


# The data of the three image loops: 4 images per replica (their labels learnable), the
# same every step but for the poisoned steps, where one replica's first image holds an
# inf or a NaN.
NUM_CLASSES = 4
STEPS = 8
POISONED = {2: jnp.inf, 5: jnp.nan}


def image_batches(replica):
  """`STEPS` batches, each `{"image", "label"}` with a leading axis of replicas."""
  rng = np.random.default_rng(0)
  labels = rng.integers(0, NUM_CLASSES, size=(REPLICAS, 4))
  templates = rng.normal(size=(NUM_CLASSES, 6, 6, 3))
  images = rng.normal(size=(REPLICAS, 4, 6, 6, 3)) + 2 * templates[labels]
  clean = {"image": jnp.asarray(images, jnp.float32), "label": jnp.asarray(labels, jnp.int32)}
  return [dict(clean, image=clean["image"].at[replica, 0, 0, 0, 0].set(POISONED[step]))
          if step in POISONED else clean for step in range(STEPS)]


# --- flax linen: examples/imagenet/train.py ---------------------------------------------
#
# The example's model (models.py) in miniature, its `train_step` with the loss scale of
# `loss_scaling` in place of flax's `DynamicScale`, its `TrainState` with `batch_stats`,
# and `jax.pmap(..., axis_name="batch")`. As in the example, each replica keeps running
# statistics of its own batches, averaged by `sync_batch_stats` at the end of each epoch;
# the poisoned replica alone sees a non-finite loss.

EPOCH_STEPS = 4


class ResNetStem(nn.Module):
  """Conv, BatchNorm (statistics of this replica's batch, as in the example), Dense."""

  dtype: Any = F16

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    x = nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype, name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(NUM_CLASSES, dtype=self.dtype)(x)
    return jnp.asarray(x, self.dtype)


class TrainState(LossScalingTrainState):
  batch_stats: Any


def cross_entropy_loss(logits, labels):
  one_hot_labels = jax.nn.one_hot(labels, NUM_CLASSES)
  return jnp.mean(optax.softmax_cross_entropy(logits=logits.astype(jnp.float32),
                                              labels=one_hot_labels))


def compute_metrics(logits, labels):
  loss = cross_entropy_loss(logits, labels)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  return lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")


def flax_train_step(state, batch, learning_rate_fn, averaged_by):
  """The example's `train_step`; `averaged_by` is who averages the gradients."""

  def loss_fn(params):
    logits, new_model_state = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, batch["image"],
        mutable=["batch_stats"])
    loss = cross_entropy_loss(logits, batch["label"])
    weight_penalty_params = jax.tree_util.tree_leaves(params)
    weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
    loss = loss + 0.0001 * 0.5 * weight_l2
    return loss, (new_model_state, logits)

  if averaged_by == "user":
    # Each replica's own loss goes to `apply_gradients`: the decision is agreed anyway.
    grad_fn = jls.scaled_value_and_grad(loss_fn, has_aux=True)
    (loss, (new_model_state, logits)), grads = grad_fn(state.opt_state, state.params)
    grads = lax.pmean(grads, axis_name="batch")
  else:  # as `DynamicScale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")`
    grad_fn = jls.scaled_value_and_grad(loss_fn, has_aux=True, axis_name="batch")
    (loss, (new_model_state, logits)), grads = grad_fn(state.opt_state, state.params)
  metrics = compute_metrics(logits, batch["label"])
  metrics["learning_rate"] = learning_rate_fn(state.step)
  new_state = state.apply_gradients(grads=grads, loss=loss,
                                    batch_stats=new_model_state["batch_stats"])
  # Each replica's own, not averaged.
  metrics.update(jls.metrics(new_state.opt_state), replica_loss=loss)
  return new_state, metrics


cross_replica_mean = jax.pmap(lambda x: lax.pmean(x, "x"), "x")


def sync_batch_stats(state):
  """The example's: the replicas' running statistics averaged, before eval and checkpoints."""
  return state.replace(batch_stats=cross_replica_mean(state.batch_stats))


@pytest.mark.parametrize("averaged_by", ["user", "scaled_value_and_grad"])
def test_flax_imagenet_loop_skips_a_poisoned_replicas_steps_everywhere(averaged_by):
  model = ResNetStem()
  variables = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 6, 6, 3), F16))
  learning_rate_fn = optax.warmup_cosine_decay_schedule(0.0, 1.0, 2, STEPS)
  tx = jls.loss_scaling(optax.sgd(learning_rate_fn, momentum=0.9, nesterov=True),
                        jls.DynamicLossScale(2.0**10, increment_period=3))
  state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                            batch_stats=variables["batch_stats"])
  state = jax_utils.replicate(state)
  p_train_step = jax.pmap(functools.partial(flax_train_step, learning_rate_fn=learning_rate_fn,
                                            averaged_by=averaged_by), axis_name="batch")

  logged = []
  for step, batch in enumerate(image_batches(replica=3)):
    previous = state
    state, metrics = p_train_step(state, batch)
    logged.append(jax.device_get(metrics))
    if step in POISONED:  # the poisoned replica's statistics too were kept
      assert_trees_bit_identical(state.batch_stats, previous.batch_stats)
    if (step + 1) % EPOCH_STEPS == 0:
      state = sync_batch_stats(state)

  if averaged_by == "user":  # on poisoned steps, replica 3 alone had a non-finite loss
    assert [np.isfinite(logged[step]["replica_loss"]).tolist() for step in POISONED] == [
        [replica != 3 for replica in range(REPLICAS)]] * len(POISONED)
  applied = [m["last_applied"].tolist() for m in logged]
  assert applied == [[step not in POISONED] * REPLICAS for step in range(STEPS)]
  # A non-finite loss is a forward-pass problem: the scale is kept, and grows after
  # every 3 applied steps.
  scales = [m["loss_scale"].tolist() for m in logged]
  assert scales == [[s] * REPLICAS for s in [2.0**10] * 3 + [2.0**11] * 4 + [2.0**12]]
  assert_replicas_bit_identical(state)
  assert_all_finite((state.params, state.opt_state, state.batch_stats))
  assert logged[-1]["skipped_steps"].tolist() == [2] * REPLICAS
  assert logged[-1]["nonfinite_loss_steps"].tolist() == [2] * REPLICAS
  assert optax.tree.get(state.opt_state, "count").tolist() == [6] * REPLICAS  # lr schedule
  assert state.step.tolist() == [STEPS] * REPLICAS
  losses = [float(m["loss"][0]) for m in logged]
  clean = [loss for step, loss in enumerate(losses) if step not in POISONED]
  assert np.all(np.diff(clean) <= 0) and clean[-1] < 0.8 * clean[0], losses


# --- dm-haiku with jmp: examples/imagenet/train.py ---------------------------------------
#
# The example's `train_step` line for line, with `import jax_lossscale.jmp as jmp`: the
# loss scaled in `loss_fn`, the gradients cast to the compute dtype, unscaled, averaged
# with `pmean`, cast back, and `jmp.all_finite` / `adjust` / `jmp.select_tree` over the
# parameters, the BatchNorm state and the optimizer state. The model is plain JAX in the
# shape `hk.transform_with_state` gives (haiku is not a dependency): a Linear, a
# BatchNorm with cross-replica statistics (`hk.BatchNorm(cross_replica_axis="i")`)
# under its own precision policy, and a Linear.

MP_POLICY = jmp.get_policy("p=f32,c=f16,o=f32")
MP_BN_POLICY = jmp.get_policy("p=f32,c=f32,o=f16")
HIDDEN = 16


class HaikuTrainState(NamedTuple):
  params: Any
  state: Any
  opt_state: Any
  loss_scale: jmp.LossScale


def forward_init(rng):
  """`forward.init`: the parameters and the BatchNorm state, named as haiku names them."""
  k1, k2 = jax.random.split(rng)
  fan_in = 6 * 6 * 3
  params = {
      "linear": {"w": jax.random.truncated_normal(k1, -2, 2, (fan_in, HIDDEN)) / fan_in**0.5,
                 "b": jnp.zeros(HIDDEN)},
      "batch_norm": {"scale": jnp.ones(HIDDEN), "offset": jnp.zeros(HIDDEN)},
      "linear_1": {"w": jax.random.truncated_normal(k2, -2, 2, (HIDDEN, NUM_CLASSES)) / 4,
                   "b": jnp.zeros(NUM_CLASSES)},
  }
  state = {"batch_norm/~/mean_ema": jnp.zeros(HIDDEN), "batch_norm/~/var_ema": jnp.ones(HIDDEN)}
  return params, state


def forward_apply(params, state, batch, is_training=True):
  """`forward.apply(params, state, None, batch, is_training=True)`."""
  del is_training
  p = MP_POLICY.cast_to_compute(params)
  x = MP_POLICY.cast_to_compute(batch["images"]).reshape(batch["images"].shape[0], -1)
  x = x @ p["linear"]["w"] + p["linear"]["b"]
  x = MP_BN_POLICY.cast_to_compute(x)
  mean = lax.pmean(jnp.mean(x, 0), "i")
  var = lax.pmean(jnp.mean(jnp.square(x), 0), "i") - jnp.square(mean)
  x = (x - mean) * lax.rsqrt(var + 1e-5) * params["batch_norm"]["scale"]
  x = MP_BN_POLICY.cast_to_output(x + params["batch_norm"]["offset"])
  decay = 0.9
  state = {"batch_norm/~/mean_ema": decay * state["batch_norm/~/mean_ema"] + (1 - decay) * mean,
           "batch_norm/~/var_ema": decay * state["batch_norm/~/var_ema"] + (1 - decay) * var}
  logits = jax.nn.relu(x) @ p["linear_1"]["w"] + p["linear_1"]["b"]
  return MP_POLICY.cast_to_output(logits), state


def lr_schedule(step):
  return 0.5 * jnp.minimum(1.0, (step + 1) / 2)


def make_optimizer():
  """SGD with nesterov momentum and a learning-rate schedule, as the example's."""
  return optax.chain(optax.trace(decay=0.9, nesterov=True), optax.scale_by_schedule(lr_schedule),
                     optax.scale(-1))


def l2_loss(params):
  return 0.5 * sum(jnp.sum(jnp.square(p)) for p in params)


def haiku_loss_fn(params, state, loss_scale, batch):
  logits, state = forward_apply(params, state, batch, is_training=True)
  labels = jax.nn.one_hot(batch["labels"], NUM_CLASSES)
  loss = optax.softmax_cross_entropy(logits=logits, labels=labels).mean()
  l2_params = [p for path, p in jax.tree_util.tree_leaves_with_path(params)
               if "batch_norm" not in jax.tree_util.keystr(path)]
  loss = loss + 1e-4 * l2_loss(l2_params)
  return loss_scale.scale(loss), (loss, state)


@functools.partial(jax.pmap, axis_name="i", donate_argnums=(0,))
def haiku_train_step(train_state, batch):
  params, state, opt_state, loss_scale = train_state
  grads, (loss, new_state) = jax.grad(haiku_loss_fn, has_aux=True)(
      params, state, loss_scale, batch)
  grads = MP_POLICY.cast_to_compute(grads)
  grads = loss_scale.unscale(grads)
  # Taking the mean across all replicas to keep params in sync.
  grads = lax.pmean(grads, axis_name="i")
  grads = MP_POLICY.cast_to_param(grads)
  updates, new_opt_state = make_optimizer().update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  grads_finite = jmp.all_finite(grads)
  loss_scale = loss_scale.adjust(grads_finite)
  new_params, new_state, new_opt_state = jmp.select_tree(
      grads_finite, (new_params, new_state, new_opt_state), (params, state, opt_state))
  scalars = {"train_loss": loss, "loss_scale": loss_scale.loss_scale,
             "grads_finite": grads_finite}
  new_state, scalars = jmp.cast_to_full((new_state, scalars))
  scalars = lax.pmean(scalars, axis_name="i")
  return HaikuTrainState(new_params, new_state, new_opt_state, loss_scale), scalars


def make_initial_state(rng, batch):
  del batch
  params, state = forward_init(rng)
  loss_scale = jmp.DynamicLossScale(2.0**10, period=2)  # get_initial_loss_scale()
  return HaikuTrainState(params, state, make_optimizer().init(params), loss_scale)


def test_haiku_imagenet_loop_with_jmp_skips_a_poisoned_replicas_steps_everywhere():
  batches = [{"images": b["image"], "labels": b["label"]} for b in image_batches(replica=6)]
  rng = jax.random.PRNGKey(42)
  rng = jnp.broadcast_to(rng, (REPLICAS,) + rng.shape)
  train_state = jax.pmap(make_initial_state)(rng, batches[0])

  logged = []
  for batch in batches:
    previous = jax.device_get(train_state)
    train_state, scalars = haiku_train_step(train_state, batch)
    logged.append(jax.device_get(scalars))
    if not scalars["grads_finite"][0]:  # skipped: the BatchNorm state too was kept
      assert_trees_bit_identical(train_state.state, previous.state)

  # The flag averaged over replicas is 0 or 1: they all took the same decision.
  assert [float(s["grads_finite"][0]) for s in logged] == [
      float(step not in POISONED) for step in range(STEPS)]
  # jmp's rule: halve on a skipped step, double after every 2 finite steps in a row.
  scales = [float(s["loss_scale"][0]) for s in logged]
  assert scales == [2.0**k for k in (10, 11, 10, 10, 11, 10, 10, 11)]
  assert_replicas_bit_identical(train_state)
  assert_all_finite(train_state)
  assert optax.tree.get(train_state.opt_state, "count").tolist() == [6] * REPLICAS
  clean = [float(s["train_loss"][0]) for step, s in enumerate(logged) if step not in POISONED]
  assert np.all(np.diff(clean) <= 0) and clean[-1] < 0.8 * clean[0], clean


# --- flax NNX with orbax: the MNIST tutorial's loop, data parallel, checkpointed --------
#
# The tutorial's model, `nnx.Optimizer(model, tx, wrt=nnx.Param)` and `nnx.jit` step,
# run data parallel as the NNX sharding guide does: the state replicated over an
# 8-device mesh, each batch sharded over it, one device's shard poisoned. The NNX
# checkpointing guide's orbax round trip of `nnx.state` mid-run.

CHECKPOINT_AFTER = 4  # between the poisoned steps


class CNN(nnx.Module):
  """The tutorial's CNN in miniature, in float16 with float32 parameters, plus BatchNorm."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv = nnx.Conv(3, 4, kernel_size=(3, 3), dtype=F16, rngs=rngs)
    self.norm = nnx.BatchNorm(4, dtype=F16, rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear = nnx.Linear(3 * 3 * 4, NUM_CLASSES, dtype=F16, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.norm(self.conv(x))))
    return self.linear(x.reshape(x.shape[0], -1))


@nnx.jit
def nnx_train_step(model, optimizer, batch):
  # A copy: `nnx.state` holds the model's own Variables, which the forward pass updates.
  batch_stats = jax.tree.map(lambda x: x, nnx.state(model, nnx.BatchStat))

  def loss_fn(model):
    logits = model(batch["image"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  grad_fn = jls.scaled_value_and_grad(loss_fn, value_and_grad=nnx.value_and_grad)
  loss, grads = grad_fn(optimizer.opt_state, model)
  optimizer.update(model, grads, loss=loss)
  # The running statistics follow the step's decision.
  nnx.update(model, jls.if_applied(optimizer, nnx.state(model, nnx.BatchStat), batch_stats))
  return loss, jls.metrics(optimizer)


def create(mesh, seed):
  """A model and its optimizer, every array replicated over `mesh`."""
  model = CNN(rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(
      model, jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(2.0**10, increment_period=3)),
      wrt=nnx.Param)
  replicated = NamedSharding(mesh, P())
  for node in (model, optimizer):
    nnx.update(node, jax.device_put(nnx.state(node), replicated))
  return model, optimizer


def save(directory, model, optimizer):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})


def restore(directory, model, optimizer):
  """Restores into a fresh model and optimizer, with their shardings."""
  target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(directory, abstract)
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])


def sharded_batches(mesh, device):
  """`image_batches` as global batches of 4 images per device, sharded over `mesh`."""
  sharding = NamedSharding(mesh, P("data"))
  return [jax.device_put(jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch), sharding)
          for batch in image_batches(device)]


def nnx_run(model, optimizer, batches):
  logged = []
  mesh = batches[0]["image"].sharding.mesh
  # jax.set_mesh as flax's examples use it: from jax 0.11, where make_mesh's axes are
  # Explicit, optax's integer-label cross-entropy cannot be differentiated without it.
  with jax.set_mesh(mesh):
    for batch in batches:
      loss, metrics = nnx_train_step(model, optimizer, batch)
      logged.append((float(loss), bool(metrics["last_applied"]), float(metrics["loss_scale"])))
  return logged


def test_nnx_loop_restored_from_an_orbax_checkpoint_equals_the_uninterrupted_run(tmp_path):
  mesh = jax.make_mesh((REPLICAS,), ("data",))
  batches = sharded_batches(mesh, device=1)
  poisoned_shards = [not np.isfinite(np.asarray(s.data)).all()
                     for s in batches[2]["image"].addressable_shards]
  assert poisoned_shards == [device == 1 for device in range(REPLICAS)]

  model, optimizer = create(mesh, seed=0)
  logged = nnx_run(model, optimizer, batches)

  resumed_model, resumed_optimizer = create(mesh, seed=0)
  logged_before = nnx_run(resumed_model, resumed_optimizer, batches[:CHECKPOINT_AFTER])
  save(tmp_path / "checkpoint", resumed_model, resumed_optimizer)
  resumed_model, resumed_optimizer = create(mesh, seed=1)  # restored over other weights
  restore(tmp_path / "checkpoint", resumed_model, resumed_optimizer)
  logged_after = nnx_run(resumed_model, resumed_optimizer, batches[CHECKPOINT_AFTER:])

  assert [applied for _, applied, _ in logged] == [s not in POISONED for s in range(STEPS)]
  assert [scale for _, _, scale in logged] == [2.0**10] * 3 + [2.0**11] * 4 + [2.0**12]
  final = (nnx.state(model), nnx.state(optimizer))
  assert_trees_bit_identical((nnx.state(resumed_model), nnx.state(resumed_optimizer)), final)
  np.testing.assert_equal(logged_before + logged_after, logged)  # losses too, NaN included
  assert_shards_bit_identical(final)
  assert_all_finite(final)
  assert int(jls.metrics(optimizer)["skipped_steps"]) == 2
  clean = [loss for step, (loss, _, _) in enumerate(logged) if step not in POISONED]
  assert np.all(np.diff(clean) <= 0) and clean[-1] < 0.8 * clean[0], clean


# --- gradient accumulation: optax.MultiSteps inside loss_scaling, under pmap -------------
#
# The README's float16 model, a macro step every 2 micro-batches, each replica's
# micro-batch gradients averaged with `pmean` and its own loss passed as `loss=`. One
# replica's micro-batch holds an inf (its forward pass) on one call and an outlier (its
# float16 backward pass overflows; its loss stays finite) on another.

EVERY_K = 2
MICRO_STEPS = 10
MICRO_POISONED = {3: jnp.inf, 6: 1000.0}  # call: an inf, or a factor on one input
MICRO_REPLICA = 5


def mlp_loss(params, x, y):
  h = jax.nn.relu(x.astype(F16) @ params["w1"].astype(F16))
  pred = (h @ params["w2"].astype(F16)).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def micro_batches():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(REPLICAS, 8, 16)).astype(np.float32)
  clean = {"x": jnp.asarray(x), "y": jnp.asarray(np.sin(x[..., :1]))}
  batches = []
  for call in range(MICRO_STEPS):
    batch = clean
    if call in MICRO_POISONED:
      value = MICRO_POISONED[call]
      row = clean["x"][MICRO_REPLICA, 0]
      row = row * value if np.isfinite(value) else row.at[0].set(value)
      batch = dict(clean, x=clean["x"].at[MICRO_REPLICA, 0].set(row))
    batches.append(batch)
  return batches


def test_multisteps_drops_a_poisoned_micro_batch_everywhere_and_grows_per_optimizer_step(
    branch):  # the select branch of the step too, traced here
  del branch
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (16, 64)) / 4, "w2": jax.random.normal(k2, (64, 1)) / 8}
  tx = jls.loss_scaling(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=EVERY_K),
                        jls.DynamicLossScale(2.0**10, increment_period=2))
  grad_fn = jls.scaled_value_and_grad(mlp_loss)

  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(opt_state, params, batch["x"], batch["y"])
    grads = lax.pmean(grads, axis_name="batch")
    params, opt_state = tx.apply_gradients(grads, opt_state, params, loss=loss)
    metrics = dict(jls.metrics(opt_state), replica_loss=loss,
                   loss=lax.pmean(loss, axis_name="batch"),
                   has_updated=tx.inner.has_updated(opt_state.inner_state))
    return params, opt_state, metrics

  p_train_step = jax.pmap(train_step, axis_name="batch")
  params = jax_utils.replicate(params)
  opt_state = jax.pmap(tx.init)(params)

  logged = []
  for batch in micro_batches():
    previous = jax.device_get(params)
    params, opt_state, metrics = p_train_step(params, opt_state, batch)
    logged.append(jax.device_get(metrics))
    if not metrics["has_updated"][0]:  # accumulated or dropped: the parameters did not move
      assert_trees_bit_identical(params, previous)

  applied = [m["last_applied"].tolist() for m in logged]
  assert applied == [[call not in MICRO_POISONED] * REPLICAS for call in range(MICRO_STEPS)]
  # The dropped micro-batches (calls 3 and 6) make their macro steps wait for one more.
  macro_ends = (1, 4, 7, 9)
  updated = [m["has_updated"].tolist() for m in logged]
  assert updated == [[call in macro_ends] * REPLICAS for call in range(MICRO_STEPS)]
  # Growth after 2 optimizer steps (calls 1 and 4), not 2 micro-batches; the overflow
  # at call 6 backs off, the inf loss at call 3 does not.
  scales = [m["loss_scale"].tolist() for m in logged]
  assert scales == [[2.0**k] * REPLICAS for k in (10, 10, 10, 10, 11, 11, 10, 10, 10, 11)]
  assert_replicas_bit_identical((params, opt_state))
  assert_all_finite((params, opt_state))
  assert logged[-1]["skipped_steps"].tolist() == [2] * REPLICAS
  assert logged[-1]["nonfinite_loss_steps"].tolist() == [1] * REPLICAS
  assert opt_state.inner_state.gradient_step.tolist() == [len(macro_ends)] * REPLICAS
  # Replica 5 alone had an inf loss at call 3; the outlier's loss is finite.
  assert np.isfinite(logged[3]["replica_loss"]).tolist() == [r != 5 for r in range(REPLICAS)]
  assert np.isfinite(logged[6]["replica_loss"]).all()
  losses = [float(m["loss"][0]) for m in logged]
  clean = [loss for call, loss in enumerate(losses) if call not in MICRO_POISONED]
  assert np.all(np.diff(clean) <= 0) and clean[-1] < 0.8 * clean[0], losses
