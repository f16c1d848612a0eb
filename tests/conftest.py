import os

# Workers are forked from this process; with a single OpenMP thread here a fork cannot inherit a
# busy thread pool (docs/torch-cpu-notes.md), and 2 cores are not oversubscribed by parallel tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# What every training worker imports, imported once here: forked workers inherit it. Imported in
# each child it cost seconds of CPU per rank per test (DTensor pulls in sympy, the optimizer's first
# construction torch._dynamo): a 4-rank, 1-step tp2 x dp2 run took 6.5 s, with these 1.4-2.6 s.
import pytest  # noqa: E402
import torch._dynamo  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
from helpers import EQUIVALENCE, TIED_ARGS, tiny_config, train_and_gather  # noqa: E402

import fivefold.train.loop  # noqa: E402,F401
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every layout must reproduce: each global batch in one micro-batch."""
    cfg = tiny_config(tmp_path_factory.mktemp("ref"), *EQUIVALENCE, "--train.micro_batch=8")
    return run_workers(train_and_gather, 1, cfg)[0]


@pytest.fixture(scope="session")
def tied_reference(tmp_path_factory):
    """The same with tied embeddings (helpers.TIED_ARGS): for pipeline and tensor parallel."""
    cfg = tiny_config(tmp_path_factory.mktemp("tied"), *TIED_ARGS, "--train.micro_batch=8")
    return run_workers(train_and_gather, 1, cfg)[0]
