"""What `fivefold calibrate` measures, and the compute pricer a measured profile brings to the planner.

The planner's core (estimate, comm, compute, datasheet, ...) never imports this package: a profile
loaded by `hardware.load_profile` carries its pricer (`Hardware.pricer`, a `pricer.MeasuredPricer`).

- measure.py      the calibration runs: op, matmul, elementwise, optimizer and copy timings on
                  forked ranks, collectives, sessions merged into one profile (`calibrate()`)
- collectives.py  every collective timed on gloo ranks, and the alpha-beta fit
- gpu.py          on a CUDA GPU: the roofline's constants (GEMM fractions, attention curves, HBM) measured
- host.py         Python's fixed costs: module calls, autograd Functions, hooks, state sampling, threads
- layers.py       the model's own parts timed whole at a config's shapes (`--layers`)
- noise.py        how long a collective waits for its slowest rank (the noise curve)
- sampling.py     timing in samples about as long as a training step
- profile.py      MeasuredProfile: the measured figures, and pricing a traced tally with them
- opcount.py      the aten ops of a micro-batch, counted by tracing the model's own code
- overheads.py    Python's share of a step, priced from counts of the layout
- pricer.py       MeasuredPricer: the core's ComputePricer made of the above
"""
