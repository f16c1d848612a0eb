"""The training loop and what it needs beyond the parallel layout.

- cli.py         `fivefold train`: the configuration checked for the world, then this process or the launch
- loop.py        setup, then each step, evaluation, logging and checkpoints
- step.py        one step: data -> pipeline executor -> optimizer step -> MoE balancing
- lr_schedule.py, precision.py, moe_balance.py, gc_policy.py, stop_request.py: parts of a step
- metrics.py, sinks.py, step_log.py, breakdown.py, trace.py: what a run reports
- preflight.py   the checks made before any process starts
- dry_run.py, dry_run_cli.py: every rank of a layout built at the real scale on the meta device
"""
