"""NCCL symmetric-memory staging buffers for experimental FSDP and DDP buckets.
Not implemented yet (issue: NCCL symmetric-memory staging buffers)."""
