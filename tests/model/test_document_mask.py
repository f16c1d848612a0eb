"""Document masking and per-document positions (data.document_mask, data.reset_positions).

First the model alone: a packed row with the mask is its documents run apart (also with a window
and sinks). Then whole training runs on data made of short documents (every row holds at least
two): the options change the run, and evaluation masks too. Every parallel layout with documents,
windows and sinks against one process: tests/parallel/test_masks_layouts.py.
"""

import dataclasses

import pytest
import torch
from helpers import DOCUMENTS_ON, document_args, tiny_config

from fivefold.model.config import AttentionConfig
from fivefold.model.masks import AttentionMask, Documents, dense_keep, document_ids, document_positions
from fivefold.model.presets import PRESETS
from fivefold.model.transformer import Transformer, cross_entropy_sum
from fivefold.parallel.forked_ranks import run_workers
from fivefold.validate import validate

EOD = 319  # any id of the vocabulary; the model cannot tell it from another token


def _tiny(**options) -> Transformer:
    """Two blocks; `options` of the model config (a window, sinks: their logits drawn, not zero)."""
    m = Transformer(dataclasses.replace(PRESETS["tiny"], n_layers=2, n_kv_heads=2, vocab_size=320, **options))
    m.init_weights(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.normal_(generator=torch.Generator().manual_seed(1))
    return m


WINDOW_AND_SINKS = {"attention": AttentionConfig(window=3, window_pattern=("sliding", "full"), sinks=True)}


def test_document_ids_mask_and_positions_by_hand():
    tokens = torch.tensor([[5, EOD, 7, 8, EOD, 9], [EOD, EOD, 1, 2, 3, 4]])
    doc = document_ids(tokens, EOD)
    assert doc.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]  # an eod belongs to the document it ends
    assert document_positions(doc, torch.arange(6)).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
    mask = dense_keep(AttentionMask(doc), 6)  # (B, 1, T, T): the rule, written out for a small row
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False, False]  # own document, not later tokens
    assert mask.diagonal(dim1=-2, dim2=-1).all()  # no query row fully masked


def test_both_options_off_is_the_plain_causal_path():
    cfg = tiny_config("/tmp/unused")
    assert Documents.from_config(cfg.data, 256) is None
    on = Documents.from_config(dataclasses.replace(cfg.data, reset_positions=True), 256)
    assert on == Documents(256, mask=False, reset_positions=True)


def _packed_row():
    """One row of three documents (5, 7 and 4 tokens, each ending with an eod), targets shifted
    inside the row, and the documents' (start, end) spans."""
    g = torch.Generator().manual_seed(0)
    spans = [(0, 5), (5, 12), (12, 16)]
    tokens = torch.randint(0, EOD, (1, 17), generator=g)
    for _, end in spans:
        tokens[0, end - 1] = EOD
    return tokens[:, :-1], tokens[:, 1:], spans  # (1, 16) each


def _losses_and_grads(model, x, y, positions, doc):
    model.zero_grad()
    logits = model(x, positions, doc=doc)  # (B, T, V)
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    per_token.sum().backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("options", [{}, WINDOW_AND_SINKS], ids=["causal", "window+sinks"])
@pytest.mark.parametrize("reset", [False, True])
def test_masked_packed_row_is_its_documents_run_apart(reset, options):
    """Per-token losses and summed parameter gradients of the packed row equal those of each
    document alone (its own row; positions from 0 with reset_positions, else where it sat), also
    with a window on one block and sinks on both (a window and a sink act within a document)."""
    model = _tiny(**options)
    x, y, spans = _packed_row()
    positions, doc = Documents(EOD, mask=True, reset_positions=reset).inputs(x, torch.arange(16))
    packed, packed_grads = _losses_and_grads(model, x, y, positions, doc)
    alone, alone_grads = [], {}
    for start, end in spans:
        pos = torch.arange(end - start) if reset else torch.arange(start, end)
        losses, grads = _losses_and_grads(model, x[:, start:end], y[:, start:end], pos, None)
        alone.append(losses)
        alone_grads = {n: alone_grads.get(n, 0) + g for n, g in grads.items()}
    # fp32: the same products, summed over other key counts and in another order: ~1e-7.
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=2e-6)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # Without the mask the later documents see the earlier ones: the comparison above can fail.
    unmasked, _ = _losses_and_grads(model, x, y, positions, None)
    assert (unmasked[5:] - torch.cat(alone)[5:]).abs().max() > 1e-3
    torch.testing.assert_close(unmasked[:5], torch.cat(alone)[:5], rtol=0, atol=2e-6)  # the first is alone anyway


def test_reset_positions_alone_restarts_rope_at_each_document():
    model = _tiny()
    x, y, _ = _packed_row()
    positions, doc = Documents(EOD, mask=False, reset_positions=True).inputs(x, torch.arange(16))
    assert doc is None
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]]
    with torch.no_grad():
        restarted = model(x, positions)  # (1, 16, V): rope_cos_sin of (B, T) positions
        by_hand = model(x, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]))  # the same, as (T,)
        plain = model(x)
    torch.testing.assert_close(restarted, by_hand, rtol=0, atol=0)
    # Still causal across documents, so the relative offsets of earlier documents' keys change.
    assert (restarted[:, 5:] - plain[:, 5:]).abs().max() > 1e-3
    torch.testing.assert_close(restarted[:, :5], plain[:, :5], rtol=0, atol=0)


def test_validate_accepts_context_parallel_with_documents(tmp_path):
    for name in ("document_mask", "reset_positions"):
        for method in ("ring", "ulysses"):
            cfg = tiny_config(tmp_path, "--parallel.cp=2", f"--parallel.cp_method={method}", f"--data.{name}=true")
            assert not [e for e in validate(cfg, 2) if name in e]


# ---- whole training runs ---------------------------------------------------------------------

def _eods_per_row(rank, world, cfg):
    """Worker: train, recording how many eod tokens each micro-batch row the model saw holds."""
    from fivefold.train.loop import train

    seen: list[int] = []
    build = Documents.inputs

    def spy(self, tokens, positions):
        seen.extend((tokens == self.eod).sum(1).tolist())
        return build(self, tokens, positions)

    Documents.inputs = spy  # this forked worker's copy of the class only
    train(cfg, progress=False)
    return seen


def test_every_row_of_the_data_holds_several_documents(tmp_path, short_docs):
    """What the model is fed (whatever the data pipeline made of the files): every row, the short
    tail sample's too, holds two eod tokens or more."""
    cfg = tiny_config(tmp_path, *document_args(short_docs, *DOCUMENTS_ON, "--train.micro_batch=8"))
    seen = run_workers(_eods_per_row, 1, cfg)[0]
    assert len(seen) == 5 * 8
    # EQUIVALENCE's shape: the 5th step is an uneven last batch of 3 samples, its 5 empty slots
    # padding rows (all eod, targets -100).
    assert sum(n == 32 for n in seen) == 5
    assert min(seen) >= 2


def test_the_options_change_the_single_process_run(documents_reference, documents_off_reference):
    on, off = documents_reference[0], documents_off_reference[0]
    assert on[0] != off[0]  # the first step's loss already: the flags reach the model through the loop
    assert max(abs(a - b) for a, b in zip(on, off, strict=True)) > 1e-3


def test_sum_of_token_losses_is_unchanged_by_the_mask_for_one_document():
    """A row holding one document (no eod among its tokens) is the plain causal run, to rounding (the
    masked SDPA is another kernel): the mask only removes attention across documents."""
    model = _tiny()
    x = torch.randint(0, EOD, (2, 16))
    y = torch.randint(0, EOD, (2, 16))
    positions, doc = Documents(EOD, mask=True, reset_positions=True).inputs(x, torch.arange(16))
    with torch.no_grad():
        masked = cross_entropy_sum(model(x, positions, doc=doc), y)
        plain = cross_entropy_sum(model(x), y)
    torch.testing.assert_close(masked, plain, rtol=1e-6, atol=0)


def _val_losses(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).val_losses


def test_evaluation_masks_too(tmp_path, short_docs):
    """forward_only (evaluation) builds the same mask and positions on every stage. lr 1e-9: the one
    step moves no weight by more than ~1e-9, so the validation losses differ only by how they were
    evaluated."""
    args = document_args(short_docs, "--train.steps=1", "--train.eval_every=1", "--data.val_fraction=0.3",
                         "--optim.lr=1e-9")
    one = run_workers(_val_losses, 1, tiny_config(tmp_path / "one", *args, *DOCUMENTS_ON, "--train.micro_batch=8"))[0]
    pp2 = run_workers(_val_losses, 2, tiny_config(tmp_path / "pp2", *args, *DOCUMENTS_ON, "--parallel.pp=2",
                                                  "--train.micro_batch=2"))[0]
    off = run_workers(_val_losses, 1, tiny_config(tmp_path / "off", *args, "--train.micro_batch=8"))[0]
    assert one.keys() == pp2.keys() == {1}
    assert pp2[1] == pytest.approx(one[1], rel=1e-6)  # fp32 summation order: ~1e-7
    assert abs(off[1] - one[1]) > 1e-3
