"""jax_lossscale: loss scaling for mixed-precision training in JAX and optax.

TensorFlow's porting names (contrib's loss-scale managers, `serialize`, `deserialize`,
`get`) live in `jax_lossscale.tensorflow`; their old spellings here still import.
"""

from jax_lossscale import diagnostics
from jax_lossscale import presets
from jax_lossscale._autocast import PrecisionSummary
from jax_lossscale._autocast import autocast
from jax_lossscale._autocast import precision_summary
from jax_lossscale._checkpoint import restore_state
from jax_lossscale._finite import all_finite
from jax_lossscale._fp8 import Float8Matmul
from jax_lossscale._fp8 import Float8Recipe
from jax_lossscale._fp8 import compiler_options as fp8_compiler_options
from jax_lossscale._loss_scale import DynamicLossScale
from jax_lossscale._loss_scale import FixedLossScale
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._loss_scale import NoOpLossScale
from jax_lossscale._loss_scale import loss_scale_dataclass
from jax_lossscale._loss_scale import state_field
from jax_lossscale._measured import MeasuredLossScale
from jax_lossscale._monitoring import LossScaleStuckError
from jax_lossscale._monitoring import if_applied
from jax_lossscale._monitoring import metrics
from jax_lossscale._monitoring import raise_if_stuck
from jax_lossscale._monitoring import unscale
from jax_lossscale._policy import Policy
from jax_lossscale._policy import get_policy
from jax_lossscale._transform import LossScalingState
from jax_lossscale._transform import LossScalingTransformation
from jax_lossscale._transform import StepCounts
from jax_lossscale._transform import loss_scaling
from jax_lossscale._trees import select_tree
from jax_lossscale._value_and_grad import scaled_value_and_grad

__version__ = "0.2.0"

__all__ = (
    "DynamicLossScale",
    "FixedLossScale",
    "Float8Matmul",
    "Float8Recipe",
    "LossScale",
    "LossScaleStuckError",
    "LossScalingState",
    "LossScalingTransformation",
    "MeasuredLossScale",
    "NoOpLossScale",
    "Policy",
    "PrecisionSummary",
    "StepCounts",
    "all_finite",
    "autocast",
    "diagnostics",
    "fp8_compiler_options",
    "get_policy",
    "if_applied",
    "loss_scale_dataclass",
    "loss_scaling",
    "metrics",
    "precision_summary",
    "presets",
    "raise_if_stuck",
    "restore_state",
    "scaled_value_and_grad",
    "select_tree",
    "state_field",
    "unscale",
)

# TensorFlow's porting names, moved to `jax_lossscale.tensorflow`: still importable from
# here (`jls.get`, `from jax_lossscale import serialize`), not offered by `import *`.
_MOVED_TO_TENSORFLOW = frozenset({
    "ExponentialUpdateLossScaleManager", "FixedLossScaleManager", "LossScaleManager",
    "deserialize", "get", "serialize"})


def __getattr__(name: str) -> object:
  if name in _MOVED_TO_TENSORFLOW:
    from jax_lossscale import tensorflow

    return getattr(tensorflow, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
