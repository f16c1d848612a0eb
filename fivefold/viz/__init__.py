"""Pictures of what fivefold plans and runs (pipeline schedules, ...)."""
