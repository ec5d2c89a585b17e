"""The engine command on CPU ranks (gloo), for tests and CPU demos only.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_ext.testing.cpu_engine \\
        --engine megatron --refit-store 127.0.0.1:29700 --refit-rank-offset 2 --device cpu ...

It is ``python -m megatron_ext.weight_export.engine`` with the same flags, after
:func:`.cpu_compat.install_inference` has redirected megatron-core's hard
``torch.cuda`` calls to CPU in this process (the product command refuses
``--engine megatron`` on CPU, since it cannot run there without them).
"""

from __future__ import annotations

from megatron_ext.weight_export import engine

from . import cpu_compat


def main(argv=None) -> int:
    cpu_compat.install_inference()
    return engine.main(argv, megatron_on_cpu=True)


if __name__ == "__main__":
    engine.exit_now(main())
