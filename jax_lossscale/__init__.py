"""jax_lossscale: loss scaling for mixed-precision training in JAX and optax."""

from jax_lossscale import presets
from jax_lossscale._diagnostics import LossScaleAdvice
from jax_lossscale._diagnostics import gradient_stats
from jax_lossscale._diagnostics import nonfinite_leaf_paths
from jax_lossscale._diagnostics import nonfinite_leaves
from jax_lossscale._diagnostics import recommend_loss_scale
from jax_lossscale._loss_scale import DynamicLossScale
from jax_lossscale._loss_scale import FixedLossScale
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._loss_scale import NoOpLossScale
from jax_lossscale._managers import ExponentialUpdateLossScaleManager
from jax_lossscale._managers import FixedLossScaleManager
from jax_lossscale._managers import LossScaleManager
from jax_lossscale._monitoring import LossScaleStuckError
from jax_lossscale._monitoring import get_loss_scale
from jax_lossscale._monitoring import metrics
from jax_lossscale._monitoring import raise_if_stuck
from jax_lossscale._policy import Policy
from jax_lossscale._policy import get_policy
from jax_lossscale._serialization import deserialize
from jax_lossscale._serialization import get
from jax_lossscale._serialization import serialize
from jax_lossscale._transform import LossScalingState
from jax_lossscale._transform import LossScalingTransformation
from jax_lossscale._transform import loss_scaling
from jax_lossscale._tree import all_finite
from jax_lossscale._tree import select_tree
from jax_lossscale._value_and_grad import scaled_value_and_grad

__version__ = "0.1.0"

__all__ = (
    "DynamicLossScale",
    "ExponentialUpdateLossScaleManager",
    "FixedLossScale",
    "FixedLossScaleManager",
    "LossScale",
    "LossScaleAdvice",
    "LossScaleManager",
    "LossScaleStuckError",
    "LossScalingState",
    "LossScalingTransformation",
    "NoOpLossScale",
    "Policy",
    "all_finite",
    "deserialize",
    "get",
    "get_loss_scale",
    "get_policy",
    "gradient_stats",
    "loss_scaling",
    "metrics",
    "nonfinite_leaf_paths",
    "nonfinite_leaves",
    "presets",
    "raise_if_stuck",
    "recommend_loss_scale",
    "scaled_value_and_grad",
    "select_tree",
    "serialize",
)
