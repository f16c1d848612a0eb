"""How a model becomes this rank's part of a layout: one module per dimension, composed in order.

parallelize.py holds THE composition order: pipeline -> tensor -> FP8 -> expert -> context ->
recompute -> data parallel -> offload, each an `apply_<dim>(...)` that is a no-op when off.
- mesh.py         the named DeviceMesh and its views (batch, grad, ep, expert_dp)
- tensor.py       tensor + sequence parallel (Column/RowParallelLinear, vocab-parallel loss)
- fp8.py          FP8 training of the blocks' linear layers, amaxes reduced over the splits
- context.py      context parallel: ring attention (zig-zag) and Ulysses
- expert.py       expert parallel: all-to-all dispatch and combine
- recompute.py    activation checkpointing
- data/           DDP, ZeRO-1/2, ZeRO-3: one bucket machinery, three strategies
- pipeline/       stages, schedules as data, the simulator, message plans, the executor
- comm/           every collective on a named group: counted, timed, named on failure
- optimizer.py    AdamW on what data parallel steps; the global norm over split gradients
- materialize.py, state_dict.py, state_memory.py: meta -> real tensors, DTensor state, bytes held
- forked_ranks.py run one function on N forked gloo ranks (tests, calibration, benchmarks)
"""
