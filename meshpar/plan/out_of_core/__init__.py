"""Out of core: what host offload and CUDA Unified Memory move and cost, and their comparison."""
