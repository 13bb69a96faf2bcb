"""The fast decode path on the CPU: one native call per token, on a cache written in place.

transformers spends about half of a one-token forward pass in Python and framework code
(masks, position ids, ~700 small ops for a 30-layer model), and its float32 matrix-vector
products reach well under half of the memory bandwidth. Here, prefill stays with
transformers (its batched float32 matmuls are fast; for a GGUF model loaded as it is, each
matrix is dequantized band by band for them, `chatbot.engine.packed`), and every decoded
token is one call into `kernels.c`, which runs the whole forward pass for one token in one
OpenMP region.

The weights are packed once per model, in one of these formats (`DecodeOptions.weights`):

- ``f32``: float32, the model as loaded (outputs equal the reference up to rounding);
- ``auto``: for a model loaded from a GGUF file, each matrix as the file stores it (Q4_K,
  Q6_K, Q5_0, Q8_0, Q4_1... on the memory-mapped file, `gguf_weights`: the very matrices of
  the model's packed modules, or read from the file for a dequantized model); otherwise per
  matrix the smallest format that holds it exactly: Q4_1/Q8_0, bfloat16 for a bf16
  checkpoint, else float32; the model's own weights, no extra quantization of them;
- ``int8``: Q8_0 everywhere (int8, one scale per 32 weights), lossy;
- ``int4``: Q4_1 for the layers and Q8_0 for the embedding / lm_head (as llama.cpp's Q4_1
  files), lossy on a model that was not quantized that way already.

``f32`` keeps activations in float32 (weights are widened in registers), so it equals the
transformers forward pass up to rounding. ``auto`` hands the inputs of its Q4_1/Q8_0 products
to the kernels as int16 per block of 32 (an error of at most 1/65,534 of the block's largest
value) for exact 16-bit integer dot products: nearly as fast as int8 and 258x finer (derived in
kernels.c, ACT_I16; same greedy tokens as float32 on the default model; perplexity +0.0008%).
``int8`` and ``int4`` quantize each activation vector to int8 per block of 32, as llama.cpp does.

The cache: every layer of a transformers cache (`DynamicCache` or our `SinkCache`) is
replaced by a `BufferLayer`, which keeps keys and values in a preallocated buffer
``[1, kv_heads, capacity, head_dim]`` and writes new tokens in place, gpt-fast style. It is
still a transformers cache layer (prefill, `crop`, `reset` work as before), and it implements
the sink cache's `drop` in place, so `--enable-streaming` (eviction and re-rotation) keeps
working on the fast path.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from chatbot.engine import kernels
from chatbot.engine.gguf_weights import GGUFWeights
from chatbot.engine.packed import PackedEmbedding, PackedLinear, dense_weight
from chatbot.engine.sink_cache import SinkLayer, rotate_keys
from chatbot.errors import ChatbotError

LEVELS = ("off", "f32", "auto", "int8", "int4")
"""Optimization levels: ``off`` is plain transformers; the others pick the weight format."""

_SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
_SUPPORTED_ROPE = {"default", "linear", "llama3", "yarn"}
_versions = itertools.count(1)


class FastPathUnavailable(ChatbotError):
    """The fast decode path cannot run this model here; the engine falls back to transformers."""


# --- the cache ---------------------------------------------------------------------------


class BufferLayer(SinkLayer):
    """A cache layer whose keys and values live in a preallocated buffer, written in place.

    `keys` / `values` are views of the first `length` positions, so code written for
    `DynamicLayer` reads them as before. The buffer grows by doubling when full (a copy,
    amortized); `version` changes whenever it is reallocated, so holders of raw pointers
    know to refresh them.
    """

    MIN_CAPACITY = 256

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None  # [B, H, capacity, D]
        self._v: torch.Tensor | None = None
        self.length = 0
        self.version = 0
        super().__init__()

    # Views of the filled part; assigning a tensor replaces the contents.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("_k", value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("_v", value)

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            setattr(self, name, None)
            if self._k is None and self._v is None:
                self.length = 0
            return
        n = value.shape[-2]
        cap = max(self.capacity, self._grown(n))
        buf = value.new_zeros(*value.shape[:-2], cap, value.shape[-1])
        buf[:, :, :n] = value
        setattr(self, name, buf)
        self.length = n
        self.version = next(_versions)

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[-2]

    def _grown(self, needed: int) -> int:
        cap = max(self.capacity, self.MIN_CAPACITY)
        while cap < needed:
            cap *= 2
        return cap

    def reserve(self, needed: int, like: torch.Tensor | None = None) -> None:
        """Make room for `needed` positions (reallocating, and copying what is held)."""
        if self._k is not None and self.capacity >= needed:
            return
        ref = self._k if self._k is not None else like
        assert ref is not None, "reserve() before the first update needs a tensor to copy the shape from"
        cap = self._grown(needed)
        shape = (*ref.shape[:-2], cap, ref.shape[-1])
        k, v = ref.new_zeros(shape), ref.new_zeros(shape)
        if self._k is not None and self._v is not None:
            k[:, :, : self.length] = self._k[:, :, : self.length]
            v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v
        self.version = next(_versions)

    # -- CacheLayerMixin ------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.reserve(self.length + n, like=key_states)
        assert self._k is not None and self._v is not None
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove from the end")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        # Keep the buffers: the next conversation reuses them.
        self.length = 0

    def drop(self, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Remove positions ``[start, end)`` in place and re-rotate the keys after them."""
        if self._k is None or self._v is None or end <= start:
            return
        n = self.length
        end = min(end, n)
        moved = n - end
        if moved > 0:
            self._k[:, :, start : start + moved] = rotate_keys(self._k[:, :, end:n], cos, sin)
            self._v[:, :, start : start + moved] = self._v[:, :, end:n].clone()
        self.length = n - (end - start)

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated buffers (what the layer holds, filled or not)."""
        if self._k is None or self._v is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


def adopt_layers(cache: Cache) -> bool:
    """Swap every layer of `cache` for a `BufferLayer` holding the same keys and values.

    Returns:
        True if the cache now holds only buffer layers (False: a layer kind we cannot take
        over, e.g. a sliding-window layer; the cache is left unchanged).
    """
    layers: list[Any] = cache.layers
    if all(type(layer) is BufferLayer for layer in layers):
        return True
    # Type identity, not names or isinstance: a subclass (a sliding-window layer is a
    # DynamicLayer subclass) or a same-named class elsewhere stores its tokens differently.
    if not all(type(layer) in (DynamicLayer, SinkLayer, BufferLayer) for layer in layers):
        return False
    for i, layer in enumerate(layers):
        if type(layer) is BufferLayer:
            continue
        new = BufferLayer()
        keys, values = layer.keys, layer.values
        if layer.is_initialized and keys is not None and values is not None and keys.numel() > 0:
            new.lazy_initialization(keys, values)
            new.reserve(keys.shape[-2], like=keys)
            new.update(keys, values)
        layers[i] = new
    return True


# --- threads ---------------------------------------------------------------------------------


class ThreadTuner:
    """Picks the kernels' thread count from measured step times: 1 or `most`.

    Each layer of a decode step ends in a few barriers where every thread waits for the
    others. On a quiet machine two threads nearly halve a step; on a busy one (more runnable
    threads than cores) a descheduled thread stalls its partner at every barrier, and one
    thread is several times faster. So both are timed as decoding goes: mostly the faster
    one runs, and the other is tried again after `explore_every` steps times how much
    slower it was, so that re-checking a bad choice costs at most ~1/`explore_every`.
    """

    def __init__(self, most: int, explore_every: int = 32, smoothing: float = 0.25) -> None:
        self.candidates = sorted({1, max(1, most)})
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}
        self.since_explore = 0
        self.exploring: int | None = None

    def pick(self) -> int:
        for n in self.candidates:
            if n not in self.seconds:
                return n
        best = min(self.candidates, key=lambda n: self.seconds[n])
        if len(self.candidates) == 1:
            return best
        other = next(n for n in self.candidates if n != best)
        self.since_explore += 1
        if self.since_explore >= self.explore_every * self.seconds[other] / self.seconds[best]:
            self.since_explore = 0
            self.exploring = other
            return other
        return best

    def record(self, threads: int, seconds: float) -> None:
        old = self.seconds.get(threads)
        if old is None or threads == self.exploring:
            # A re-check replaces what is known of that count: the old figure is stale.
            self.seconds[threads] = seconds
            self.exploring = None
        else:
            self.seconds[threads] = old + self.smoothing * (seconds - old)


# --- the decoder ---------------------------------------------------------------------------


@dataclass
class DecodeInfo:
    """What the fast path runs with, for banners and benchmarks."""

    level: str
    formats: dict[str, int]  # weight format -> number of matrices
    weight_bytes: int
    threads: int
    activations: str = "float32"  # the inputs of the block-format products
    source: str = "model"  # where the packed weights come from: "model" or "gguf"
    weights: int = 0  # number of weights in the packed matrices

    @property
    def bytes_per_weight(self) -> float:
        return self.weight_bytes / self.weights if self.weights else 0.0

    def label(self) -> str:
        """One line for banners: e.g. ``native kernels (--opt auto): 120 q4_1 + 1 q8_0
        matrices, 92 MB, int16 activations, up to 2 threads``."""
        mats = " + ".join(f"{n} {name}" for name, n in sorted(self.formats.items(), key=lambda kv: -kv[1]))
        return (f"native kernels (--opt {self.level}): {mats} matrices, {self.weight_bytes / 2**20:.0f} MB, "
                f"{self.activations} activations, up to {self.threads} threads")  # fmt: skip


def _is_packed(model: Any) -> bool:
    """Every matrix of the model is a packed module (a GGUF model loaded as it is)."""
    mods = [model.get_input_embeddings(), model.get_output_embeddings()]
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        mods += [att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return all(isinstance(m, (PackedLinear, PackedEmbedding)) for m in mods)


def _tied(model: Any) -> bool:
    """The output matrix is the input embedding (as packed matrices or as tensors)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embed, PackedEmbedding) or isinstance(head, PackedLinear):
        return getattr(embed, "packed", None) is getattr(head, "packed", 0)
    return bool(head.weight.data_ptr() == embed.weight.data_ptr())


def _check_model(model: Any) -> Any:
    """The text config of a model the kernels can run, or FastPathUnavailable."""
    config = (
        model.config.get_text_config(decoder=True)
        if hasattr(model.config, "get_text_config")
        else model.config
    )
    kind = getattr(config, "model_type", "?")
    if kind not in _SUPPORTED_TYPES:
        raise FastPathUnavailable(
            f"no fast decode for {kind} models (only {', '.join(sorted(_SUPPORTED_TYPES))})"
        )
    device = model.get_input_embeddings().weight.device
    if device.type != "cpu":
        raise FastPathUnavailable(f"the fast decode path runs on the CPU; this model is on {device}")
    if getattr(model, "hf_quantizer", None) is not None or getattr(config, "quantization_config", None):
        raise FastPathUnavailable(
            "no fast decode for a quantized model (--quantize or a quantized checkpoint)"
        )
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1 or any(p.device.type == "meta" for p in model.parameters()):
        raise FastPathUnavailable(
            "no fast decode for a model spread over devices or offloaded (--device-map)"
        )
    dtype = model.get_input_embeddings().weight.dtype
    if dtype != torch.float32:
        raise FastPathUnavailable(f"the fast decode path needs a float32 model on the CPU, not {dtype}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise FastPathUnavailable(f"no fast decode for the {config.hidden_act} activation")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type not in _SUPPORTED_ROPE:
        raise FastPathUnavailable(f"no fast decode for {rope_type} rotary embeddings")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise FastPathUnavailable("no fast decode for sliding-window attention")
    return config


class FastDecoder:
    """Decodes one token per native call, on a cache of `BufferLayer`s.

    Args:
        model: a llama, mistral, qwen2 or qwen3 transformers causal LM, float32, on the CPU.
        level: one of `LEVELS` but ``off``: how the weights are packed.
        threads: OpenMP threads for the kernels; None: 1 or torch's thread count
            (`torch.set_num_threads`), whichever measures faster (`ThreadTuner`).
        gguf: the GGUF file the model was loaded from (default: the loader's note of it,
            ``model.chatbot_gguf``); at ``auto`` its matrices are used as stored.
        use_gguf: False packs the model's own weights even where a GGUF file is known.

    Raises:
        FastPathUnavailable: the model or the platform is not supported (the reason says which).
    """

    def __init__(
        self,
        model: Any,
        level: str = "auto",
        threads: int | None = None,
        gguf: str | Path | None = None,
        use_gguf: bool = True,
    ) -> None:
        if level not in LEVELS or level == "off":
            raise ValueError(f"level must be one of {', '.join(LEVELS[1:])}, got {level!r}")
        config = _check_model(model)
        try:
            self.lib = kernels.load_library()
        except kernels.KernelsUnavailable as exc:
            raise FastPathUnavailable(str(exc)) from None
        self.model = model
        self.level = level
        self.threads = threads
        self.tuner: ThreadTuner | None = None
        inner = model.model
        n_layers = config.num_hidden_layers
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.vocab = model.get_output_embeddings().weight.shape[0]

        def bias(*mods: Any) -> torch.Tensor | None:
            if all(getattr(m, "bias", None) is None for m in mods):
                return None
            return torch.cat(
                [
                    m.bias.detach().float() if m.bias is not None else torch.zeros(m.weight.shape[0])
                    for m in mods
                ]
            ).contiguous()

        self.source = "model"
        gguf = gguf if gguf is not None else getattr(model, "chatbot_gguf", None)
        with torch.no_grad():
            from_file = use_gguf and level == "auto"
            packed = self._from_packed(model) if from_file else None
            if packed is None and from_file and gguf and not _is_packed(model):
                packed = self._from_gguf(model, gguf, heads, kv_heads)
            if packed is not None:
                self.source = "gguf"
            else:
                packed = self._from_model(model, level)
            self.embed, self.lm_head, self.wqkv, self.wo, self.wgu, self.wdown = packed
            self.attn_norm, self.ffn_norm, self.biases = [], [], []
            self.q_norm: list[torch.Tensor] = []
            self.k_norm: list[torch.Tensor] = []
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                self.biases.append((
                    bias(att.q_proj, att.k_proj, att.v_proj), bias(att.o_proj),
                    bias(mlp.gate_proj, mlp.up_proj), bias(mlp.down_proj),
                ))  # fmt: skip
                self.attn_norm.append(layer.input_layernorm.weight.detach().float().contiguous())
                self.ffn_norm.append(layer.post_attention_layernorm.weight.detach().float().contiguous())
                if getattr(att, "q_norm", None) is not None:  # qwen3
                    self.q_norm.append(att.q_norm.weight.detach().float().contiguous())
                    self.k_norm.append(att.k_norm.weight.detach().float().contiguous())
            self.final_norm = inner.norm.weight.detach().float().contiguous()
            rotary = inner.rotary_emb
            self.inv_freq = rotary.inv_freq.detach().float()
            self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.eps = float(getattr(inner.layers[0].input_layernorm, "variance_epsilon", config.rms_norm_eps))
        self.attn_scale = float(getattr(inner.layers[0].self_attn, "scaling", head_dim**-0.5))
        self.dims = (n_layers, config.hidden_size, heads, kv_heads, head_dim, config.intermediate_size)

        self._mats = {
            name: (kernels.Group * n_layers)(
                *[kernels.group_struct(parts, self.biases[i][slot]) for i, parts in enumerate(groups)]
            )
            for slot, (name, groups) in enumerate(
                [("wqkv", self.wqkv), ("wo", self.wo), ("wgu", self.wgu), ("wdown", self.wdown)]
            )
        }
        self._embed_struct = self.embed.as_struct()
        self._head_struct = self.lm_head.as_struct()
        ptrs = ctypes.c_void_p * n_layers
        self._attn_norm = ptrs(*[t.data_ptr() for t in self.attn_norm])
        self._ffn_norm = ptrs(*[t.data_ptr() for t in self.ffn_norm])
        self._q_norm = ptrs(*[t.data_ptr() for t in self.q_norm]) if self.q_norm else None
        self._k_norm = ptrs(*[t.data_ptr() for t in self.k_norm]) if self.k_norm else None
        self._kptrs = ptrs()
        self._vptrs = ptrs()
        self._cache_key: tuple[int, ...] = ()
        self._rope_cos = self._rope_sin = torch.empty(0)
        self._scratch = torch.empty(0)
        self.struct = kernels.ModelStruct(
            n_layers=n_layers, dim=config.hidden_size, n_heads=heads, n_kv_heads=kv_heads,
            head_dim=head_dim, ffn_dim=config.intermediate_size, vocab=self.vocab, n_threads=1,
            eps=self.eps, attn_scale=self.attn_scale, rope_len=0, cap=0,
            embed=ctypes.pointer(self._embed_struct), lm_head=ctypes.pointer(self._head_struct),
            final_norm=self.final_norm.data_ptr(), attn_norm=self._attn_norm, ffn_norm=self._ffn_norm,
            wqkv=self._mats["wqkv"], wo=self._mats["wo"], wgu=self._mats["wgu"], wdown=self._mats["wdown"],
            kcache=self._kptrs, vcache=self._vptrs, act=self._activation_form(),
            q_norm=self._q_norm, k_norm=self._k_norm,
        )  # fmt: skip
        # Grown on demand: a 128k-context model need not hold 128k rows of cos/sin.
        self._ensure_rope(min(4096, int(getattr(config, "max_position_embeddings", 2048) or 2048)))

    # -- set-up ---------------------------------------------------------------------------

    def _activation_form(self) -> int:
        """How the inputs of the block-format products are held: int8 per block for the lossy
        levels (llama.cpp's way), int16 per block for `auto` (2^-16 of the block's largest
        value: the integer dot products of the block formats at 1/258 of int8's error, see
        kernels.c; `kernels.INT16_PRODUCTS` lists the formats that have them)."""
        if self.level in ("int8", "int4"):
            return kernels.ACT_Q8
        mats = [self.embed, self.lm_head, *self._parts()]
        if any(p.fmt in kernels.INT16_PRODUCTS for p in mats):
            return kernels.ACT_I16
        return kernels.ACT_F32

    @staticmethod
    def _packer(level: str) -> Any:
        """pack(role, *row_blocks) -> one packed matrix in the level's format."""

        def pack(role: str, *parts: torch.Tensor) -> kernels.PackedMatrix:
            parts = tuple(w.detach() for w in parts)
            if level == "auto":
                return kernels.pack_lossless(*parts)
            if level == "f32" or any(w.shape[1] % kernels.QK for w in parts):
                return kernels.stack([kernels.pack_f32(w) for w in parts])
            fmt = kernels.FMT_Q8_0 if level == "int8" or role == "embed" else kernels.FMT_Q4_1
            return kernels.quantize_rows(list(parts), fmt)[0]

        return pack

    @classmethod
    def _from_model(cls, model: Any, level: str) -> tuple[Any, ...]:
        """(embed, lm_head, then per layer the row blocks of qkv, o, gate/up, down), packed
        from the model's float weights in the level's format."""
        pack = cls._packer(level)
        w = dense_weight  # a packed module's weights are dequantized, one matrix at a time
        embed = pack("embed", w(model.get_input_embeddings()))
        lm_head = embed if _tied(model) else pack("embed", w(model.get_output_embeddings()))
        wqkv, wo, wgu, wdown = [], [], [], []
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            wqkv.append([pack("layer", w(att.q_proj), w(att.k_proj), w(att.v_proj))])
            wo.append([pack("layer", w(att.o_proj))])
            wgu.append([pack("layer", w(mlp.gate_proj), w(mlp.up_proj))])
            wdown.append([pack("layer", w(mlp.down_proj))])
        return embed, lm_head, wqkv, wo, wgu, wdown

    @staticmethod
    def _from_packed(model: Any) -> tuple[Any, ...] | None:
        """The same matrices as `_from_model`, shared with a model whose modules hold them
        packed already (`chatbot.models.gguf_model`: a GGUF file's blocks); None otherwise."""
        if not _is_packed(model):
            return None
        embed = model.get_input_embeddings().packed
        lm_head = model.get_output_embeddings().packed
        wqkv, wo, wgu, wdown = [], [], [], []
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            wqkv.append([att.q_proj.packed, att.k_proj.packed, att.v_proj.packed])
            wo.append([att.o_proj.packed])
            wgu.append([mlp.gate_proj.packed, mlp.up_proj.packed])
            wdown.append([mlp.down_proj.packed])
        return embed, lm_head, wqkv, wo, wgu, wdown

    @staticmethod
    def _from_gguf(model: Any, path: str | Path, heads: int, kv_heads: int) -> tuple[Any, ...] | None:
        """The same matrices as `_from_model`, taken from the GGUF file the model was loaded
        from, in their stored formats (no copy). None where the file does not hold the
        model's weights as expected (then the model's own weights are packed instead)."""
        try:
            src = GGUFWeights(path)
            embed = src.matrix("token_embd.weight")
            lm_head = embed if _tied(model) else src.matrix("output.weight")
            wqkv, wo, wgu, wdown = [], [], [], []
            for i in range(len(model.model.layers)):
                b = f"blk.{i}."
                wqkv.append([
                    src.matrix(b + "attn_q.weight", heads), src.matrix(b + "attn_k.weight", kv_heads),
                    src.matrix(b + "attn_v.weight"),
                ])  # fmt: skip
                wo.append([src.matrix(b + "attn_output.weight")])
                wgu.append([src.matrix(b + "ffn_gate.weight"), src.matrix(b + "ffn_up.weight")])
                wdown.append([src.matrix(b + "ffn_down.weight")])
        except (KeyError, ValueError, OSError):
            return None
        # Same shapes as the model's, and the same weights where it is cheap to look: the
        # first layer's q and k (which would show a wrong row order) and the embedding's
        # first rows. Float32 rounding of the dequantization may differ in the last bit.
        layer0 = model.model.layers[0]
        pairs = [
            (embed, model.get_input_embeddings().weight),
            (lm_head, model.get_output_embeddings().weight),
        ]
        for i, layer in enumerate(model.model.layers):
            att, mlp = layer.self_attn, layer.mlp
            mods = [(wqkv[i], [att.q_proj, att.k_proj, att.v_proj]), (wo[i], [att.o_proj]),
                    (wgu[i], [mlp.gate_proj, mlp.up_proj]), (wdown[i], [mlp.down_proj])]  # fmt: skip
            for parts, ms in mods:
                pairs += [(p, m.weight) for p, m in zip(parts, ms, strict=True)]
        if any((p.rows, p.cols) != tuple(w.shape) for p, w in pairs):
            return None
        checks = [(wqkv[0][0], layer0.self_attn.q_proj.weight), (wqkv[0][1], layer0.self_attn.k_proj.weight)]
        for p, w in checks:
            if not torch.allclose(kernels.unpack(p, threads=1), w.detach().float(), rtol=1e-5, atol=1e-7):
                return None
        return embed, lm_head, wqkv, wo, wgu, wdown

    def _ensure_rope(self, length: int) -> None:
        """cos/sin tables for positions [0, length), computed as transformers does."""
        if length <= self.struct.rope_len:
            return
        length = max(length, 2 * self.struct.rope_len)
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self._rope_cos = (freqs.cos() * self.rope_scaling).contiguous()
        self._rope_sin = (freqs.sin() * self.rope_scaling).contiguous()
        self.struct.rope_cos = self._rope_cos.data_ptr()
        self.struct.rope_sin = self._rope_sin.data_ptr()
        self.struct.rope_len = length

    def _parts(self) -> list[kernels.PackedMatrix]:
        """Every packed row block of the layers."""
        return [p for groups in (self.wqkv, self.wo, self.wgu, self.wdown) for g in groups for p in g]

    def info(self) -> DecodeInfo:
        mats = [self.embed, *self._parts()]
        if self.lm_head is not self.embed:
            mats.append(self.lm_head)
        formats: dict[str, int] = {}
        for p in mats:
            formats[p.format_name] = formats.get(p.format_name, 0) + 1
        threads = self.threads or torch.get_num_threads()
        acts = {kernels.ACT_F32: "float32", kernels.ACT_Q8: "int8", kernels.ACT_I16: "int16"}[self.struct.act]
        return DecodeInfo(
            self.level, formats, sum(p.nbytes for p in mats), threads, acts, self.source,
            sum(p.rows * p.cols for p in mats),
        )  # fmt: skip

    def _threads(self) -> int:
        if self.threads:
            return self.threads
        most = torch.get_num_threads()
        if self.tuner is None or self.tuner.candidates[-1] != most:
            self.tuner = ThreadTuner(most)
        return self.tuner.pick()

    # -- caches ---------------------------------------------------------------------------

    def new_cache(self) -> Cache:
        """An empty growing cache made of `BufferLayer`s."""
        cache = DynamicCache(config=self.model.config)
        adopt_layers(cache)
        return cache

    def prepare(self, cache: Cache) -> None:
        """Take over `cache`'s layers (a no-op once done).

        Raises:
            FastPathUnavailable: a layer kind the kernels cannot read.
        """
        if not adopt_layers(cache):
            raise FastPathUnavailable("the fast decode path cannot take over this cache's layers")

    def _bind_cache(self, layers: Sequence[BufferLayer], needed: int) -> None:
        """Give every layer room for `needed` positions in buffers of one common capacity,
        and point the kernels at them."""
        cap = max(layer.capacity for layer in layers)
        if cap < needed or any(layer.capacity != cap for layer in layers):
            # Capacities are all MIN_CAPACITY * 2**k, so growing each to `target` evens them.
            first = next(layer for layer in layers if layer._k is not None)
            target = first._grown(max(needed, cap))
            for layer in layers:
                layer.reserve(target, like=first._k)
                layer.is_initialized = True
        key = tuple(layer.version for layer in layers)
        if key == self._cache_key:
            return
        for i, layer in enumerate(layers):
            assert layer._k is not None and layer._v is not None
            self._kptrs[i] = layer._k.data_ptr()
            self._vptrs[i] = layer._v.data_ptr()
        self.struct.cap = layers[0].capacity
        self._cache_key = key

    def _reserve_scratch(self, threads: int) -> None:
        """Scratch space for the current cache capacity and `threads` threads."""
        floats = int(self.lib.chatbot_scratch_floats(ctypes.byref(self.struct), threads))
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
            self.struct.scratch = self._scratch.data_ptr()

    # -- decoding -------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, cache: Cache, token: int) -> torch.Tensor:
        """Feed one token at the end of `cache`; return the logits after it.

        Args:
            cache: a cache whose layers are `BufferLayer`s (see `prepare`), holding at
                least one token already (prefill goes through transformers).
            token: the token id.

        Returns:
            float32 logits ``[vocab]``.
        """
        if type(cache.layers[0]) is not BufferLayer:
            self.prepare(cache)
        layers = cast(list[BufferLayer], cache.layers)
        pos = layers[0].length
        if layers[0]._k is None:
            raise ValueError("decode needs a prefilled cache")
        if any(layer.length != pos for layer in layers):
            raise ValueError("cache layers hold different numbers of tokens; crop it first")
        self._bind_cache(layers, pos + 1)
        self._ensure_rope(pos + 1)
        threads = self.struct.n_threads = self._threads()
        self._reserve_scratch(threads)
        logits = torch.empty(self.vocab, dtype=torch.float32)
        start = time.perf_counter()
        if self.lib.chatbot_decode(ctypes.byref(self.struct), int(token), pos, logits.data_ptr()) != 0:
            raise ValueError(f"token {token} or position {pos} out of range for the fast decoder")
        if self.tuner is not None and not self.threads:
            self.tuner.record(threads, time.perf_counter() - start)
        for layer in layers:
            layer.length = pos + 1
        return logits


def make_decoder(
    model: Any, level: str, threads: int | None = None, use_gguf: bool = True
) -> tuple[FastDecoder | None, str | None]:
    """The decoder for `level`, or None with the reason when it cannot run (``off`` gives
    None and no reason). `use_gguf`: at ``auto``, take the matrices from the GGUF file the
    model was loaded from, where there is one (False: pack the float32 model's weights).

    Raises:
        ValueError: an unknown level.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown optimization level {level!r}; choose from {', '.join(LEVELS)}")
    if level == "off":
        return None, None
    try:
        return FastDecoder(model, level, threads, use_gguf=use_gguf), None
    except FastPathUnavailable as exc:
        return None, f"fast decode off: {exc}"
