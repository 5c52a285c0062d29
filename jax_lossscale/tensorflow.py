"""TensorFlow's names, for code ported from it: contrib's loss-scale managers
(`tf.contrib.mixed_precision`) and `serialize`, `deserialize` and `get`
(`tf.mixed_precision.experimental.LossScale`'s functions).

    from jax_lossscale import tensorflow as jls_tf

    manager = jls_tf.ExponentialUpdateLossScaleManager(2**15, 2000)
    loss_scale = jls_tf.get("dynamic")  # a jax_lossscale.DynamicLossScale

The loss scales themselves (`DynamicLossScale`, `FixedLossScale`, `NoOpLossScale`) keep
TensorFlow's names and arguments at the top of the package; `presets.tensorflow()` is
TensorFlow's `DynamicLossScale`. Managers are loss scales, so they work wherever a loss
scale does, `loss_scaling` included. Importing this module does not import TensorFlow.
"""

from jax_lossscale._managers import ExponentialUpdateLossScaleManager
from jax_lossscale._managers import FixedLossScaleManager
from jax_lossscale._managers import LossScaleManager
from jax_lossscale._serialization import deserialize
from jax_lossscale._serialization import get
from jax_lossscale._serialization import serialize

__all__ = (
    "ExponentialUpdateLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
    "deserialize",
    "get",
    "serialize",
)
