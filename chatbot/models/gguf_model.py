"""A GGUF file as a transformers model without converting it: weights stay in their blocks.

The config and the tokenizer (with its chat template) come from the file's metadata, read by
transformers; both are kept in the user's cache directory (a few MB, keyed by a hash of the
file's metadata), so only the first load of a file pays for parsing a large vocabulary. The
model is built on the meta device, then every matrix becomes a `PackedLinear` /
`PackedEmbedding` over the file's memory map (`chatbot.engine.backends.native.gguf_weights`: no copy but the
q/k rows of llama files, which llama.cpp stores permuted), and only what is small is
materialised: norms, biases and the rotary tables.

Gemma 2 and 3 files (llama.cpp's `gemma2`, `gemma3`) differ in three ways, each undone as
transformers' GGUF reader does: llama.cpp stores every RMSNorm weight as 1 + the weight
transformers' Gemma RMSNorm holds (it computes x * (1 + w)), so 1 is subtracted; the
embedding is scaled by sqrt(hidden size) (`ScaledPackedEmbedding`, with the `embed_scale`
buffer of transformers' module; the tied output matrix is not scaled); each layer has four
norms (before and after attention and MLP; gemma3 also q/k norms). Their q/k rows are not
permuted. Attention windows, soft-capping and per-layer rope come from the config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.architectures import BY_GGUF_ARCH, BY_MODEL_TYPE
from chatbot.engine.backends.native.gguf_weights import GGUFWeights, read_tensor_table
from chatbot.engine.backends.native.packed import (
    PackedEmbedding,
    PackedExperts,
    PackedLinear,
    ScaledPackedEmbedding,
)
from chatbot.models.load_checks import quiet_transformers
from chatbot.models.manifest import publish, read_manifest, staging
from chatbot.progress import waiting

_CACHE_VERSION = 2  # 2: the tokenizer saved as its class rebuilds it, and read whole
_MISSING = object()
_TOKENIZER_SETTINGS = ("model_max_length", "padding_side", "truncation_side", "model_input_names",
                       "clean_up_tokenization_spaces", "add_bos_token", "add_eos_token")  # fmt: skip


class NotPackable(Exception):
    """This file cannot be run from its blocks (an architecture or tensor type not covered);
    the loader dequantizes it instead."""


def metadata_key(path: Path) -> str:
    """A hash of everything in the file before the tensor data (metadata and tensor table):
    what the config and tokenizer are made from. Reads a few MB even of a 5 GB file."""
    _, table = read_tensor_table(path)
    end = min((t.offset for t in table if t.file is None), default=path.stat().st_size)
    h = hashlib.sha256(f"{_CACHE_VERSION}:{path.stat().st_size}:".encode())
    with path.open("rb") as f:
        h.update(f.read(end))
    return h.hexdigest()[:16]


def _builds_backend_only(cls: type) -> bool:
    """A tokenizer class whose only Python behaviour is building its `tokenizers` backend
    in `__init__` (Qwen2Tokenizer): loaded as the plain backend class, it behaves the same
    once its backend is read whole from tokenizer.json (the caller checks that)."""
    from transformers import TokenizersBackend

    inert = {"__module__", "__qualname__", "__doc__", "__annotations__", "__firstlineno__",
             "__static_attributes__", "__init__", "vocab_files_names", "model"}  # fmt: skip
    if not issubclass(cls, TokenizersBackend):
        return False
    return all(
        name in inert or getattr(TokenizersBackend, name, _MISSING) == value
        for name, value in vars(cls).items()
    )


def _fast_tokenizer_ok(folder: Path, tokenizer: Any) -> bool:
    """Whether `tokenizer`, as saved in `folder`, loads the same as the plain backend class
    straight from tokenizer.json: same class behaviour and the same serialized backend.
    Such a class (Qwen2Tokenizer) otherwise re-parses the whole vocabulary and merges in
    Python at each start, to rebuild what the file holds."""
    from transformers import TokenizersBackend

    if type(tokenizer) is TokenizersBackend:
        return True  # what AutoTokenizer loads too, after its AutoConfig (transformers.models)
    if not _builds_backend_only(type(tokenizer)):
        return False
    try:
        fast = TokenizersBackend.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - then the class's own loading is kept
        return False
    return bool(
        fast.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
        and fast.special_tokens_map == tokenizer.special_tokens_map
        and fast.added_tokens_decoder == tokenizer.added_tokens_decoder
        and fast.chat_template == tokenizer.chat_template
        and all(getattr(fast, a, None) == getattr(tokenizer, a, None) for a in _TOKENIZER_SETTINGS)
    )


def _load_cached_tokenizer(folder: Path, manifest: dict[str, Any]) -> Any:
    """The saved tokenizer: our own (`chatbot.gguf.tokenizer`, no transformers) where it is
    the plain backend class with settings ours keeps, else transformers' class."""
    if manifest.get("fast_tokenizer"):  # (AutoTokenizer would import transformers.models)
        from chatbot.gguf.tokenizer import Tokenizer

        own = Tokenizer.from_folder(folder)
        if own is not None:
            return own
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _load_cached_config(folder: Path) -> Any:
    """The saved config: as our `ModelConfig` (its attributes those of config.json) where the
    model is built as our own (`skeleton.own_model_for`), so that transformers is not
    imported for it; else through AutoConfig."""
    from chatbot.engine.backends.native.skeleton import own_model_for
    from chatbot.gguf.config import ModelConfig

    plain = ModelConfig.from_json_file(folder / "config.json")
    if own_model_for(plain):
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def load_config_and_tokenizer(path: Path, cache: Path, notes: list[str]) -> tuple[Any, Any]:
    """The transformers config and tokenizer of a GGUF file, from `cache` when it holds them
    (checked against its manifest), else read from the file and saved there.

    The tokenizer is the one its class makes from the saved files, on the first load as on
    the next: a class may rebuild parts of what it is given (Qwen2Tokenizer sets its own
    pre-tokenizer, which transformers' GGUF reader does not), and the first load must not
    split text differently from the later ones.

    Raises:
        Exception: whatever transformers raises for a file it cannot read.
    """
    manifest = read_manifest(cache)
    if manifest is not None:
        try:
            config, tokenizer = _load_cached_config(cache), _load_cached_tokenizer(cache, manifest)
        except Exception:  # noqa: BLE001 - a damaged file the size check missed: rebuilt below
            notes.append(f"the cached tokenizer of {path.name} in {cache} did not load; rebuilt it")
        else:
            if not manifest.get("added_tokens") or _loads_plain(manifest, tokenizer):
                _record_in_place(cache, manifest, tokenizer)
            return config, tokenizer
    elif cache.exists():
        notes.append(f"the cached tokenizer of {path.name} in {cache} was incomplete or changed; rebuilt it")
    from transformers import AutoConfig, AutoTokenizer

    from chatbot.gguf.gpt_oss import apply_gpt_oss_metadata, reading_gpt_oss

    with quiet_transformers(gguf=True), waiting("reading the file's tokenizer (once)"), reading_gpt_oss():
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        if config.model_type == "gpt_oss":
            apply_gpt_oss_metadata(path, config)
        _, table = read_tensor_table(path)
        if any(t.file for t in table):  # transformers sees the first part's tensors only
            config.tie_word_embeddings = all(t.name != "output.weight" for t in table)
        typed = _tokenizer_type(path, config)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **typed)
    try:
        with waiting("saving the tokenizer for next time (once)"):
            return config, _save_tokenizer(tokenizer, config, path, cache)
    except OSError as exc:
        notes.append(
            f"cannot write the tokenizer cache {cache.parent} ({exc.strerror or exc}); "
            "the next start reads the tokenizer from the file again (set XDG_CACHE_HOME)"
        )
        return config, tokenizer


def _tokenizer_type(path: Path, config: Any) -> dict[str, str]:
    """`tokenizer_type` for AutoTokenizer where the model type names the tokenizer class it
    would pick anyway (and no tokenizer_config.json beside the file could name another):
    without it, AutoTokenizer reads the file's config a second time, with gguf's reader,
    which parses every vocabulary entry (most of the load time of a large vocabulary)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    beside = (path.parent / "tokenizer_config.json").exists()
    if TOKENIZER_MAPPING_NAMES.get(config.model_type) and not beside:
        return {"tokenizer_type": config.model_type}
    return {}


def _save_tokenizer(tokenizer: Any, config: Any, path: Path, cache: Path) -> Any:
    """Save the config and tokenizer into `cache` (atomically, with a manifest); returns the
    tokenizer as its class loads it from there.

    Raises:
        OSError: the cache cannot be written.
    """
    from transformers import AutoTokenizer

    with staging(cache) as tmp:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # What the class makes of the saved files, saved again: tokenizer.json then holds
        # the backend as the class builds it, and can be read whole (`_fast_tokenizer_ok`).
        tokenizer = AutoTokenizer.from_pretrained(str(tmp))
        tokenizer.save_pretrained(tmp)
        record_added_tokens(tmp, tokenizer)
        fast = _fast_tokenizer_ok(tmp, tokenizer)
        publish(tmp, cache, gguf=str(path), fast_tokenizer=fast, added_tokens=True)
    return tokenizer


def record_added_tokens(folder: Path, tokenizer: Any) -> None:
    """Write the tokenizer's added tokens into the saved tokenizer_config.json.

    transformers saves none there, and a config without them makes every later load parse the
    whole tokenizer.json in Python to find them (a 262k-token Gemma vocabulary: 0.55 s and
    ~150 MB at its peak, as much again as the backend's own reading of it). With them the
    load reads the backend file once, in the tokenizers library.
    """
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(index): token.__getstate__() for index, token in sorted(tokenizer.added_tokens_decoder.items())
    }
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _loads_plain(manifest: dict[str, Any], tokenizer: Any) -> bool:
    """Whether a cache not marked `fast_tokenizer` gave AutoTokenizer's plain backend class
    (a cache written when that class was not marked): it can be loaded as such."""
    if manifest.get("fast_tokenizer"):
        return False
    from transformers import TokenizersBackend

    return type(tokenizer) is TokenizersBackend


def _record_in_place(cache: Path, manifest: dict[str, Any], tokenizer: Any) -> None:
    """Give a cache written before `record_added_tokens` existed its list of added tokens,
    and one whose tokenizer is the plain backend class its `fast_tokenizer` mark, republished
    whole; a cache that cannot be written stays as it is (it loads, slower)."""
    import shutil

    fields = {k: v for k, v in manifest.items() if k not in ("files", "added_tokens")}
    if _loads_plain(manifest, tokenizer):
        fields["fast_tokenizer"] = True
    try:
        with staging(cache) as tmp:
            for name in manifest["files"]:
                shutil.copy2(cache / name, tmp / name)
            record_added_tokens(tmp, tokenizer)
            publish(tmp, cache, **fields, added_tokens=True)
    except (OSError, ValueError):
        pass


def _vector(src: GGUFWeights, name: str) -> torch.Tensor:
    """A 1-D F32/F16 tensor (norm weights, biases) as a float32 copy."""
    if name not in src:
        raise NotPackable(f"the file has no {name}")
    t = src.tensors[name]
    kind = t.tensor_type.name
    if kind not in ("F32", "F16"):
        raise NotPackable(f"{name} is stored as {kind}")
    dtype = torch.float32 if kind == "F32" else torch.float16
    return torch.frombuffer(bytearray(t.data.tobytes()), dtype=dtype).to(torch.float32)


def apply_rope_freqs(model: Any, src: GGUFWeights) -> bool:
    """Scale the model's rotary frequencies by the file's ``rope_freqs.weight``, where it has
    one: llama.cpp's converter stores Llama-3.1+ rope scaling (``rope_type: llama3``) as that
    tensor, the factor each frequency is divided by, and transformers' GGUF reader ignores it.
    The model's `inv_freq` is then what transformers computes for the llama3 rope, so the
    forward pass, the fast path and the sink cache's re-rotation all use the scaled rope.

    Returns:
        True if the file had factors (and they were applied).

    Raises:
        NotPackable: factors of the wrong length.
    """
    if "rope_freqs.weight" not in src:
        return False
    factors = _vector(src, "rope_freqs.weight")
    rotary = model.model.rotary_emb
    if factors.numel() != rotary.inv_freq.numel():
        raise NotPackable(
            f"rope_freqs.weight has {factors.numel()} factors for {rotary.inv_freq.numel()} frequencies"
        )
    scaled = (rotary.inv_freq.to(torch.float32) / factors).to(rotary.inv_freq.dtype)
    rotary.inv_freq = scaled
    rotary.original_inv_freq = scaled.clone()
    return True


def apply_rope_scaling(path: Path, config: Any) -> bool:
    """Put a gemma3 file's rope scaling into `config`, as the model's config.json has it:
    Gemma 3 4B-27B divide the positions of their global (full-attention) layers by 8
    (``rope_scaling: linear``), which llama.cpp's converter writes as
    ``gemma3.rope.scaling.type``/``.factor`` and transformers' GGUF reader does not read.
    The sliding layers keep their unscaled rope, as in transformers and llama.cpp.

    Returns:
        True if the file had a scaling (and `config` now has it).

    Raises:
        NotPackable: a kind of scaling other than linear.
    """
    arch, _ = read_tensor_table(path)
    row = BY_GGUF_ARCH.get(arch)
    if row is None or not row.rope_scaling_in_metadata:
        return False
    if not isinstance(getattr(config, "rope_parameters", None), dict):
        return False
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))  # (a vocabulary is skipped, not parsed)
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "none" or factor == 1.0:
        return False
    if kind != "linear":
        raise NotPackable(f"the file's rope scaling is {kind}, which gemma3 models do not use")
    full = dict(config.rope_parameters["full_attention"])
    full.update(rope_type="linear", factor=factor)
    config.rope_parameters["full_attention"] = full
    return True


def apply_expert_metadata(path: Path, config: Any) -> bool:
    """Set a mixture of experts' sizes in `config` from the file's metadata, where
    transformers' GGUF reader does not (it leaves ``moe_intermediate_size`` at its default,
    768, whatever ``<arch>.expert_feed_forward_length`` says). True where the file has experts."""
    from chatbot.gguf.metadata import read_metadata

    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    width = meta.get(f"{arch}.expert_feed_forward_length")
    if not isinstance(width, int):
        return False
    config.moe_intermediate_size = width
    for key, attr in (("expert_count", "num_experts"), ("expert_used_count", "num_experts_per_tok"),
                      ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):  # fmt: skip
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, int):
            setattr(config, attr, value)
    return True


def build_packed_model(path: Path, config: Any) -> Any:
    """A transformers causal LM for `config` whose matrices are the blocks of the GGUF file
    `path`, memory-mapped.

    Raises:
        NotPackable: an architecture, tensor or tensor type this cannot build from blocks.
    """
    src = GGUFWeights(path)
    arch = BY_GGUF_ARCH.get(src.architecture)
    if arch is None or config.model_type not in BY_MODEL_TYPE:
        raise NotPackable(f"no block-format model for {src.architecture} files")
    apply_rope_scaling(path, config)
    if arch.experts:
        apply_expert_metadata(path, config)
    if arch.gpt_oss:
        from chatbot.gguf.gpt_oss import apply_gpt_oss_metadata

        apply_gpt_oss_metadata(path, config)
    with torch.device("meta"):
        model = _skeleton(config)
    inner = model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def matrix(name: str, rope_heads: int | None = None) -> Any:
        try:
            return src.matrix(name, rope_heads)
        except KeyError:
            raise NotPackable(f"the file has no {name}") from None
        except ValueError as exc:
            raise NotPackable(str(exc)) from None

    def linear(old: nn.Module, name: str, rope_heads: int | None = None) -> PackedLinear:
        bias = None
        if getattr(old, "bias", None) is not None:
            bias = _vector(src, name.replace(".weight", ".bias"))
        new = PackedLinear(matrix(name, rope_heads), bias)
        shape = tuple(_weight(old).shape)
        if (new.out_features, new.in_features) != shape:
            raise NotPackable(f"{name} is {new.out_features}x{new.in_features}, the config says {shape}")
        return new

    def norm(module: nn.Module, name: str) -> None:
        w = _vector(src, name)
        if w.shape != _weight(module).shape:
            raise NotPackable(f"{name} has {w.numel()} weights, the config says {_weight(module).numel()}")
        w -= arch.norm_offset  # Gemma's files store 1 + w: its RMSNorm multiplies by (1 + w)
        module.weight = nn.Parameter(w, requires_grad=False)

    if arch.scaled_embedding:
        scale = getattr(inner.embed_tokens, "scalar_embed_scale", None)
        if not isinstance(scale, float):
            raise NotPackable(f"{type(inner.embed_tokens).__name__} has no embedding scale")
        embed: PackedEmbedding = ScaledPackedEmbedding(matrix("token_embd.weight"), scale)
    else:
        embed = PackedEmbedding(matrix("token_embd.weight"))
    if embed.weight.shape != inner.embed_tokens.weight.shape:
        raise NotPackable("token_embd.weight does not have the config's shape")
    inner.embed_tokens = embed
    if getattr(config, "tie_word_embeddings", False) or "output.weight" not in src:
        model.lm_head = PackedLinear(embed.packed)
    else:
        model.lm_head = linear(model.lm_head, "output.weight")
    for i, layer in enumerate(inner.layers):
        b = f"blk.{i}."
        att, mlp = layer.self_attn, layer.mlp
        att.q_proj = linear(att.q_proj, b + "attn_q.weight", heads)
        att.k_proj = linear(att.k_proj, b + "attn_k.weight", kv_heads)
        att.v_proj = linear(att.v_proj, b + "attn_v.weight")
        att.o_proj = linear(att.o_proj, b + "attn_output.weight")
        if arch.gpt_oss:
            _load_gpt_oss(src, layer, b, config, matrix)
        elif arch.experts:
            _load_experts(src, config, arch.shared_expert, mlp, b, matrix, linear)
        else:
            mlp.gate_proj = linear(mlp.gate_proj, b + "ffn_gate.weight")
            mlp.up_proj = linear(mlp.up_proj, b + "ffn_up.weight")
            mlp.down_proj = linear(mlp.down_proj, b + "ffn_down.weight")
        for _, module, tensor in arch.norms:
            norm(getattr(layer, module), f"{b}{tensor}.weight")
        if arch.qk_norm:
            norm(att.q_norm, b + "attn_q_norm.weight")
            norm(att.k_norm, b + "attn_k_norm.weight")
    norm(inner.norm, "output_norm.weight")
    # The rotary tables (inv_freq with any rope scaling; gemma3: one per layer type, as
    # `{layer_type}_inv_freq`) are computed, not stored: build them again off the meta device.
    inner.rotary_emb = type(inner.rotary_emb)(config=config)
    apply_rope_freqs(model, src)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise NotPackable(f"no weights in the file for {left[0]}")
    model.chatbot_gguf = str(path)
    model.chatbot_file_stamp = src.stamp  # the file as mapped: a chat checks it before each turn
    return model.eval()


def _skeleton(config: Any) -> Any:
    """The model's modules for `config`, to be filled with the file's weights: our own
    (`skeleton.CausalLM`) where its architecture allows, else transformers' class."""
    from chatbot.engine.backends.native.skeleton import CausalLM, own_model_for

    if own_model_for(config):
        return CausalLM(config)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _load_experts(
    src: GGUFWeights, config: Any, shared_expert: bool, mlp: Any, b: str, matrix: Any, linear: Any
) -> None:
    """A mixture's router (float32) and its experts' 3-D tensors as stored, into `mlp`
    (transformers' sparse block: its `gate` the router, `experts` the experts); qwen2moe's
    shared expert too. `matrix` / `linear`: `build_packed_model`'s readers of 2-D tensors.

    Raises:
        NotPackable: a tensor missing, or of a shape the metadata does not give.
    """

    def stacked(name: str) -> tuple[Any, int]:
        try:
            return src.stacked(name)
        except KeyError:
            raise NotPackable(f"the file has no {name}") from None
        except ValueError as exc:
            raise NotPackable(str(exc)) from None

    router = kernels.unpack(matrix(b + "ffn_gate_inp.weight"), threads=1)
    want = tuple(_weight(mlp.gate).shape)
    if tuple(router.shape) != want:
        raise NotPackable(f"{b}ffn_gate_inp.weight is {tuple(router.shape)}, the config says {want}")
    mlp.gate.weight = nn.Parameter(router, requires_grad=False)
    (gate, n_gate), (up, n_up), (down, n_down) = (
        stacked(b + f"ffn_{part}_exps.weight") for part in ("gate", "up", "down")
    )
    n, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    parts = [("gate", gate, n_gate, (n * width, hidden)), ("up", up, n_up, (n * width, hidden)),
             ("down", down, n_down, (n * hidden, width))]  # fmt: skip
    for name, p, count, shape in parts:
        if count != n or (p.rows, p.cols) != shape:
            raise NotPackable(
                f"{b}ffn_{name}_exps.weight holds {count} experts of {p.rows // max(count, 1)}x{p.cols}, "
                f"the metadata says {n} of {shape[0] // n}x{shape[1]}"
            )
    mlp.experts = PackedExperts(gate, up, down, n, mlp.experts.act_fn)
    if shared_expert:  # qwen2moe: one more expert for every token, through a gate
        shared = mlp.shared_expert
        shared.gate_proj = linear(shared.gate_proj, b + "ffn_gate_shexp.weight")
        shared.up_proj = linear(shared.up_proj, b + "ffn_up_shexp.weight")
        shared.down_proj = linear(shared.down_proj, b + "ffn_down_shexp.weight")
        w = _vector(src, b + "ffn_gate_inp_shexp.weight")
        if w.shape != (hidden,):
            raise NotPackable(f"{b}ffn_gate_inp_shexp.weight has {w.numel()} weights, not {hidden}")
        mlp.shared_expert_gate.weight = nn.Parameter(w[None], requires_grad=False)


def _load_gpt_oss(src: GGUFWeights, layer: Any, b: str, config: Any, matrix: Any) -> None:
    """A gpt-oss layer's sinks, router and experts (`chatbot.gguf.gpt_oss.load_layer`).

    Raises:
        NotPackable: a tensor missing, or of a shape the metadata does not give.
    """
    from chatbot.gguf.gpt_oss import load_layer

    def stacked(name: str) -> tuple[Any, int]:
        if name not in src:
            raise NotPackable(f"the file has no {name}")
        return src.stacked(name)

    try:
        load_layer(layer, b, config, lambda name: _vector(src, name), matrix, stacked)
    except ValueError as exc:
        raise NotPackable(str(exc)) from None


def _weight(module: nn.Module) -> torch.Tensor:
    """A module's `weight` (a parameter on the meta device while the model is built)."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise NotPackable(f"{type(module).__name__} has no weight tensor")
    return weight
