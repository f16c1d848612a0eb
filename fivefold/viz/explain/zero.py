"""ZeRO memory per stage: model state per GPU for a chosen model, N and GPU, from the planner.

Parameters come from `planner.counts.model_counts` (the model/transformer.py layer-by-layer count), bytes per
GPU from `planner.memory.model_state_bytes` with the planner's default 2, 2, 12 bytes per
parameter (bf16 weight and gradient; fp32 master weight and two Adam moments), and the largest
model that fits from `largest_fitting_model`: the same functions as `fivefold plan --params`.
Activations and buffers are left out, as in the ZeRO paper's model-state accounting.
"""

from __future__ import annotations

from typing import Any

from fivefold.model.counts import model_counts
from fivefold.model.presets import PRESETS
from fivefold.planner.hardware import CATALOG, get_hardware
from fivefold.planner.memory import BytesPerParam, largest_fitting_model, model_state_bytes
from fivefold.viz.explain.page import Control, Page

MODELS = ("llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "llama3-70b", "llama3-405b", "deepseek-v3")
GPUS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
BYTES = BytesPerParam()


def entry(model: str, n: int, gpu: str) -> dict[str, Any]:
    params = model_counts(PRESETS[model]).total
    hw = get_hardware(gpu)
    stages = []
    for zero, name in enumerate(STAGES):
        state = model_state_bytes(params, BYTES, zero, n)
        stages.append({"name": name, **state, "fits": state["total"] <= hw.memory_bytes,
                       "largest_params": largest_fitting_model(hw.memory_bytes, BYTES, zero, n)})
    return {"params": params, "memory_bytes": hw.memory_bytes, "stages": stages}


def page() -> Page:
    return Page(
        slug="zero_memory", title="ZeRO: model-state memory per GPU",
        summary="parameters, gradients and optimizer state per GPU for each ZeRO stage, from the planner",
        intro=("<p>Data parallelism over N GPUs normally keeps a full copy of the weights, the gradients and the "
               "optimizer state on every GPU. ZeRO shards them over the N GPUs: stage 1 the optimizer state, "
               "stage 2 also the gradients, stage 3 also the weights (FSDP). Pick a model, N and a GPU; the bars "
               "are bytes per GPU, the line the GPU's memory.</p>"),
        controls=[Control("model", "model", MODELS, default="llama3-8b"),
                  Control("n", "GPUs N", GPUS, kind="slider", default=8),
                  Control("gpu", "GPU", tuple(CATALOG), default="h100")],
        entry=entry, script="zero.js",
        body=('<div class="numbers">'
              '<div class="number"><span class="label">parameters</span><span class="value" id="params"></span></div>'
              '<div class="number"><span class="label">GPU memory</span><span class="value" id="memory"></span>'
              '</div></div>'
              '<svg id="bars" width="1040" height="300" role="img" aria-label="memory per stage"></svg>'
              '<div class="legend"><span><span class="swatch" style="background:var(--f)"></span>weights</span>'
              '<span><span class="swatch" style="background:var(--i)"></span>gradients</span>'
              '<span><span class="swatch" style="background:var(--w)"></span>optimizer state</span>'
              '<span>red line: GPU memory</span><span>a bar ending in a white chevron is cut short</span></div>'
              '<table class="grid" id="stages"></table>'),
        notes=("<p>Bytes per parameter 2 + 2 + 12 (<code>planner.memory.BytesPerParam</code>); per GPU: DDP "
               "(2+2+12)P, ZeRO-1 (2+2+12/N)P, ZeRO-2 (2+(2+12)/N)P, ZeRO-3 (2+2+12)P/N "
               "(<code>model_state_bytes</code>; Rajbhandari et al. 2020, sec. 3). Parameters by "
               "<code>model_counts</code> of the preset. GB = 10<sup>9</sup> bytes. \"largest model\" is the "
               "parameter count whose model state alone fills the GPU (<code>largest_fitting_model</code>).</p>"))
