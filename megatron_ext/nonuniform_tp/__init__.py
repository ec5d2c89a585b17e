"""Nonuniform tensor parallelism: replicas that lost GPUs keep training at a
reduced TP degree. Not implemented yet (issue: nonuniform tensor parallelism)."""
