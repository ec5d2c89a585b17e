"""Performance scripts (a table and a JSON each): run as ``python benchmarks/NAME.py``, or import
``benchmarks.NAME`` from the repository root (tests do); siblings import each other as ``benchmarks.*``."""
