"""Running a plan: the reshard refit's round loop (:mod:`.reshard`) with its staging and
first-refit agreement, and the export hook's bucket gather."""
