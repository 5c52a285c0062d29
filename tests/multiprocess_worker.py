"""One process of the two-process test in `test_distributed.py`.

Usage: multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
"""

import sys

import jax

PROCESS_ID, NUM_PROCESSES = int(sys.argv[1]), int(sys.argv[2])
PORT, OUT_DIR = sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    f"127.0.0.1:{PORT}", NUM_PROCESSES, PROCESS_ID,
    initialization_timeout=30, heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_lossscale as jls  # noqa: E402

STEPS, POISONED = 8, (2, 5)
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
n_local = jax.local_device_count()


def global_array(value, sharding):
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_batch(step):
  rng = np.random.default_rng(100 * step + PROCESS_ID)
  x = rng.normal(size=(2 * n_local, 4)).astype(np.float32)
  if step in POISONED and PROCESS_ID == 1:
    x[0, 0] = np.inf  # only this process's data is bad
  return jax.make_array_from_process_local_data(by_data, x)


def fetch(x):
  """This process's view: its local copy if replicated, else the gathered array."""
  if x.sharding.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return multihost_utils.process_allgather(x, tiled=True)


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def spmd():
  """Data parallel under SPMD jit: global arrays, no axis_name needed."""
  params = {"w": global_array(np.linspace(-1, 1, 12).reshape(4, 3), replicated),
            "b": global_array(np.zeros(3), replicated)}
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(2.0**8, increment_period=2))
  state = jax.jit(tx.init)(params)

  @jax.jit
  def step(params, state, x):
    _, grads = jls.scaled_value_and_grad(loss_fn)(state, params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  applied = []
  for i in range(STEPS):
    params, state = step(params, state, local_batch(i))
    applied.append(int(fetch(state.last_applied)))
  return params, state, applied


def shard_map_sharded_params():
  """Parameters sharded over all devices of both processes; per-device gradients."""
  total = jax.device_count()
  params = global_array(np.ones((total, 3)), by_data)
  tx = jls.loss_scaling(optax.sgd(0.1, momentum=0.9), jls.DynamicLossScale(2.0**8),
                        axis_name="data")
  state = tx.init(params)
  specs = jax.tree.map(lambda x: P("data") if x.shape == params.shape else P(), state)
  update = jax.jit(jax.shard_map(
      lambda g, s, p: tx.update(g, s, p), mesh=mesh,
      in_specs=(P("data"), specs, P("data")), out_specs=(P("data"), specs)))

  applied = []
  for i in range(STEPS):
    grads = np.full((total, 3), 0.5, np.float32)
    if i in POISONED:
      grads[total - 1, 0] = np.inf  # lives on the last device, owned by process 1
    updates, state = update(global_array(grads, by_data), state, params)
    params = optax.apply_updates(params, updates)
    applied.append(int(fetch(state.last_applied)))
  return params, state, applied


out = {}
for name, run in [("spmd", spmd), ("shard_map", shard_map_sharded_params)]:
  params, state, applied = run()
  out[f"{name}_applied"] = np.array(applied)
  for path, leaf in jax.tree_util.tree_leaves_with_path((params, state)):
    out[f"{name}{jax.tree_util.keystr(path)}"] = fetch(leaf)
np.savez(f"{OUT_DIR}/process_{PROCESS_ID}.npz", **out)
jax.distributed.shutdown()
