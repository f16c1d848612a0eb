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
from helpers import (  # noqa: E402
    DOCUMENTS_ON,
    EQUIVALENCE,
    GEMMA_ARGS,
    LORA,
    LORA_MLA_TARGETS,
    MASKS_ON,
    MLA_ARGS,
    MOE_ARGS,
    MUON,
    OLMO2_ARGS,
    QK,
    TIED_ARGS,
    document_args,
    one_process,
    one_process_bf16,
    short_documents,
)

import fivefold.train.loop  # noqa: E402,F401

# ---- the single-process references every layout must reproduce: all of them, here ------------------
# Each trains the same data (helpers.EQUIVALENCE) with each global batch in one micro-batch. A table
# row (helpers.Layout) names the one it reproduces.


def _one_process(tmp_path_factory, name: str, *args: str):
    return one_process(tmp_path_factory.mktemp(name), *args)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The plain model: data, tensor, pipeline and context parallel reproduce it."""
    return _one_process(tmp_path_factory, "ref", *EQUIVALENCE)


@pytest.fixture(scope="session")
def muon_reference(tmp_path_factory):
    """Muon on the hidden matrices (helpers.MUON): every dimension's Muon row reproduces it."""
    return _one_process(tmp_path_factory, "ref-muon", *EQUIVALENCE, *MUON)


@pytest.fixture(scope="session")
def muon_moe_reference(tmp_path_factory):
    """Muon on the MoE, each expert its own matrix: expert parallel's Muon row."""
    return _one_process(tmp_path_factory, "ref-muon-moe", *EQUIVALENCE, *MOE_ARGS, *MUON)


@pytest.fixture(scope="session")
def qk_reference(tmp_path_factory):
    """Muon with QK-clip (helpers.QK): the QK-clip table's rows reproduce it."""
    return _one_process(tmp_path_factory, "ref-qk", *EQUIVALENCE, *QK)


@pytest.fixture(scope="session")
def qk_mla_reference(tmp_path_factory):
    return _one_process(tmp_path_factory, "ref-qk-mla", *EQUIVALENCE, *QK, *MLA_ARGS)


@pytest.fixture(scope="session")
def lora_reference(tmp_path_factory):
    """LoRA on the plain model (helpers.LORA): the LoRA table's rows reproduce it."""
    return _one_process(tmp_path_factory, "ref-lora", *EQUIVALENCE, *LORA)


@pytest.fixture(scope="session")
def lora_tied_reference(tmp_path_factory):
    return _one_process(tmp_path_factory, "ref-lora-tied", *TIED_ARGS, *LORA)


@pytest.fixture(scope="session")
def lora_mla_reference(tmp_path_factory):
    return _one_process(tmp_path_factory, "ref-lora-mla", *EQUIVALENCE, *LORA, *MLA_ARGS, LORA_MLA_TARGETS)


@pytest.fixture(scope="session")
def lora_moe_reference(tmp_path_factory):
    return _one_process(tmp_path_factory, "ref-lora-moe", *EQUIVALENCE, *LORA, *MOE_ARGS)


@pytest.fixture(scope="session")
def tied_reference(tmp_path_factory):
    """The same with tied embeddings (helpers.TIED_ARGS): for pipeline and tensor parallel."""
    return _one_process(tmp_path_factory, "tied", *TIED_ARGS)


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory):
    """The MoE with its bias update and balance loss (helpers.MOE_ARGS): expert parallel reproduces it."""
    return _one_process(tmp_path_factory, "moe", *EQUIVALENCE, *MOE_ARGS)


@pytest.fixture(scope="session")
def mla_reference(tmp_path_factory):
    """DeepSeek-V3's architecture in miniature (helpers.MLA_ARGS)."""
    return _one_process(tmp_path_factory, "mla", *EQUIVALENCE, *MLA_ARGS)


@pytest.fixture(scope="session")
def olmo2_reference(tmp_path_factory):
    """OLMo 2's block features (helpers.OLMO2_ARGS)."""
    return _one_process(tmp_path_factory, "olmo2", *OLMO2_ARGS)


@pytest.fixture(scope="session")
def gemma_reference(tmp_path_factory):
    """Gemma 3's block features with Qwen2's and gpt-oss's attention biases (helpers.GEMMA_ARGS)."""
    return _one_process(tmp_path_factory, "gemma", *GEMMA_ARGS)


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory):
    """A folder of short documents (helpers.short_documents): every row holds several."""
    folder = tmp_path_factory.mktemp("docs")
    for i, content in enumerate(short_documents()):
        (folder / f"doc{i:03d}.txt").write_bytes(content)
    return folder


@pytest.fixture(scope="session")
def documents_reference(tmp_path_factory, short_docs):
    """The plain model on packed documents kept apart (helpers.document_args, DOCUMENTS_ON)."""
    return _one_process(tmp_path_factory, "docs-dense", *document_args(short_docs, *DOCUMENTS_ON))


@pytest.fixture(scope="session")
def documents_off_reference(tmp_path_factory, short_docs):
    """The same documents without the options: to show they change the run."""
    return _one_process(tmp_path_factory, "docs-off", *document_args(short_docs))


@pytest.fixture(scope="session")
def masks_reference(tmp_path_factory, short_docs):
    """Documents, sliding windows and sinks at once (helpers.MASKS_ON)."""
    return _one_process(tmp_path_factory, "masks", *document_args(short_docs, *MASKS_ON))


@pytest.fixture(scope="session")
def masks_moe_reference(tmp_path_factory, short_docs):
    """The MoE with documents, sliding windows and sinks."""
    return _one_process(tmp_path_factory, "masks-moe", *document_args(short_docs, *MASKS_ON, *MOE_ARGS))


# ---- in bf16 autocast: what a table's bf16 row (helpers.BF16) is held to -------------------------
# Each is a pair: one process in bf16, and in fp32 at the same learning rate (their gap is the noise).


@pytest.fixture(scope="session")
def bf16_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "ref", *EQUIVALENCE)


@pytest.fixture(scope="session")
def bf16_muon_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "ref-muon", *EQUIVALENCE, MUON[0])


@pytest.fixture(scope="session")
def bf16_qk_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "ref-qk", *EQUIVALENCE, *QK[:1], *QK[2:])  # lr: BF16's


@pytest.fixture(scope="session")
def bf16_lora_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "ref-lora", *EQUIVALENCE, *LORA)


@pytest.fixture(scope="session")
def bf16_moe_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "moe", *EQUIVALENCE, *MOE_ARGS)


@pytest.fixture(scope="session")
def bf16_mla_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "mla", *EQUIVALENCE, *MLA_ARGS)


@pytest.fixture(scope="session")
def bf16_olmo2_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "olmo2", *OLMO2_ARGS)


@pytest.fixture(scope="session")
def bf16_gemma_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "gemma", *GEMMA_ARGS)


@pytest.fixture(scope="session")
def bf16_masks_reference(tmp_path_factory, short_docs):
    return one_process_bf16(tmp_path_factory, "masks", *document_args(short_docs, *MASKS_ON))
