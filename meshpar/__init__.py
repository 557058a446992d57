"""meshpar: named-axis model parallelism in JAX (see README.md).

Importing any meshpar module first quiets jax's CUDA plugin on a host without a GPU
(:mod:`meshpar.backend.quiet`): nothing changes where no CUDA plugin is installed or a GPU is there.
"""

from meshpar.backend import quiet as _quiet

_quiet.set_up()
