"""The refit simulator as a command: ``python -m megatron_ext.weight_export.simulate`` (:mod:`.plan.simulate`)."""

from .plan.simulate import main

if __name__ == "__main__":
    main()
