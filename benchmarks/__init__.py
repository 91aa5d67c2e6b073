"""elastictrain's benchmarks against stock torchrun; ``python -m benchmarks --help``."""
