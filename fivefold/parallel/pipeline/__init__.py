"""Pipeline parallel: layers split into stages; micro-batches flow through a schedule.

What is sharded: the layers, over the `pp` axis. A rank keeps only the blocks of the stages it
owns (one stage, or v chunks for interleaved and V schedules); the first stage also keeps the
embedding, the last the final norm, head and loss; how many blocks each stage holds is
stage_split.py's, the split the planner and the dry run use too. Collectives: point-to-point
only. Forward sends each micro-batch's activation (micro_batch, T, dim) to the next stage;
backward sends its gradient back, both in the compute dtype (bf16 under bf16 autocast halves the
bytes: executor.travel_dtype); the receiver computes on the fp32 residual stream, as one process
does. Each rank posts its
messages in the batches `messages.py` plans from the schedule: between two ranks every message is
sent and received in one order, as NCCL (which ignores tags) requires, and the plan is proven not
to deadlock. Tags (kind, micro-batch, stage) stay, for gloo; correctness does not depend on them.
With a document mask or per-document positions (model/masks.py) every stage builds them from the
micro-batch's token ids, which each rank holds: nothing more travels.

`apply_pipeline_parallel()` (stages.py) keeps this rank's stages of the model; `PipelineExecutor`
(executor.py) is the one executor: it runs, action by action, the per-rank lists that `schedules.py`
builds (and `simulate()` times and draws), so what is planned, drawn and executed
cannot drift apart. Split backward (zero-bubble schedules): "I" computes only the gradient of the
stage input, which the previous stage is waiting for; "W" later computes only the weight
gradients (`split_backward.py`). Data parallel reduces each chunk's gradients at the chunk's last
backward (B or W) of the step, when they are final.

Memory: once a stage output has been sent, its storage is freed (Megatron-LM's "deallocate
output tensor", Narayanan et al. 2021): the next stage holds the data now, and backward needs
only the output's autograd node and shape, not its values, because a block ends with a residual
add, whose backward saves nothing.

The folder, from the data up (schedules.py, simulate.py and messages.py import no torch: the
planner, the explainers and validate() use them without it):
- schedules.py      per-rank action lists (F, B, I, W), pure data, for every schedule
- simulate.py       runs the lists against their dependencies: makespan, bubble, a timeline
- messages.py       which sends and receives a rank posts before each action (NCCL's one order)
- stage_split.py    how many blocks each stage holds (balanced by the planner's costs)
- stages.py         apply_pipeline_parallel: this rank's stage chunks of the model
- split_backward.py I and W: the backward split in two for zero-bubble schedules
- p2p.py            posting the message plan; freeing what has been sent
- executor.py       the interpreter that runs one rank's actions
"""
