"""The process and jax's back end, set up before anything runs: quiet logs on hosts without a
GPU, the persistent compilation cache, CUDA Unified Memory and XLA's allocator fraction."""
