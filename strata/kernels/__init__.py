"""The kernel layer: numba CPU kernels, Triton GPU kernels and their torch reference twins."""

from strata.kernels.numba_cache import clear_if_sources_changed

clear_if_sources_changed()
