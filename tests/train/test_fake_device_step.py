"""Every layout of the equivalence tables, one training step of each distinct rank position on a
fake device, with its host reads held to a budget (fake_device.py says how, and what a CPU build
of torch can and cannot fake).

The layouts are collected from the tables themselves (every `Layout` of tests/parallel/*.py), on
the arguments of the reference each row names, the model cut to the fewest layers the layout takes
(pp x virtual stages, at least 2; rows that place layers or split them unevenly keep theirs):
reads are per step and per MoE forward, and a step costs what its layers do (meta kernels are
Python: ~0.1-0.2 s per layer here). Positions are the dry run's (train/dry_run.py): one per
pipeline rank, whose ranks hold alike and run the same step (their tp / ep / cp / dp peers differ
in data only).

The budget of one step, read from the device (fake_device.py books each read to its function):
- step.train_step: 1, the logged loss and gradient norm (and this rank's loss share) in one read;
- parallelize.optimizer_step: 1, the norm's verdict before AdamW steps. This is the foreach path
  (fake meta tensors, like the CPU): on CUDA fused AdamW skips a non-finite step on the device and
  this read is not made (test_train.py runs that path on the CPU);
- MoE: one read of the split sizes per MoE forward (layer x micro-batch, recomputed forwards too:
  `moe_forwards`, counted by hooks), in moe.local_dispatch (ep = 1: the expert loop; on CUDA
  in bf16 without capacity dropping the grouped matmul needs none) or expert.__call__ (ep > 1: the
  all-to-alls' sizes); plus moe_balance.expert_stats: 1 per step (the routing statistics);
- a printed logging step adds breakdown.gather: 1 (every rank's step-time parts).
Anything else, or more, fails. A split size is data-dependent and has no fake value: the read
is answered with a balanced routing (fake_device.Reads._routing) and bounded by the count above.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from fake_device import fake_step
from helpers import (
    DOCUMENTS_ON,
    EQUIVALENCE,
    LORA,
    LORA_MLA_TARGETS,
    MASKS_ON,
    MLA_ARGS,
    MOE_ARGS,
    MUON,
    TIED_ARGS,
    Layout,
    document_args,
    tiny_config,
)

TESTS = Path(__file__).resolve().parents[1]
TABLES = [TESTS / "parallel" / f"test_{name}.py" for name in
          ("data_parallel", "pipeline", "context_parallel", "tensor_parallel", "expert_parallel", "masks_layouts")]
STEP = {"step.train_step": 1, "parallelize.optimizer_step": 1}
LOGGING = {"breakdown.gather": 1}
MOE_SITES = ("moe.local_dispatch", "expert.__call__")


def base_args(reference: str, docs: Path) -> tuple[str, ...]:
    """The arguments of the single-process reference a row names (tests/conftest.py's fixtures)."""
    known = {"reference": EQUIVALENCE, "tied_reference": TIED_ARGS, "moe_reference": (*EQUIVALENCE, *MOE_ARGS),
             "mla_reference": (*EQUIVALENCE, *MLA_ARGS), "muon_reference": (*EQUIVALENCE, *MUON),
             "muon_moe_reference": (*EQUIVALENCE, *MOE_ARGS, *MUON),
             "lora_reference": (*EQUIVALENCE, *LORA),
             "lora_tied_reference": (*TIED_ARGS, *LORA), "lora_moe_reference": (*EQUIVALENCE, *LORA, *MOE_ARGS),
             "lora_mla_reference": (*EQUIVALENCE, *LORA, *MLA_ARGS, LORA_MLA_TARGETS),
             "documents_reference": document_args(docs, *DOCUMENTS_ON),
             "masks_reference": document_args(docs, *MASKS_ON),
             "masks_moe_reference": document_args(docs, *MASKS_ON, *MOE_ARGS)}
    assert reference in known, f"a Layout names reference {reference!r}: add its arguments here"
    return known[reference]


def table_layouts() -> dict[str, Layout]:
    """Every Layout row of the equivalence tables, named FILE:TABLE:ROW; rows alike are kept once."""
    found, seen = {}, set()
    for path in TABLES:
        spec = importlib.util.spec_from_file_location(f"_tables_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for table, rows in vars(module).items():
            if isinstance(rows, dict) and rows and all(isinstance(v, Layout) for v in rows.values()):
                for row, layout in rows.items():
                    key = (layout.ranks, layout.overrides, layout.reference)
                    if key not in seen:
                        seen.add(key)
                        found[f"{path.stem}:{table}:{row}"] = layout
    return found


def test_the_tables_are_found():
    layouts = table_layouts()
    # as many as the tables hold, less repeats (a row in two tables)
    assert len(layouts) >= 60
    assert {name.split(":")[0] for name in layouts} == {path.stem for path in TABLES}


def test_every_position_steps_on_a_fake_device_within_its_read_budget(tmp_path, short_docs):
    from fivefold.config.derive import derive
    from fivefold.data.resolve import unpadded_vocab
    from fivefold.train.dry_run import positions
    from fivefold.train.loop import build_datasets

    failures, counted = [], 0
    for name, layout in table_layouts().items():
        cfg = tiny_config(tmp_path / name.replace(":", "-"), *base_args(layout.reference, short_docs),
                          *layout.overrides)
        chunks = cfg.parallel.pp * cfg.parallel.virtual_stages
        if not cfg.parallel.stage_layers and cfg.model.n_layers % chunks == 0:  # an uneven split stays
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=max(chunks, 2)))
        data = build_datasets(cfg, tmp_path)
        for pos in positions(cfg, derive(cfg, layout.ranks, unpadded_vocab(cfg))):
            result = fake_step(name, cfg, layout.ranks, pos.rank, data)
            counted += 1
            budget = dict(STEP)
            if result.moe_forwards:
                budget["moe_balance.expert_stats"] = 1
                budget.update({site: result.moe_forwards for site in MOE_SITES})
            over = {site: n for site, n in result.reads.items() if n > budget.get(site, 0)}
            if over or result.logging_reads != LOGGING:
                failures.append(f"{name} {pos.name}: {result.reads} (logging {result.logging_reads})")
    assert not failures, "host reads over the budget:\n" + "\n".join(failures)
    assert counted >= len(table_layouts())


@pytest.mark.parametrize("extra", [(), ("--model.preset=tiny-moe",)], ids=["dense", "moe"])
def test_the_counter_sees_a_read_added_to_the_step(tmp_path, monkeypatch, extra):
    """The budget can fail: a .item() slipped into the optimizer step is booked to it."""
    import fivefold.parallel.parallelize as parallelize
    from fivefold.train.loop import build_datasets

    original = parallelize.clip_grad_norm

    def clip_and_read(*args, **kwargs):
        norm = original(*args, **kwargs)
        norm.item()
        return norm

    monkeypatch.setattr(parallelize, "clip_grad_norm", clip_and_read)
    cfg = tiny_config(tmp_path, *EQUIVALENCE, *extra, "--parallel.zero=2")
    result = fake_step("probe", cfg, 2, 1, build_datasets(cfg, tmp_path))
    assert result.reads["parallelize.optimizer_step"] == 2
