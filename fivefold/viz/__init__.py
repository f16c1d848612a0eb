"""Pictures of what fivefold plans and runs: pipeline schedules, the run report, the explainer pages."""
