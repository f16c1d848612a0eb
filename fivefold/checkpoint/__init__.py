"""Weights and run state on disk: saved, checked, loaded into any layout, converted.

- run_state.py     run-state checkpoints through torch.distributed.checkpoint (resume, reshard)
- files.py         a checkpoint's files checked before a resume uses any of them
- safe_load.py     loading never runs code from a file
- run_dir.py       where a run lives and which of its checkpoints are complete (no torch)
- safetensors_io.py, seed.py, weights.py: seed directories written tensor by tensor, and
                   `checkpoint.init_from` read slice by slice into this rank's shards
- hf/: Hugging Face models in and out, one module per model family
- convert.py, cli.py: `fivefold init` and `fivefold convert`
"""
