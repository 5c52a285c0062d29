"""jax_lossscale: loss scaling for mixed-precision training in JAX and optax."""

from jax_lossscale import diagnostics
from jax_lossscale import presets
from jax_lossscale._autocast import PrecisionSummary
from jax_lossscale._autocast import autocast
from jax_lossscale._autocast import precision_summary
from jax_lossscale._finite import all_finite
from jax_lossscale._fp8 import Float8Matmul
from jax_lossscale._fp8 import Float8Recipe
from jax_lossscale._loss_scale import DynamicLossScale
from jax_lossscale._loss_scale import FixedLossScale
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._loss_scale import NoOpLossScale
from jax_lossscale._loss_scale import loss_scale_dataclass
from jax_lossscale._loss_scale import state_field
from jax_lossscale._managers import ExponentialUpdateLossScaleManager
from jax_lossscale._managers import FixedLossScaleManager
from jax_lossscale._managers import LossScaleManager
from jax_lossscale._measured import MeasuredLossScale
from jax_lossscale._monitoring import LossScaleStuckError
from jax_lossscale._monitoring import if_applied
from jax_lossscale._monitoring import metrics
from jax_lossscale._monitoring import raise_if_stuck
from jax_lossscale._monitoring import unscale
from jax_lossscale._policy import Policy
from jax_lossscale._policy import get_policy
from jax_lossscale._serialization import deserialize
from jax_lossscale._serialization import get
from jax_lossscale._serialization import serialize
from jax_lossscale._transform import LossScalingState
from jax_lossscale._transform import LossScalingTransformation
from jax_lossscale._transform import loss_scaling
from jax_lossscale._trees import select_tree
from jax_lossscale._value_and_grad import scaled_value_and_grad

__version__ = "0.2.0"

__all__ = (
    "DynamicLossScale",
    "ExponentialUpdateLossScaleManager",
    "FixedLossScale",
    "FixedLossScaleManager",
    "Float8Matmul",
    "Float8Recipe",
    "LossScale",
    "LossScaleManager",
    "LossScaleStuckError",
    "LossScalingState",
    "LossScalingTransformation",
    "MeasuredLossScale",
    "NoOpLossScale",
    "Policy",
    "PrecisionSummary",
    "all_finite",
    "autocast",
    "deserialize",
    "diagnostics",
    "get",
    "get_policy",
    "if_applied",
    "loss_scale_dataclass",
    "loss_scaling",
    "metrics",
    "precision_summary",
    "presets",
    "raise_if_stuck",
    "scaled_value_and_grad",
    "select_tree",
    "serialize",
    "state_field",
    "unscale",
)
