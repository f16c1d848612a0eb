"""The chunked head and loss (model/head.py) against the unchunked one and torch's cross-entropy, and
multi-token prediction's shifted inputs (model/mtp.py)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.model.head import IGNORE, OutputHead, VocabSplit, token_losses
from fivefold.model.mtp import shift_ahead

N, DIM, V = 200, 32, 1003  # tokens, hidden width, vocabulary (odd: no chunk divides anything evenly)


@contextlib.contextmanager
def one_thread():
    """Bit-for-bit claims in one thread: MKL may split a matmul's reduction differently with more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, DIM, generator=g).requires_grad_()
    w = (torch.randn(V, DIM, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::9] = IGNORE  # padding and untrained turns count nothing
    return h, w, targets


def _grads(chunk: int):
    h, w, targets = _inputs()
    losses = token_losses(h, w, targets, chunk)
    losses.sum().backward()
    return losses.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [7, 64, 199])
def test_chunked_losses_equal_the_unchunked_bit_for_bit_and_gradients_to_summation_order(chunk):
    """Each token's loss is its own row's reductions, whatever else shares its chunk: bit for bit in
    fp32. The gradients differ by fp32 summation order only: the weight's is a sum over chunks where
    one matmul summed all tokens at once, and a hidden state's row is the same dot products, which a
    matmul of other height may sum in another order (199: the last chunk is one row, a
    matrix-vector product). Measured at these shapes: <= 5.1e-7 of the largest entry; the bound is
    2e-6, 16 fp32 epsilons."""
    with one_thread():
        whole, gh, gw = _grads(0)
        ours, ch, cw = _grads(chunk)
    assert torch.equal(ours, whole)
    assert (ch - gh).abs().max() <= 2e-6 * gh.abs().max()
    assert (cw - gw).abs().max() <= 2e-6 * gw.abs().max()
    assert (ours[::9] == 0).all() and (ch[::9] == 0).all()  # ignored tokens: no loss, no gradient


def test_losses_and_gradients_match_torch_cross_entropy_over_full_logits():
    h, w, targets = _inputs()
    ours = token_losses(h, w, targets, 64)
    ours.sum().backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(h2, w2), targets, ignore_index=IGNORE, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


class _Matmuls(TorchDispatchMode):
    """The dtypes of every matmul's inputs, and the largest (rows, columns) tensor any op makes."""

    def __init__(self):
        super().__init__()
        self.dtypes, self.largest, self.count = set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.ndim == 2}
            self.count += 1
        if isinstance(out, torch.Tensor) and not func.is_view and out.ndim == 2 and out.shape[-1] == V:
            self.largest = max(self.largest, out.shape[0])
        return out


def test_under_autocast_every_matmul_is_bf16_and_no_chunk_exceeds_its_size():
    """No fp32 matmul added (the trap of a chunked loss whose backward falls back to fp32: 13x
    slower on a GPU), and logits of at most `chunk` tokens alive, forward and backward."""
    h, w, targets = _inputs()
    watch = _Matmuls()
    with watch:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = token_losses(h, w, targets, 48)
        losses.sum().backward()
    assert watch.dtypes == {torch.bfloat16} and watch.largest == 48
    assert losses.dtype == w.grad.dtype == h.grad.dtype == torch.float32  # fp32 sums, fp32 masters' gradients
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same numbers as autocast's own bf16 head
        ref = F.cross_entropy(F.linear(h, w).float(), targets, ignore_index=IGNORE, reduction="none")
    torch.testing.assert_close(losses, ref, rtol=0, atol=1e-5)


def test_a_backward_for_one_input_computes_only_its_gradient():
    """A zero-bubble schedule's I asks for the hidden states' gradient alone and its W for the
    weight's (pipeline/split_backward.py): each recomputes a chunk's logits and makes its own
    gradient, 2 matmuls a chunk; a whole backward 3 (4 chunks of 50 tokens here)."""
    h, w, targets = _inputs()
    counts = []
    for wanted in ([h], [w], [h, w]):
        losses = token_losses(h, w, targets, 50)
        watch = _Matmuls()
        with watch:
            torch.autograd.grad(losses.sum(), wanted)
        counts.append(watch.count)
    assert counts == [4 * 2, 4 * 2, 4 * 3]


def test_padding_ids_take_no_probability_and_logits_come_from_the_same_weight():
    head = OutputHead(DIM, V)
    head.split = VocabSplit(limit=V - 3)  # the last 3 ids pad the vocabulary
    h, _, targets = _inputs()
    targets = targets.clamp(max=V - 4)
    losses = head(h, targets, chunk=50)
    logits = head(h)  # (N, V): the head's plain forward, for sampling
    ref = F.cross_entropy(logits[:, : V - 3], targets, ignore_index=IGNORE, reduction="none")
    torch.testing.assert_close(losses, ref, rtol=1e-6, atol=1e-5)
    losses.sum().backward()
    assert torch.equal(head.weight.grad[V - 3:], torch.zeros(3, DIM))


def test_shift_ahead_stays_within_rows_documents_and_loss_masks():
    x = torch.tensor([[10, 11, 12, 13, 14, 15]])  # (1, 6)
    y = torch.tensor([[11, IGNORE, 13, 14, 15, 16]])  # one untrained target
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])  # a document starts at position 3
    (t1, y1), (t2, y2) = shift_ahead(x, y, 2)
    assert t1.tolist() == [[11, 12, 13, 14, 15, 0]] and y1.tolist() == [[IGNORE, 13, 14, 15, 16, IGNORE]]
    assert t2.tolist() == [[12, 13, 14, 15, 0, 0]] and y2.tolist() == [[13, 14, 15, 16, IGNORE, IGNORE]]
    (_, y1), (_, y2) = shift_ahead(x, y, 2, doc)
    # depth k at i predicts y[i + k] only where token i + k is in token i's document
    assert y1.tolist() == [[IGNORE, 13, IGNORE, 15, 16, IGNORE]]
    assert y2.tolist() == [[13, IGNORE, IGNORE, 16, IGNORE, IGNORE]]
