"""The refit simulator as a command: ``python -m megatron_ext.weight_export.simulate`` (:mod:`.plan.simulate`),
with the refit's own staging defaults (the ``auto`` budget, the p2p bucket)."""

from .config import AUTO_MEMORY_BUDGET_MB, P2P_BUCKET_MB, RefitConfig
from .plan.simulate import main

if __name__ == "__main__":
    main(budget_mb=AUTO_MEMORY_BUDGET_MB, bucket_mb=P2P_BUCKET_MB, max_inflight=RefitConfig.max_inflight)
