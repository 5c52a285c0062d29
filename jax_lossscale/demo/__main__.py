"""`python -m jax_lossscale.demo`."""

from jax_lossscale.demo import main

main()
