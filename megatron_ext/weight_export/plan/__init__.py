"""What moves where, with no communication: the reshard planner, the engines' layouts, the export
plan, the wire format, FP8 block arithmetic, the simulator, and the refit's one error family."""
