"""Test support for megatron_ext: a multi-rank launcher, test-only CPU shims for
Megatron-Core's hard ``torch.cuda`` calls, and a tiny GPT model.

Only tests, examples and benchmarks import this package; product modules never do.
"""
