"""What `fivefold calibrate` measured beyond the data sheet: the figures a CPU step is made of.

On a GPU a small model's step is bound by FLOPs and bytes (kernels queue asynchronously behind a
few microseconds of launch), which the data-sheet figures price (datasheet.py). On a CPU every op
is paid in full by the one thread that dispatches it, and the Python around the ops runs on the
same thread: a tiny model's step is hundreds of small ops per block, each costing a fixed
dispatch-and-autograd overhead that FLOPs do not see. A `MeasuredProfile` holds those costs, each
measured by `fivefold calibrate` on the machine (measure.py says how), never fitted to a training
run; pricer.py prices a step with them, opcount.py counts what they multiply.

Split from `Hardware` on purpose: everything here prices *compute* (ops, Python, the optimizer,
the noise a collective waits for), while what the core's alpha-beta and FLOP models read (peak
FLOP/s and its efficiency, bandwidths, latencies, per-collective alpha) stays on `Hardware`, which
a calibrated profile fills with measured values too. The fields are the profile TOML's keys
(hardware.load_profile), so existing profile files read unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fivefold.planner.calibration.opcount import OpTally
from fivefold.planner.machine.datasheet import Hardware
from fivefold.planner.machine.roofline import interpolate


@dataclass(frozen=True)
class MeasuredProfile:
    """The compute costs `fivefold calibrate` measured on one machine (zero or empty: not measured)."""

    threads: int = 0  # compute threads per rank the measurements ran with (training workers' count)
    op_overhead_s: float = 0.0  # fixed cost of one dispatched aten op, forward or backward (autograd included)
    view_overhead_s: float = 0.0  # the same for a view (view, t, transpose, detach: no data moved)
    matmul_curve: tuple[tuple[float, float], ...] = ()  # (FLOPs of one matmul, FLOP/s achieved), by size
    elementwise_curve: tuple[tuple[float, float], ...] = ()  # (bytes an op reads + writes, bytes/s beyond the overhead)
    optimizer_s_per_tensor: float = 0.0  # AdamW + gradient clipping + zero_grad, per parameter tensor
    optimizer_s_per_element: float = 0.0  # the same, per parameter element
    # Python's share of a step, measured the same way (priced by overheads.py from counts of the layout):
    module_call_s: float = 0.0  # one nn.Module call (forward), beyond the ops it runs
    function_s: float = 0.0  # one custom autograd.Function (its Python forward and backward), beyond its ops
    hook_s: float = 0.0  # one Python hook on a gradient (data parallel's, per parameter and backward)
    tensor_query_s: float = 0.0  # the loop's model-state sampling, per parameter (gradient, optimizer state)
    thread_s: float = 0.0  # one helper thread started and joined (the pipeline's send thread, once a step)
    # `fivefold calibrate --layers`: the model's own parts timed whole at the shapes a config's ranks
    # run (opcount.Part.key, forward s, backward s); the pricer uses them instead of their op prices
    layer_times: tuple[tuple[str, float, float], ...] = ()
    # (seconds of compute since the ranks last synchronised, noise scale sigma): a collective after
    # d seconds waits expected_max_normal(n) x sigma(d) for the slowest of its n ranks (noise.py)
    noise_curve: tuple[tuple[float, float], ...] = ()

    def layer_time(self, key: str) -> tuple[float, float] | None:
        """(forward s, backward s) of the part named `key` (opcount.Part.key), if it was timed."""
        return next(((f, b) for k, f, b in self.layer_times if k == key), None)


MEASURED_FIELDS = tuple(f.name for f in fields(MeasuredProfile))


def matmul_rate(profile: MeasuredProfile, hw: Hardware, flops: float) -> float:
    """Achieved FLOP/s of one matmul of `flops` FLOPs: the measured curve, else peak x efficiency."""
    if profile.matmul_curve:
        return interpolate(profile.matmul_curve, flops)
    return hw.peak_flops * hw.compute_efficiency


def elementwise_rate(profile: MeasuredProfile, hw: Hardware, nbytes: float) -> float:
    """Bytes/s one elementwise op moves at this size: the measured curve, else the copy bandwidth."""
    if profile.elementwise_curve:
        return interpolate(profile.elementwise_curve, nbytes)
    return hw.hbm_bw


def tally_time(t: OpTally, profile: MeasuredProfile, hw: Hardware) -> dict[str, float]:
    """Seconds of the tally's ops: {"overhead", "matmul", "attention", "elementwise", "total"}.

    time = sum over ops of (overhead + work), work = FLOPs / matmul rate(size) for matmuls and
    attention (at the rate of one head's QK^T), bytes / elementwise rate(size) for the rest; views
    move no data and cost view_overhead_s alone."""
    overhead = t.ops * profile.op_overhead_s + t.views * profile.view_overhead_s
    matmul = sum(f / matmul_rate(profile, hw, f) for f in t.matmul_flops)
    attention = sum(f / matmul_rate(profile, hw, per_head) for f, per_head in t.attention)
    elementwise = sum(b / elementwise_rate(profile, hw, b) for b in t.elementwise_bytes)
    return {"overhead": overhead, "matmul": matmul, "attention": attention, "elementwise": elementwise,
            "total": overhead + matmul + attention + elementwise}
