"""Gradient buckets overlapping the backward: what the planner predicts stays exposed.

For each bucket size, tokens per rank and data-parallel size, a DDP layout of llama3-8b on H100s
is estimated by `planner.estimate.estimate` (the numbers `fivefold plan` prints) and its
`BucketOverlap` shown: the all-reduce of all gradients, of one bucket, the backward it overlaps,
and what is exposed. Tokens per rank are micro_batch x 1024 (one micro-batch per step), so more
tokens mean a longer backward to hide the same gradients under.
"""

from __future__ import annotations

import math
from typing import Any

from fivefold.config.derive import derive
from fivefold.config.load import ConfigError, read_config
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.memory import BytesPerParam
from fivefold.validate import validate
from fivefold.viz.explain.page import Control, Page

MODEL, GPU, SEQ = "llama3-8b", "h100", 1024
BUCKET_MB = (1, 5, 25, 100, 400, 1600)
MICRO_BATCH = (1, 2, 4, 8, 16, 32)  # x SEQ tokens per rank
DP = (2, 8, 16, 64)


def config(bucket_mb: int, tokens: int, n: int) -> Config:
    """The DDP layout one position of the controls stands for."""
    overrides = [f"--model.preset={MODEL}", f"--parallel.dp={n}", f"--parallel.bucket_mb={bucket_mb}",
                 f"--train.seq_len={SEQ}", f"--train.micro_batch={tokens // SEQ}",
                 f"--train.global_batch={tokens // SEQ * n}"]
    cfg, errors = read_config(None, overrides)
    errors += validate(cfg, n)
    if errors:
        raise ConfigError(errors)
    return cfg


def entry(bucket: int, tokens: int, n: int) -> dict[str, Any]:
    cfg = config(bucket, tokens, n)
    est = estimate(cfg, n, get_hardware(GPU))
    overlap = est.dp_overlap
    grad_bytes = model_counts(cfg.model, derive(cfg, n, unpadded_vocab(cfg)).vocab_size).total * BytesPerParam().grad
    buckets = math.ceil(grad_bytes / (bucket * 1e6))
    # The planner's picture: earlier buckets reduce while the backward runs; the last one only
    # once it ends. The reduction is drawn ending where the exposed time ends.
    end = overlap.window_s + est.exposed_dp_s
    return {"reduce_s": overlap.reduce_s, "bucket_s": overlap.bucket_s, "window_s": overlap.window_s,
            "exposed_s": est.exposed_dp_s, "grad_bytes": grad_bytes, "buckets": buckets,
            "inter_node": est.comm["dp"].inter_node,
            "earlier": [end - overlap.reduce_s, end - overlap.bucket_s, buckets - 1],
            "last": [end - overlap.bucket_s, end]}


def page() -> Page:
    return Page(
        slug="gradient_buckets", title="Gradient buckets overlapping the backward",
        summary="bucket size and tokens per rank as sliders; the exposed all-reduce, from the planner",
        intro=("<p>Data parallelism sums gradients over the ranks with an all-reduce. Gradients are ready layer "
               "by layer during the backward, so they are packed into <b>buckets</b> and each bucket is reduced "
               "as soon as it is full, while the backward goes on. What does not fit under the backward is "
               "<b>exposed</b>: the step waits for it. The last bucket fills only when the backward ends, so at "
               f"least its reduction is always exposed. Model: {MODEL}, DDP (ZeRO off), {GPU.upper()}s, 8 per "
               "node, bf16 gradients.</p>"),
        controls=[Control("bucket", "bucket size", BUCKET_MB, kind="slider", default=25,
                          labels=tuple(f"{b} MB" for b in BUCKET_MB)),
                  Control("tokens", "tokens per rank", tuple(mb * SEQ for mb in MICRO_BATCH), kind="slider",
                          default=4 * SEQ, labels=tuple(f"{mb}K" for mb in MICRO_BATCH)),
                  Control("n", "data-parallel ranks", DP, default=8,
                          labels=tuple(f"{n} ({'one node' if n <= 8 else f'{n // 8} nodes'})" for n in DP))],
        entry=entry, script="buckets.js",
        body=('<div class="numbers">'
              '<div class="number key"><span class="label">exposed communication</span>'
              '<span class="value" id="exposed"></span></div>'
              '<div class="number"><span class="label">backward (the window)</span>'
              '<span class="value" id="window"></span></div>'
              '<div class="number"><span class="label">all-reduce of all gradients</span>'
              '<span class="value" id="reduce"></span></div>'
              '<div class="number"><span class="label">all-reduce of one bucket</span>'
              '<span class="value" id="bucket"></span></div>'
              '<div class="number"><span class="label">gradients per rank</span>'
              '<span class="value" id="grads"></span></div>'
              '<div class="number"><span class="label">buckets</span><span class="value" id="buckets"></span>'
              '</div></div>'
              '<svg id="overlap" width="1040" height="180" role="img" aria-label="backward and all-reduce"></svg>'
              '<p id="link"></p>'),
        notes=("<p>From <code>estimate()</code> (<code>fivefold/planner/terms.py</code>, its data-parallel "
               "exposure): a ring all-reduce costs 2(N-1) link latencies plus 2(N-1)/N of the bytes over the "
               "link's bandwidth (NVLink inside a node, the NIC across nodes); the exposed time is "
               "<code>BucketOverlap.exposed_s</code> = max(all-reduce - backward, min(one bucket, all-reduce)). "
               "The planner charges the latency once per all-reduce, not once per bucket, so very small "
               "buckets look free here.</p>"))
