"""Packaging for megatron_ext, a Megatron-Core plugin.

Supported: Python 3.12, megatron-core 0.19.x, torch >= 2.10.
"""

from setuptools import find_packages, setup

setup(
    name="megatron_ext",
    version="0.1.0",
    description=(
        "Megatron-Core plugin: nonuniform tensor parallelism, NCCL symmetric-memory "
        "staging buffers, and bucketed weight export to inference engines"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    python_requires=">=3.12,<3.13",
    install_requires=[
        "megatron-core>=0.19,<0.20",
        "torch>=2.10",
        "numpy",
        # megatron-core's dist_checkpointing writer (torch_dist save) imports it but does not declare it.
        "psutil",
    ],
    extras_require={
        # Transformer Engine: optional, never installed by default. It needs CUDA to
        # build; a half-installed TE breaks `import megatron.core`.
        "te": ["transformer_engine[pytorch]"],
        "hf": ["transformers", "safetensors"],
        # import-linter: `lint-imports` checks the import layering contracts of .importlinter (make test).
        "test": ["pytest", "pytest-markdown-docs", "transformers", "safetensors", "import-linter>=2.17"],
    },
    classifiers=[
        "Programming Language :: Python :: 3.12",
        "License :: OSI Approved :: Apache Software License",
    ],
)
