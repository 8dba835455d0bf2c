"""corelm beyond one process: tensor parallelism over MPI (tensor_parallel.py, shard.py)."""
