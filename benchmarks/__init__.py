"""actorshm's benchmarks: ``python -m benchmarks [--quick] [--out docs/benchmarks.md]``."""
