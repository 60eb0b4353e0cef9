"""Model source -> (ModelConfig, model on device, tokenizer, fingerprint).

A source is a preset name (tiny presets carry a built-in tokenizer) or a Hugging Face checkpoint
directory: config.json (flat or with `text_config`), *.safetensors (one file, or shards listed in
model.safetensors.index.json), and optionally tokenizer files. `load_format="dummy"` builds random
weights at the real size instead of reading files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig, ModelConfig
from ..errors import ConfigError, WeightsError
from ..layers.joined import pack_model
from ..ops import get_backend
from ..segment.tokenizer import Tokenizer
from . import presets
from .registry import converter, model_class


@dataclass
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    fingerprint: str
    source: str


def load_model(source: str, engine: EngineConfig) -> LoadedModel:
    source = str(source)
    path = Path(source)
    if source in presets.PRESETS:
        cfg = ModelConfig.from_dict(presets.preset_config(source))
        tok = Tokenizer.builtin_bytes() if source in presets.TINY_TOKENIZER_PRESETS else None
        if engine.load_format not in ("auto", "dummy"):
            raise ConfigError(f"preset {source!r} has no weight files; use load_format='dummy' or 'auto'")
        model = _build(cfg, engine)
        model.init_dummy(_generator(engine))
        fp = _fingerprint(cfg, f"preset:{source}:seed={engine.seed}:{_draw_order(model)}", engine.dtype)
        pack_model(model)
        return LoadedModel(cfg, model, tok, fp, source)
    if not path.is_dir():
        raise ConfigError(f"model {source!r} is neither a preset ({sorted(presets.PRESETS)}) nor a directory")
    cfg = ModelConfig.from_file(path / "config.json")
    tok = Tokenizer.from_dir(path, cfg.eos_token_ids)
    model = _build(cfg, engine)
    if engine.load_format == "dummy":
        model.init_dummy(_generator(engine))
        ident = f"dummy:seed={engine.seed}:{_draw_order(model)}"
    else:
        files = _weight_files(path)
        load_safetensors(model, cfg, files)
        ident = "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    pack_model(model)
    return LoadedModel(cfg, model, tok, _fingerprint(cfg, ident, engine.dtype), str(path.resolve()))


def _generator(engine: EngineConfig) -> torch.Generator:
    g = torch.Generator(device=engine.device)
    g.manual_seed(engine.seed)
    return g


def _build(cfg: ModelConfig, engine: EngineConfig, device=None) -> torch.nn.Module:
    """The model's modules on `device` (the engine's), parameters created in the engine's dtype
    directly: a 35B model in bf16 never exists in fp32 (70 GB, not 140)."""
    ops = get_backend(engine.backend)
    old = torch.get_default_dtype()
    torch.set_default_dtype(engine.torch_dtype)
    try:
        with torch.device(device or engine.device):
            model = model_class(cfg.arch)(cfg, ops)
    finally:
        torch.set_default_dtype(old)
    model = model.to(engine.torch_dtype).eval()
    keep = getattr(model, "fp32_params", ())
    if keep and engine.torch_dtype != torch.float32:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(keep):
                    p.data = p.data.float()
    return model


def from_tensors(cfg: ModelConfig, tensors: dict, engine: EngineConfig, ident: str) -> LoadedModel:
    """A model whose parameters ARE the given checkpoint-named tensors (after the architecture's
    conversion), with no copy where the layouts agree: e.g. a transformers model's state dict on the
    GPU, for a side-by-side benchmark with one set of weights in memory. The projections that read one
    input are then packed into one matrix each (layers/joined.py), their only copy."""
    model = _build(cfg, engine, device="meta")
    tensors = converter(cfg.arch)(dict(tensors), cfg)
    params = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    _check(params, tensors)
    model.load_state_dict({k: tensors[k].to(params[k].dtype) for k in params}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    pack_model(model)       # (the joined projections become views of one new matrix each: their only copy)
    return LoadedModel(cfg, model.eval(), None, _fingerprint(cfg, ident, engine.dtype), ident)


def _draw_order(model: torch.nn.Module) -> str:
    """Dummy weights are drawn from one generator in the parameters' order: a digest of that order (names and
    shapes), so code that reorders or reshapes parameters changes the fingerprint, and a disk tier written by an
    earlier version with other random weights misses instead of serving their states."""
    names = "|".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    return hashlib.sha256(names.encode()).hexdigest()[:16]


def _fingerprint(cfg: ModelConfig, ident: str, dtype: str) -> str:
    blob = json.dumps({"config": dict(cfg.raw), "weights": ident, "dtype": dtype}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise WeightsError(f"shards listed in {index.name} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors weights in {path} (use load_format='dummy' for random weights)")
    return files


def load_safetensors(model: torch.nn.Module, cfg: ModelConfig, files: list[Path]) -> None:
    """Strict load: every parameter must be present with the right shape; unknown tensors are an error."""
    from safetensors import safe_open

    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k)
        except Exception as e:  # truncated or foreign file
            raise WeightsError(f"cannot read {f.name}: {e}") from e
    tensors = converter(cfg.arch)(tensors, cfg)
    params = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    _check(params, tensors)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name].to(p.dtype))


def _check(params: dict, tensors: dict) -> None:
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing:
        raise WeightsError(f"{len(missing)} weights missing from the checkpoint, e.g. {missing[:3]}")
    if unexpected:
        raise WeightsError(f"{len(unexpected)} checkpoint tensors match no parameter, e.g. {unexpected[:3]}")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise WeightsError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(p.shape)}")
