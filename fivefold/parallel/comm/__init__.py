"""The collective layer: every collective and message on a named group, counted, timed, named on failure.

- collectives.py  all_reduce, reduce_scatter, all_gather, all_to_all, P2P batches, barriers and
                  object gathers, each on an AxisGroup, counted per axis in wire bytes
- regions.py      the same as autograd Functions: tp/sp region boundaries, the all-to-all
- wire.py         the bytes formula (torch-free), shared with the planner
- ring.py         ring reduce-scatter / all-gather / all-reduce written out with send and recv
- collective_matmul.py  sp's all-gather and reduce-scatter as ring pieces under their matmuls
                  (parallel.tp_overlap)
- timing.py       where a step's time goes: compute, exposed communication per axis, bubble
- errors.py       a failed collective named: rank, operation, bytes, axis
- arrivals.py     which ranks never arrived at a collective that timed out
- compat.py       the torch versions supported (2.11 to 2.13) and the collective names each has
"""
