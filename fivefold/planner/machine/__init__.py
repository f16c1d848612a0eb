"""Machine pricing: how a hardware turns the work the planner counts into seconds.

- datasheet.py  catalog GPUs and CPUs: data-sheet figures and published kernel measurements
- pricing.py    what a compute pricer is given and answers
- roofline.py   a catalog GPU's ops each at max(FLOPs / achievable FLOP/s, bytes / bandwidth)
- ops.py        the kernels of one block at one rank's shapes (what roofline.py prices)
Measured profiles (`fivefold calibrate`) price the same work from ../calibration/.
"""
