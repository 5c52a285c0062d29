"""Probes: where inside the backward pass float16 overflows and underflows happen.

The library's own package, behind its documented API (`jax_lossscale.diagnostics.probe`,
`Probes` and the tables, `scaled_value_and_grad(..., probes=True)`): what is here may
change between releases.

`probe(x, name)` is the identity; under `value_and_grad_with_probes` it measures `x` and
its gradient. The probed function's loss is traced twice:

1. The first pass (`jax.make_jaxpr` of the loss) finds the probes: each one's name, rows
   (`length`) and size, and each hit, marked in the program so that the loops around it,
   and hence the forward order of its rows, can be read back. The framework adapters'
   options (a row index for stacked layers, equinox's probed copy) are on in this pass;
   it is traced again without one where the loss cannot take it (`_intercept.first_pass`).
2. The second pass is the differentiation itself. Each probe has a zero "stats" input,
   carried with the first differentiated argument; the probe, a `custom_vjp` identity,
   measures its activation on the way forward and its gradient on the way back, and the
   measurements leave the backward pass as the cotangent of its stats (no host callback).

Modules, each importing only those listed before it:

* `stats`: what a probe measures of one tensor and its gradient, and how the sums over
  its hits read back (`ProbeSummary`).
* `order`: the forward order of the probes' rows, read from the first pass's program.
* `_intercept`: every way the adapters reach inside flax and equinox (linen's hook; for
  NNX and equinox, a copy of the model whose layers are of probed subclasses of their
  classes), and the options the first pass works with.
* `core`: `probe`, `Probes`, the two passes (`value_and_grad_with_probes`) and
  `all_reduce_probes`.
* `outputs`: what every adapter does with a module: its output probed under its name.
* `linen`, `nnx`, `equinox`: a probe on every module's output, named by its path, in
  flax linen, flax NNX and equinox.
* `placement`: `placed(fun)`, the adapters of the frameworks `fun` is called with.
"""

from jax_lossscale.probes.core import LOSS
from jax_lossscale.probes.core import Probes
from jax_lossscale.probes.core import all_reduce_probes
from jax_lossscale.probes.core import equinox_probed_copy
from jax_lossscale.probes.core import probe
from jax_lossscale.probes.core import probing
from jax_lossscale.probes.core import stacked_rows
from jax_lossscale.probes.core import value_and_grad_with_probes
from jax_lossscale.probes.equinox import equinox_probes
from jax_lossscale.probes.linen import linen_probes
from jax_lossscale.probes.nnx import nnx_probes
from jax_lossscale.probes.placement import placed
from jax_lossscale.probes.stats import ProbeSummary
from jax_lossscale.probes.stats import TensorSummary
from jax_lossscale.probes.stats import largest_gradient

__all__ = ("LOSS", "ProbeSummary", "Probes", "TensorSummary", "all_reduce_probes",
           "equinox_probes", "equinox_probed_copy", "largest_gradient", "linen_probes",
           "nnx_probes", "placed", "probe", "probing", "stacked_rows",
           "value_and_grad_with_probes")
