"""The planner: memory, communication and time of a layout, predicted before anything runs."""
