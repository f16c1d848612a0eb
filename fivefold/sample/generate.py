"""Text from a trained model in one process: `generate()` and what `fivefold sample` loads.

    model, tokenizer, cfg = load_sampler(Path("runs/debug"))      # a run, a checkpoint or a seed directory
    ids = torch.tensor([tokenizer.encode("def ")])               # (1, T)
    out = generate(model, ids, 32, temperature=0.8, top_k=40)    # (1, T + n)

No KV cache: every new token runs the whole (windowed) prefix through `Transformer.forward`, so the
model code stays the one training runs, with nothing for inference alone. Each token costs a full
forward over up to `context` tokens: fine for the models one process can hold on a CPU, and the
reference a cached decoder would have to reproduce.

Weights come through checkpoint/convert.py's readers (a run checkpoint of any layout, read tensor by tensor,
or a seed directory's safetensors) into a model built on the meta device and materialized once, so
no random initialisation is paid for values that are overwritten at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fivefold.checkpoint.convert import check_fit, open_fivefold
from fivefold.checkpoint.run_dir import latest_checkpoint
from fivefold.checkpoint.weights import source_name
from fivefold.config.load import RUN_CONFIG, SEED_CONFIG, load_config
from fivefold.config.schema import Config
from fivefold.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from fivefold.model.lora import apply_lora
from fivefold.model.transformer import Transformer
from fivefold.parallel.materialize import materialize

RUN_TOKENIZER = "tokenizer"  # RUN_DIR/tokenizer/: the files that reproduce the run's tokenizer


class SampleError(ValueError):
    """Input `fivefold sample` cannot use; the message names the path and the fix."""


# ---- generation ----------------------------------------------------------------------------------
def _next_token(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V') of the last position -> the next id of each row (B,)."""
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits.float() / temperature  # (B, V')
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest of each row
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V')
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)


@torch.inference_mode()
def generate(model: Transformer, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, seed: int | None = 0, vocab_limit: int | None = None, stop_id: int | None = None,
             context: int | None = None) -> torch.Tensor:
    """Continue each row of `ids` (B, T) by up to `max_new_tokens` ids; returns (B, T + n), n <= max_new_tokens.

    temperature: 0 = greedy (argmax; top_k is then irrelevant), else sample from softmax(logits / temperature)
      restricted to the `top_k` most likely ids (0 = all).
    seed: the sampling draws come from a generator of their own seeded with it (torch's global RNG is
      left alone, so the same seed gives the same text whatever ran before); None = the global RNG.
    vocab_limit: ids from here on are never produced. The vocabulary is padded to a multiple (for tp);
      the loss gives the padding ids no probability, so their logits are untrained noise, and ids
      beyond the tokenizer's vocabulary cannot be decoded. Default: the model's whole vocabulary.
    stop_id: a row that produces it is finished (its later positions repeat stop_id); generation ends
      when every row is finished. None = always max_new_tokens.
    context: the model sees at most the last `context` ids (positions 0..context-1, as in training);
      None = the whole sequence.
    """
    vocab = model.cfg.vocab_size
    limit = vocab if vocab_limit is None else min(vocab_limit, vocab)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be (batch, tokens) with at least one token, got shape {tuple(ids.shape)}")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0 or limit < 1:
        raise ValueError(f"temperature {temperature}, top_k {top_k}, max_new_tokens {max_new_tokens} and "
                         f"vocab_limit {limit} must not be negative (vocab_limit at least 1)")
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ValueError(f"ids hold {int(ids.max())}: outside the model's vocabulary 0..{vocab - 1}")
    generator = None
    if temperature > 0 and seed is not None:
        generator = torch.Generator(device=ids.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = ids
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)  # (B,)
        for _ in range(max_new_tokens):
            window = out if context is None else out[:, -context:]  # (B, T')
            logits = model(window)[:, -1, :limit]  # (B, V'): the last position's scores over usable ids
            token = _next_token(logits, temperature, top_k, generator)  # (B,)
            if stop_id is not None:
                token = torch.where(done, torch.full_like(token, stop_id), token)
                done |= token == stop_id
            out = torch.cat([out, token[:, None]], dim=1)  # (B, T + 1)
            if stop_id is not None and bool(done.all()):
                break
        return out
    finally:
        model.train(was_training)


# ---- what to sample from -------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    weights: Path  # a run checkpoint (DCP) or a seed directory (safetensors)
    config: Path  # the config the weights were made with
    run_dir: Path | None  # the run they belong to (None for a seed directory)


def _is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()  # DCP writes it last, after every rank's data


def resolve_source(path: Path, config: Path | None = None) -> Source:
    """RUN_DIR (its latest complete checkpoint), RUN_DIR/checkpoints/step_N, or a seed directory."""
    what = ("give a run directory (runs/NAME), one of its checkpoints (runs/NAME/checkpoints/step_N) or a seed "
            "directory (`fivefold init`, `fivefold convert --to fivefold`)")
    if not path.exists():
        raise SampleError(f"{path} does not exist: {what}")
    if not path.is_dir():
        raise SampleError(f"{path} is not a directory: {what}")
    if _is_checkpoint(path):
        run_dir = path.parent.parent  # RUN_DIR/checkpoints/step_N
        return Source(path, config or run_dir / RUN_CONFIG, run_dir)
    if (path / SEED_CONFIG).is_file():
        return Source(path, config or path / SEED_CONFIG, None)
    if (path / RUN_CONFIG).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            seed = (f", or sample its seed directory: fivefold sample {path / 'seed'}"
                    if (path / "seed").is_dir() else "")
            raise SampleError(f"{path} holds no complete checkpoint (checkpoints/step_N with state.json): train it "
                              f"first (checkpoint.every, or the end of the run writes one){seed}")
        return Source(latest, config or path / RUN_CONFIG, path)
    if (path / "config.json").is_file():
        raise SampleError(f"{path} is a Hugging Face directory: convert it first, "
                          f"fivefold convert {path} SEED_DIR --to fivefold, then sample SEED_DIR")
    raise SampleError(f"{path} holds neither {RUN_CONFIG} (a run), .metadata (a checkpoint) nor {SEED_CONFIG} "
                      f"(a seed directory): {what}")


def load_model(source: Source, device: torch.device | str = "cpu") -> Transformer:
    """The whole model in this process, its values from `source` (a checkpoint of any layout or a seed
    directory), in eval mode. Built on the meta device: no initialisation is computed and thrown away."""
    weights, model_cfg, _, _ = open_fivefold(source.weights, source.config)
    # Sampling runs the main model only: the MTP depths (model.mtp_layers) are neither built nor read.
    model_cfg = replace(model_cfg, mtp_layers=0)
    check_fit(weights, model_cfg, str(source.weights))  # every tensor present with its shape, before any is read
    with torch.device("meta"):
        model = Transformer(model_cfg)
    lora = load_config(source.config).lora
    if lora.rank:  # a LoRA run's checkpoint: its base and its adapters, both read below
        apply_lora(model, lora)
    materialize(model, torch.device(device))  # empty parameters, zero buffers (their initial value)
    with torch.no_grad():
        for name, value in model.state_dict().items():  # views of the parameters: copied into in place
            found = source_name(name, weights, model_cfg.tie_embeddings)
            if found is not None:  # else a buffer the weights lack (a routing bias): it keeps its zeros
                value.copy_(weights.read(found))
    return model.eval()


def _from_spec(spec: str, where: str) -> ByteTokenizer | HFTokenizer:
    try:
        return load_tokenizer(spec)
    except ValueError as e:  # TokenizerError: names the file and the fix
        raise SampleError(f"{where}: {e}") from None


def find_tokenizer(source: Source, cfg: Config, override: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer the weights were trained with: `override` (--tokenizer); a run's RUN_DIR/tokenizer/;
    a seed directory's own tokenizer.json / byte.json; else the config's data.tokenizer ("bpe" needs
    the files the run trained, so it is an error without them; "" is the prepared dataset's, else bytes)."""
    if override:
        return _from_spec(override, "--tokenizer")
    if source.run_dir is not None:
        saved = source.run_dir / RUN_TOKENIZER
        if saved.is_dir():
            return _from_spec(str(saved), str(saved))
        legacy = source.run_dir / "tokenizer.json"  # where runs before RUN_DIR/tokenizer/ kept a trained BPE
        if cfg.data.tokenizer == "bpe" and legacy.is_file():
            return _from_spec(str(legacy), str(legacy))
    elif (source.weights / "tokenizer.json").is_file() or (source.weights / "byte.json").is_file():
        return _from_spec(str(source.weights), str(source.weights))
    spec = cfg.data.tokenizer
    if spec == "":  # the data's own: a prepared dataset's tokenizer/ (`fivefold prepare`), else bytes
        for path in [p for p, _ in cfg.data.mixture] or list(cfg.data.paths):
            if (Path(path) / RUN_TOKENIZER).is_dir():
                return _from_spec(str(Path(path) / RUN_TOKENIZER), str(Path(path) / RUN_TOKENIZER))
        return ByteTokenizer()
    if spec == "bpe":
        holder = source.run_dir / RUN_TOKENIZER if source.run_dir is not None else source.weights / "tokenizer.json"
        raise SampleError(f"{source.config} has data.tokenizer = 'bpe' but {holder} does not exist (the BPE a run "
                          f"trains is saved there): pass --tokenizer with its tokenizer.json")
    return _from_spec(spec, f"{source.config} (data.tokenizer)")


def load_sampler(path: Path, config: Path | None = None, tokenizer: str | None = None,
                 device: torch.device | str = "cpu") -> tuple[Transformer, ByteTokenizer | HFTokenizer, Config]:
    """The model, its tokenizer and its config for a run directory, a checkpoint or a seed directory."""
    source = resolve_source(path, config)
    if not source.config.is_file():
        raise SampleError(f"{source.config} not found: pass --config, the config.toml of the run the weights are from")
    cfg = load_config(source.config)
    tok = find_tokenizer(source, cfg, tokenizer)  # before the weights: a wrong tokenizer fails in milliseconds
    return load_model(source, device), tok, cfg


def complete(model: Transformer, tokenizer: ByteTokenizer | HFTokenizer, prompt: str, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, seed: int | None = 0, context: int | None = None,
             stop_at_eod: bool = True, what: str = "the model") -> str:
    """The prompt followed by its continuation, as text. An empty prompt starts a document: from the
    end-of-document id, the token every packed training document follows."""
    ids = tokenizer.encode(prompt) or [tokenizer.eod]
    vocab = model.cfg.vocab_size
    if max(ids) >= vocab:
        raise SampleError(f"the prompt encodes to id {max(ids)}, beyond the {vocab} ids of {what}: the tokenizer "
                          f"({tokenizer.vocab_size} ids) is not the model's; pass --tokenizer with the one it was "
                          f"trained with")
    device = next(model.parameters()).device
    out = generate(model, torch.tensor([ids], device=device), max_new_tokens, temperature=temperature,
                   top_k=top_k, seed=seed, vocab_limit=tokenizer.vocab_size,
                   stop_id=tokenizer.eod if stop_at_eod else None, context=context)  # (1, T + n)
    new = out[0, len(ids):].tolist()
    if stop_at_eod and tokenizer.eod in new:
        new = new[: new.index(tokenizer.eod)]
    # Decode with the prompt's ids in front: a tokenizer that drops the space of a word's first piece
    # (SentencePiece's "▁") or splits a UTF-8 character across the boundary would get the seam wrong.
    head, whole = tokenizer.decode(ids), tokenizer.decode(ids + new)
    return prompt + (whole[len(head):] if whole.startswith(head) else tokenizer.decode(new))
