"""Python's share of a training step on a CPU: what the op count does not see, priced from counts.

The pricer prices the aten ops of a micro-batch (opcount.py counts them); on a CPU the rank also
runs, itself, the Python around them. Each cost below is a profile figure measured by `fivefold
calibrate` (host.py), multiplied by a count the planner derives from the layout, never a factor
fitted to a training run:

per micro-batch and chunk (on the critical path of every forward and backward, so the pipeline
simulation sees them):
- module calls: nn.Module calls of the traced chunk x module_call_s (forward);
- autograd Functions: the custom Functions of the traced chunk (the vocabulary-parallel loss, MoE's
  step tally) plus one per tensor-parallel collective (each is the forward or backward half of a
  Function, Megatron-LM's conjugate pairs) x function_s, half in forward, half in backward;
- gradient hooks: data parallel's post-accumulate-grad hook, one per parameter tensor and backward;
- model-state sampling: after a chunk's first and last backward of the step the loop reads the
  storage of every parameter, its gradient and its optimizer state (the data-parallel wrapper's
  model_state_bytes) x tensor_query_s per parameter;
- gradient accumulation: every micro-batch but the first adds its gradients into .grad, one op per
  parameter tensor (DDP and ZeRO-1; ZeRO-2/3 reduce each micro-batch's gradient instead);
per step:
- the pipeline's send thread (pipeline/p2p.py Sends; on gloo: CUDA polls instead), started and joined once
  when pp > 1: thread_s;
- DDP's bucket packing after backward: each bucket concatenated into one flat tensor and the
  reduced result copied back per parameter, ops priced like any other (op_overhead_s and the
  elementwise curve).
"""

from __future__ import annotations

from fivefold.config.schema import Config
from fivefold.planner.calibration.profile import MeasuredProfile, elementwise_rate
from fivefold.planner.machine.datasheet import Hardware
from fivefold.planner.machine.pricing import HostPrice


def host_costs(cfg: Config, profile: MeasuredProfile, hw: Hardware, *, modules: float, functions: float,
               tensors: float, rank_tensors: int, rank_params: float, micro: int, chunks: int, tp_calls: int,
               grad_bytes: float, dp_ranks: int) -> HostPrice:
    """Python's costs of one rank's step (zeros where the profile did not measure them).

    modules, functions, tensors: nn.Module calls, custom autograd Functions and parameter tensors of
    one chunk's micro-batch (opcount traces); rank_tensors, rank_params: parameter tensors and
    elements of the whole rank; tp_calls: its tensor-parallel collectives per step (comm.py);
    grad_bytes: the gradient bytes it reduces; dp_ranks: the ranks it reduces them over.
    """
    pr, out = profile, HostPrice()
    src = hw.sources.get
    us = 1e6
    units = max(1, micro * chunks)  # (micro-batch, chunk) pairs of a step
    if pr.module_call_s:
        t = modules * pr.module_call_s
        out.forward_s += t
        out.explain.append(("module calls", f"{modules:.0f} per micro-batch x {pr.module_call_s * us:.2f} us = "
                            f"{t * 1e3:.3f} ms", src("module_call_s", "profile")))
    if pr.function_s:
        n = functions + tp_calls / units
        t = n * pr.function_s
        out.forward_s += t / 2
        out.backward_s += t / 2
        out.explain.append(("autograd Functions", f"{functions:.0f} traced + {tp_calls / units:.0f} tp collectives "
                            f"per micro-batch x {pr.function_s * us:.2f} us = {t * 1e3:.3f} ms (half forward, half "
                            "backward)", src("function_s", "profile")))
    if pr.hook_s:
        t = tensors * pr.hook_s
        out.backward_s += t
        out.explain.append(("gradient hooks", f"{tensors:.0f} parameters x {pr.hook_s * us:.2f} us = {t * 1e3:.3f} ms "
                            "per backward", src("hook_s", "profile")))
    if pr.tensor_query_s:
        # sampled after a chunk's first and last backward of the step (pipeline/executor.py)
        share = min(micro, 2) / micro
        t = rank_tensors * pr.tensor_query_s * share
        out.backward_s += t
        out.explain.append(("model-state sampling", f"{rank_tensors} parameters x {pr.tensor_query_s * us:.2f} us x "
                            f"{share:.2f} (a chunk's first and last backward of {micro}) = {t * 1e3:.3f} ms per "
                            "backward", src("tensor_query_s", "profile")))
    if micro > 1 and cfg.parallel.zero < 2 and pr.op_overhead_s:
        size = 4.0 * rank_params / max(rank_tensors, 1)  # one fp32 gradient, on average
        per_add = pr.op_overhead_s + 3 * size / elementwise_rate(pr, hw, 3 * size)  # read both, write one
        t = (micro - 1) / micro * tensors * per_add
        out.backward_s += t
        out.explain.append(("gradient accumulation", f"({micro} - 1) / {micro} x {tensors:.0f} adds x "
                            f"{per_add * us:.2f} us = {t * 1e3:.3f} ms per backward",
                            "autograd adds into .grad after the first micro-batch; op_overhead_s, elementwise_curve"))
    if pr.thread_s and cfg.parallel.pp > 1:  # started by the first send to another rank
        out.step_s += pr.thread_s
        out.explain.append(("send thread", f"1 per step x {pr.thread_s * 1e3:.3f} ms", src("thread_s", "profile")))
    if cfg.parallel.zero == 0 and dp_ranks > 1 and pr.op_overhead_s:
        buckets = max(1, -(-grad_bytes // (cfg.parallel.bucket_mb * 1e6)))
        ops, views = buckets + rank_tensors, 2 * rank_tensors  # cat per bucket, copy_ per parameter
        size = grad_bytes / max(rank_tensors, 1)
        moved = 2 * grad_bytes  # each read once and written once, by the cat and by the copies back
        t = (ops * pr.op_overhead_s + views * pr.view_overhead_s
             + moved / elementwise_rate(pr, hw, moved / buckets) + moved / elementwise_rate(pr, hw, 2 * size))
        out.step_s += t
        out.explain.append(("bucket packing", f"{ops:.0f} ops + {views} views, 2 x {grad_bytes / 1e6:.2f} MB read + "
                            f"written: {t * 1e3:.3f} ms", "parallel/data/ddp.py AllReduce; op_overhead_s, "
                            "view_overhead_s, elementwise_curve"))
    return out
