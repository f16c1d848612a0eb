import os

# Workers are forked from this process; with a single OpenMP thread here a fork cannot inherit a
# busy thread pool (TORCH-CPU-NOTES.md), and 2 cores are not oversubscribed by parallel tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
