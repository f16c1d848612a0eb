"""The planner: memory, communication and time of a layout, predicted before anything runs.

The textbook model (counts from model/counts.py):
- layout.py       where things live: blocks per pipeline rank, parameters per rank
- memory.py, activations.py, offload.py, fits.py: bytes per rank
- comm.py         bytes each rank sends per axis, and their seconds
- compute.py, flops.py: FLOPs of a chunk; MFU and HFU conventions
- overlap.py      what each overlap switch hides
- terms.py        the step's terms after compute and traffic, with their explain rows
- estimate.py     one layout end to end: memory, bytes, bubble, step time, MFU
- search.py       enumerate layouts, keep what validate() accepts and what fits, rank them
- options.py      what an estimate assumes beyond the config
- request.py, cli.py, selfcheck.py: `fivefold plan`, and the prediction a run logs
Machine pricing: machine/ (catalog hardware, roofline), calibration/ (measured profiles),
hardware.py (a hardware by name or by profile file).
"""
