"""Two real training programs, ported small, that log gradient norms under loss scaling.

* flax's WMT example (github.com/google/flax, `examples/wmt/models.py` and
  `examples/wmt/train.py`): the linen encoder-decoder Transformer, its label-smoothed
  cross entropy, its warmup-then-rsqrt learning rate and its `pmap` train step, which
  trains float16 with flax's `DynamicScale`; `jls_train_step` is that step with
  `jax_lossscale` in place of `DynamicScale`.
* levanter's trainer (github.com/stanford-crfm/levanter): `TrainerState.take_step` and
  `take_train_step` (`src/levanter/trainer_state.py`), the jmp precision policy and
  `Trainer.loss_fn` / `_train_step` (`src/levanter/trainer.py`), EMA of the parameters
  (`EmaModelAveraging`, `src/levanter/optim/model_averaging.py`), `AdamConfig.build`
  (`src/levanter/optim/config.py`) and the gradient-norm hook (`WatchCallback` ->
  `summary_statistics_for_tree`, `src/levanter/callbacks/watch.py` and
  `src/levanter/analysis/tree_stats.py`), in plain equinox, jmp and optax: haliax's named
  arrays, axis mappings and scan-layer splitting have no part in the norms.

Left out of both, as they do not touch the gradients of a step: decoding and beam search,
packed examples, checkpoints, evaluation, microbatching, quantization, data loading
(the batches here are synthetic tokens) and the trackers (a step returns its logs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax import linen as nn
from flax import struct
from flax.training import common_utils
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state

import jax_lossscale as jls

# --- flax examples/wmt/models.py -------------------------------------------------------


@struct.dataclass
class TransformerConfig:
  """The example's hyperparameters (decoding fields left out)."""

  vocab_size: int
  output_vocab_size: int
  share_embeddings: bool = False
  logits_via_embedding: bool = False
  dtype: Any = jnp.float32
  emb_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 2048
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis=1):
  """Shift the input to the right by padding on axis 1."""
  pad_widths = [(0, 0)] * len(x.shape)
  pad_widths[axis] = (1, 0)
  padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
  return padded[:, :-1]


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
  """1D sinusoidal position embedding initializer."""

  def init(key, shape, dtype=np.float32):
    del key, dtype
    d_feature = shape[-1]
    pe = np.zeros((max_len, d_feature), dtype=np.float32)
    position = np.arange(0, max_len)[:, np.newaxis]
    scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
    div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
    pe[:, : d_feature // 2] = np.sin(position * div_term)
    pe[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
    return jnp.array(pe[np.newaxis, :, :])

  return init


class AddPositionEmbs(nn.Module):
  """Adds the fixed sinusoidal position embeddings to the inputs."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    length = inputs.shape[1]
    pos_embedding = sinusoidal_init(max_len=config.max_len)(
        None, (1, config.max_len, inputs.shape[-1]), None)
    return inputs + pos_embedding[:, :length, :]


class MlpBlock(nn.Module):
  """Transformer MLP / feed-forward block."""

  config: TransformerConfig
  out_dim: int | None = None

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
    x = nn.Dense(config.mlp_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                 bias_init=config.bias_init)(inputs)
    x = nn.relu(x)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    output = nn.Dense(actual_out_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                      bias_init=config.bias_init)(x)
    return nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)


def _attention(config, **kwargs):
  return nn.MultiHeadDotProductAttention(
      num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.qkv_dim,
      kernel_init=config.kernel_init, bias_init=config.bias_init, use_bias=False,
      broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
      deterministic=config.deterministic, **kwargs)


class Encoder1DBlock(nn.Module):
  """Transformer encoder layer."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, encoder_mask=None):
    config = self.config
    x = nn.LayerNorm(dtype=config.dtype)(inputs)
    x = _attention(config)(x, mask=encoder_mask)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    x = x + inputs
    y = nn.LayerNorm(dtype=config.dtype)(x)
    y = MlpBlock(config=config)(y)
    return x + y


class EncoderDecoder1DBlock(nn.Module):
  """Transformer encoder-decoder layer."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, targets, encoded, decoder_mask=None, encoder_decoder_mask=None):
    config = self.config
    x = nn.LayerNorm(dtype=config.dtype)(targets)
    x = _attention(config)(x, mask=decoder_mask)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    x = x + targets
    y = nn.LayerNorm(dtype=config.dtype)(x)
    y = _attention(config)(y, encoded, mask=encoder_decoder_mask)
    y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
    y = y + x
    z = nn.LayerNorm(dtype=config.dtype)(y)
    z = MlpBlock(config=config)(z)
    return y + z


class Encoder(nn.Module):
  """Transformer encoder."""

  config: TransformerConfig
  shared_embedding: Any = None

  @nn.compact
  def __call__(self, inputs, encoder_mask=None):
    config = self.config
    x = self.shared_embedding(inputs.astype("int32"))
    x = AddPositionEmbs(config=config, name="posembed_input")(x)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    x = x.astype(config.dtype)
    for lyr in range(config.num_layers):
      x = Encoder1DBlock(config=config, name=f"encoderblock_{lyr}")(x, encoder_mask)
    return nn.LayerNorm(dtype=config.dtype, name="encoder_norm")(x)


class Decoder(nn.Module):
  """Transformer decoder, logits through the transposed shared embedding."""

  config: TransformerConfig
  shared_embedding: Any = None

  @nn.compact
  def __call__(self, encoded, targets, decoder_mask=None, encoder_decoder_mask=None):
    config = self.config
    output_embed = self.shared_embedding
    y = shift_right(targets.astype("int32"))
    y = output_embed(y)
    y = AddPositionEmbs(config=config, name="posembed_output")(y)
    y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
    y = y.astype(config.dtype)
    for lyr in range(config.num_layers):
      y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{lyr}")(
          y, encoded, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask)
    y = nn.LayerNorm(dtype=config.dtype, name="encoderdecoder_norm")(y)
    logits = output_embed.attend(y.astype(jnp.float32))
    return logits / jnp.sqrt(y.shape[-1])


class Transformer(nn.Module):
  """The example's Transformer with `share_embeddings` and `logits_via_embedding`, its
  defaults."""

  config: TransformerConfig

  def setup(self):
    config = self.config
    self.shared_embedding = nn.Embed(num_embeddings=config.vocab_size,
                                     features=config.emb_dim,
                                     embedding_init=nn.initializers.normal(stddev=1.0))
    self.encoder = Encoder(config=config, shared_embedding=self.shared_embedding)
    self.decoder = Decoder(config=config, shared_embedding=self.shared_embedding)

  def __call__(self, inputs, targets):
    config = self.config
    encoder_mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype)
    encoded = self.encoder(inputs, encoder_mask=encoder_mask)
    decoder_mask = nn.combine_masks(
        nn.make_attention_mask(targets > 0, targets > 0, dtype=config.dtype),
        nn.make_causal_mask(targets, dtype=config.dtype))
    encoder_decoder_mask = nn.make_attention_mask(targets > 0, inputs > 0, dtype=config.dtype)
    logits = self.decoder(encoded, targets, decoder_mask=decoder_mask,
                          encoder_decoder_mask=encoder_decoder_mask)
    return logits.astype(config.dtype)


# --- flax examples/wmt/train.py --------------------------------------------------------


class TrainState(train_state.TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


def rsqrt_schedule(init_value: float, shift: int = 0):
  """`lr = init_value / sqrt(step)`, shifted by `shift` steps."""

  def schedule(count):
    return init_value * (count + shift) ** -0.5 * shift**0.5

  return schedule


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
  """A rsqrt schedule with linear warmup."""
  return optax.join_schedules(
      [optax.linear_schedule(init_value=0, end_value=learning_rate,
                             transition_steps=warmup_steps),
       rsqrt_schedule(init_value=learning_rate, shift=warmup_steps)],
      boundaries=[warmup_steps])


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
  """Sum of the label-smoothed cross entropy and the normalizing factor."""
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(confidence * jnp.log(confidence)
                           + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
  soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence,
                                     off_value=low_confidence)
  loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
  loss = loss - normalizing_constant
  normalizing_factor = np.prod(targets.shape)
  if weights is not None:
    loss = loss * weights
    normalizing_factor = weights.sum()
  return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
  """Loss, accuracy and denominator summed over the replicas."""
  loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
  acc = jnp.sum(jnp.equal(jnp.argmax(logits, axis=-1), labels) * weights)
  metrics = {"loss": loss, "accuracy": acc, "denominator": weight_sum}
  return jax.lax.psum(metrics, axis_name="batch")


def _wmt_loss_fn(params, batch, config, label_smoothing):
  """The example's `loss_fn`: the mean label-smoothed cross entropy, and the logits."""
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
  logits = Transformer(config).apply({"params": params}, inputs, targets)
  loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
  return loss / weight_sum, logits


def train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0):
  """The example's `train_step`, float32 or float16 with `DynamicScale`.

  Logs one metric the example does not: `grad_norm`, the global norm of the gradients
  the optimizer receives (averaged over replicas and, with `DynamicScale`, unscaled).
  `applied` is the example's `is_fin`. Dropout is off in the configurations used here
  (rate 0), so the example's dropout key is left out.
  """
  targets = batch["targets"]
  weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
  loss_fn = functools.partial(_wmt_loss_fn, batch=batch, config=config,
                              label_smoothing=label_smoothing)
  step = state.step

  if state.dynamic_scale:
    # dynamic scale takes care of averaging gradients across replicas
    grad_fn = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")
    dynamic_scale, is_fin, (_, logits), grads = grad_fn(state.params)
    state = state.replace(dynamic_scale=dynamic_scale)
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    grads = jax.lax.pmean(grads, axis_name="batch")
    is_fin = jnp.array(True)

  new_state = state.apply_gradients(grads=grads)
  metrics = compute_metrics(logits, targets, weights)
  metrics["learning_rate"] = learning_rate_fn(step)
  metrics["grad_norm"] = optax.tree.norm(grads)
  metrics["applied"] = is_fin

  if state.dynamic_scale:
    # if is_fin == False the gradients contain Inf/NaNs and optimizer state and
    # params should be restored (= skip this step).
    select_fn = functools.partial(jnp.where, is_fin)
    new_state = new_state.replace(
        opt_state=jax.tree_util.tree_map(select_fn, new_state.opt_state, state.opt_state),
        params=jax.tree_util.tree_map(select_fn, new_state.params, state.params))
    metrics["loss_scale"] = dynamic_scale.scale * metrics["denominator"]

  return new_state, metrics


def jls_train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0):
  """`train_step` with `jax_lossscale` in place of `DynamicScale`.

  `state` is a `jax_lossscale.flax.TrainState` whose `tx` is
  `jls.loss_scaling(optax.adamw(...), ..., grad_norm=True)`: `scaled_value_and_grad`
  averages the loss and the gradients over the replicas as `DynamicScale` did, and
  `apply_gradients` unscales, checks and skips, so the example's `jnp.where` restore
  goes. Three gradient-norm logs: `grad_norm` from `jls.metrics`, `unscaled_norm` of
  `jls.unscale(grads, ...)`, and `scaled_norm`, the norm of `grads` as they come (what
  a log of the gradients the step was given shows). `applied` and `skipped_steps` report
  the step's decision; `step_scale` is the scale this step's gradients were computed
  with; `loss_scale` the example's metric (the next scale times the denominator).
  """
  targets = batch["targets"]
  weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
  loss_fn = functools.partial(_wmt_loss_fn, batch=batch, config=config,
                              label_smoothing=label_smoothing)
  step = state.step

  grad_fn = jls.scaled_value_and_grad(loss_fn, has_aux=True, axis_name="batch")
  (loss, logits), grads = grad_fn(state.opt_state, state.params)
  new_state = state.apply_gradients(grads=grads, loss=loss)

  metrics = compute_metrics(logits, targets, weights)
  metrics["learning_rate"] = learning_rate_fn(step)
  logged = jls.metrics(new_state)
  metrics["grad_norm"] = logged["grad_norm"]
  metrics["unscaled_norm"] = optax.tree.norm(jls.unscale(grads, new_state))
  metrics["scaled_norm"] = optax.tree.norm(grads)
  metrics["applied"] = logged["last_applied"]
  metrics["skipped_steps"] = logged["skipped_steps"]
  metrics["step_scale"] = new_state.opt_state.last_loss_scale
  metrics["loss_scale"] = logged["loss_scale"] * metrics["denominator"]
  return new_state, metrics


# --- levanter: a slice of the equinox trainer ------------------------------------------


class TinyLm(eqx.Module):
  """A next-token model small enough for the test suite, in place of levanter's haliax
  language models: embedding, LayerNorm, MLP, unembedding."""

  embed: eqx.nn.Embedding
  norm: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP
  unembed: eqx.nn.Linear

  def __init__(self, vocab: int, width: int, *, key: jax.Array):
    k1, k2, k3 = jax.random.split(key, 3)
    self.embed = eqx.nn.Embedding(vocab, width, key=k1)
    self.norm = eqx.nn.LayerNorm(width)
    self.mlp = eqx.nn.MLP(width, width, 4 * width, depth=1, activation=jax.nn.gelu, key=k2)
    self.unembed = eqx.nn.Linear(width, vocab, key=k3)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    h = jax.vmap(self.embed)(tokens)
    h = h + jax.vmap(self.mlp)(jax.vmap(self.norm)(h))
    return jax.vmap(self.unembed)(h)


def next_token_loss(model: TinyLm, tokens: jax.Array, mp: jmp.Policy) -> jax.Array:
  """Per-token cross entropy of predicting `tokens[:, 1:]`, the logits cast to the
  policy's output dtype (levanter's LM loss)."""
  logits = mp.cast_to_output(jax.vmap(model)(tokens[:, :-1]))
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def make_loss_fn(mp: jmp.Policy) -> Callable:
  """`Trainer.loss_fn`: casts the model to the compute dtype, then the mean loss."""

  def loss_fn(model, tokens):
    model = mp.cast_to_compute(model)
    return next_token_loss(model, tokens, mp).mean()

  return loss_fn


def trainables_only(model):
  """`trainables_only` with `is_trainable=True`: the floating-point arrays."""
  return eqx.filter(model, eqx.is_inexact_array)


def weight_decay_mask(model):
  """`build_weight_decay_mask`'s default: no decay for LayerNorm, embeddings or biases
  (levanter matches class names in the path; `TinyLm`'s fields are named for them)."""

  def decayed(path, leaf):
    name = jax.tree_util.keystr(path)
    return not any(part in name for part in ("norm", "embed", "bias"))

  return jax.tree_util.tree_map_with_path(decayed, model)


def adam_config_build(num_train_steps: int, learning_rate: float = 6e-4,
                      weight_decay: float = 0.1, warmup: float = 0.01,
                      min_lr_ratio: float = 0.1, max_grad_norm: float = 1.0):
  """`AdamConfig.build` with levanter's defaults: clip, Adam, masked weight decay and a
  warmup-then-cosine learning rate, injected so it can be logged."""
  warmup_steps = max(int(warmup * num_train_steps), 1)
  schedule = optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, warmup_steps),
       optax.cosine_decay_schedule(learning_rate, num_train_steps - warmup_steps,
                                   min_lr_ratio)],
      [warmup_steps])

  def _optimizer(learning_rate):
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.scale_by_adam(0.9, 0.95, 1e-8),
                       optax.add_decayed_weights(weight_decay, weight_decay_mask),
                       optax.scale(-learning_rate))

  return optax.inject_hyperparams(_optimizer)(learning_rate=schedule)


class EmaModelAveraging(eqx.Module):
  """Exponential moving average of the trainable parameters."""

  model: Any
  beta: float = eqx.field(static=True)

  def update(self, new_model, step):
    del step
    # 1 - beta because incremental_update expects the weight of the new model
    return dataclasses.replace(
        self, model=optax.incremental_update(new_model, self.model, 1 - self.beta))


class TrainerState(eqx.Module):
  """levanter's `TrainerState` (without the training key and trainability filters)."""

  step: jax.Array
  model: Any
  optimizer: optax.GradientTransformation = eqx.field(static=True)
  opt_state: Any
  mp: jmp.Policy = eqx.field(static=True)
  model_averaging: EmaModelAveraging

  @classmethod
  def init(cls, optimizer, model, *, mp: jmp.Policy, ema_beta: float):
    model = mp.cast_to_param(model)  # cast_params_by_trainability, all trainable
    trainable_model = trainables_only(model)
    return cls(jnp.array(0), model, optimizer, optimizer.init(trainable_model), mp,
               EmaModelAveraging(trainable_model, ema_beta))

  def take_step(self, grads, *, obj_fun=None, loss=None):
    model, opt_state, updates = take_train_step(self.optimizer, self.model, self.opt_state,
                                                grads, obj_fun=obj_fun, loss=loss)
    ma = self.model_averaging.update(trainables_only(model), self.step)
    return dataclasses.replace(self, model=model, opt_state=opt_state, model_averaging=ma,
                               step=self.step + 1), updates


class LossScalingTrainerState(TrainerState):
  """`TrainerState` for a `jls.loss_scaling` optimizer: the EMA follows the step's
  decision (`jls.if_applied`), so a skipped step leaves it as it was."""

  def take_step(self, grads, *, obj_fun=None, loss=None):
    new, updates = super().take_step(grads, obj_fun=obj_fun, loss=loss)
    ma = jls.if_applied(new.opt_state, new.model_averaging, self.model_averaging)
    return dataclasses.replace(new, model_averaging=ma), updates


def take_train_step(optimizer, model, opt_state, grads, *, obj_fun=None, loss=None):
  """`take_train_step`: the optimizer's update on the trainable parameters, applied."""
  train_grads = trainables_only(grads)
  trainable_model = trainables_only(model)
  updates, opt_state = optimizer.update(train_grads, opt_state, params=trainable_model,
                                        obj_fn=obj_fun, loss=loss)
  model = eqx.apply_updates(model, updates)
  return model, opt_state, updates


def summary_statistics_for_tree(prefix: str, tree: Any) -> dict[str, jax.Array]:
  """The gradient-norm hook's statistics: each array's norm and `{prefix}/norm/total`,
  the global norm of the whole tree (levanter's `optax.global_norm`, by its current name
  `optax.tree.norm`)."""
  to_log = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    to_log[f"{prefix}/norm/{jax.tree_util.keystr(path)}"] = optax.tree.norm(leaf)
  to_log[f"{prefix}/norm/total"] = optax.tree.norm(tree)
  return to_log


@eqx.filter_jit
def levanter_train_step(state: TrainerState, tokens: jax.Array):
  """`Trainer._train_step` without loss scaling: `eqx.filter_value_and_grad` of the loss,
  `take_step`, then the hook on the step's gradients."""
  loss_fn = make_loss_fn(state.mp)
  loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, tokens)

  def obj_fun(trainable_model):  # for optimizers that evaluate the loss (Sophia)
    return loss_fn(eqx.combine(trainable_model, state.model), tokens)

  new_state, _ = state.take_step(grads, obj_fun=obj_fun, loss=loss)
  return loss, new_state, summary_statistics_for_tree("grad", grads)


@eqx.filter_jit
def levanter_loss_scaled_train_step(state: LossScalingTrainerState, tokens: jax.Array):
  """`Trainer._train_step` with the loss scaled: the gradients come from
  `jls.scaled_value_and_grad`, and the hook runs on them three ways.

  Returns the loss, the new state and three logs: `"naive"`, the hook given the scaled
  gradients as they come; `"unscaled"`, the hook given `jls.unscale(grads, opt_state)`;
  `"metrics"`, `jls.metrics` of the new optimizer state (its `grad_norm` is the norm);
  and `"step_scale"`, the scale the step's gradients were computed with.
  """
  loss_fn = make_loss_fn(state.mp)
  grad_fn = jls.scaled_value_and_grad(loss_fn, value_and_grad=eqx.filter_value_and_grad)
  loss, grads = grad_fn(state.opt_state, state.model, tokens)

  def obj_fun(trainable_model):
    return loss_fn(eqx.combine(trainable_model, state.model), tokens)

  new_state, _ = state.take_step(grads, obj_fun=obj_fun, loss=loss)
  logs = {"naive": summary_statistics_for_tree("grad", grads),
          "unscaled": summary_statistics_for_tree("grad", jls.unscale(grads, new_state.opt_state)),
          "metrics": jls.metrics(new_state.opt_state),
          "step_scale": new_state.opt_state.last_loss_scale}
  return loss, new_state, logs
