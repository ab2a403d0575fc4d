"""Tensor parallelism: the shard layout, the sharded model's collectives and the executor
that runs one worker process per rank (docs/tensor-parallel.md)."""
