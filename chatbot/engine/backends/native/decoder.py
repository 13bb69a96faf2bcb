"""The fast decode path on the CPU: one native call per token, on a cache written in place.

Prefill stays with transformers' forward pass (for a GGUF model loaded as it is, its
products run on the blocks: `chatbot.engine.backends.native.packed`, batched int16 products under `auto`),
and every decoded token is one call into `kernels.c`, which runs the whole forward pass for
one token in one OpenMP region. Why: transformers runs a one-token forward pass as hundreds
of small ops in Python and framework code (masks, position ids) around float32
matrix-vector products (docs/benchmarks.md has figures).

The weights are packed once per model, in one of these formats (`DecodeOptions.weights`):

- ``f32``: float32, the model as loaded (outputs equal the reference up to rounding);
- ``exact``: for a model loaded from a GGUF file, each matrix as the file stores it (Q4_K,
  Q6_K, Q5_0, Q8_0, Q4_1... on the memory-mapped file, `gguf_weights`: the very matrices of
  the model's packed modules, or read from the file for a dequantized model); otherwise per
  matrix the smallest format that holds it exactly: Q4_1/Q8_0, bfloat16 for a bf16
  checkpoint, else float32; the model's own weights, no extra quantization of them; int16
  inputs into every product;
- ``fast``: the matrices of ``exact``, with the inputs rounded to int8 as llama.cpp rounds
  them (per 32 values, per 256 into the K-quants): lossy, and the K-quant tile products take
  half the byte products (kernels.c, `dot_q4_k_x8_`);
- ``auto`` (the default): the matrices of ``exact``; int8 inputs into the products where
  this build's int8 product is faster, int16 into the others (`choose_inputs`: never
  coarser than llama.cpp's inputs on the same file; measured at or below llama.cpp's
  distance from float32);
- ``int8``: Q8_0 everywhere (int8, one scale per 32 weights), lossy;
- ``int4``: Q4_1 for the layers and Q8_0 for the embedding / lm_head (as llama.cpp's Q4_1
  files), lossy on a model that was not quantized that way already.

``f32`` keeps activations in float32 (weights are widened in registers), so it equals the
transformers forward pass up to rounding. ``exact`` hands the inputs of its Q4_1/Q8_0 products
to the kernels as int16 per block of 32 (an error of at most 1/65,534 of the block's largest
value) for exact 16-bit integer dot products, 258x finer than int8 (derived in kernels.c,
ACT_I16; docs/benchmarks.md compares the levels' speed, tokens and perplexity).
``int8`` and ``int4`` quantize each activation vector to int8 per block of 32, as llama.cpp does.

The cache: every layer of a transformers cache is replaced by a `BufferLayer`
(`chatbot.engine.cache.buffers`), which writes new tokens in place in a preallocated buffer;
`--enable-streaming` (eviction and re-rotation) keeps working on the fast path. The weights
are packed by `chatbot.engine.backends.native.weights`.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from chatbot.config import FILE_LEVELS, OPT_LEVELS
from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.heap import hold_freed_memory
from chatbot.engine.backends.native.inputs import choose_inputs  # also re-exported
from chatbot.engine.backends.native.model import (
    FastPathUnavailable,
    NativeModel,
    check_model,
    native_struct,
    read_model,
)
from chatbot.engine.backends.native.packed import with_activations
from chatbot.engine.backends.native.threads import ThreadTuner, cap_threads
from chatbot.engine.backends.native.weights import is_packed
from chatbot.engine.cache.buffers import BufferLayer, adopt_layers  # also re-exported (tests)
from chatbot.engine.cache.layers import KVCache, new_cache

__all__ = [
    "LEVELS",
    "BufferLayer",
    "DecodeInfo",
    "FastDecoder",
    "FastPathUnavailable",
    "ThreadTuner",
    "adopt_layers",
    "make_decoder",
]

LEVELS = tuple(level for level in OPT_LEVELS if level != "compile")
"""The levels the native kernels run (``off``: none)."""
"""Optimization levels: ``off`` is plain transformers; the others pick the weight format."""


# --- the form of the products' inputs -----------------------------------------------------

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
    own_pool: bool = False  # threads on kernels.c's own pool (built without OpenMP)
    tiled: int = 0  # matrices in 8-row tiles (kernels.tile_rows)
    inputs_why: str = ""  # why the inputs are held so (`Inputs.why`)
    experts: tuple[int, int, int] = (0, 0, 0)  # a mixture's experts, per token, one expert's width
    read_bytes: int = 0  # the weights one token reads (a mixture's chosen experts only)

    @property
    def bytes_per_weight(self) -> float:
        return self.weight_bytes / self.weights if self.weights else 0.0

    def label(self) -> str:
        """One line for banners: e.g. ``native kernels (--opt exact): 120 q4_1 + 1 q8_0
        matrices, 92 MB, int16 activations (int16 inputs, 2^-16 steps), up to 2 threads``,
        and ``(own pool)`` after the threads where the kernels were built without OpenMP;
        ``(N in 8-row tiles)`` after the matrices where some are."""
        mats = " + ".join(f"{n} {name}" for name, n in sorted(self.formats.items(), key=lambda kv: -kv[1]))
        mats += f" matrices ({self.tiled} in 8-row tiles)" if self.tiled else " matrices"
        threads = f"up to {self.threads} threads" if self.threads > 1 else "1 thread"
        pool = " (own pool)" if self.own_pool else ""
        why = f" ({self.inputs_why})" if self.inputs_why else ""
        moe = ""
        if self.experts[0]:
            n, used, width = self.experts
            moe = (f"; {n} experts of {width}, {used} per token: "
                   f"{self.read_bytes / 2**20:,.0f} MB read per token")  # fmt: skip
        return (f"native kernels (--opt {self.level}): {mats}, {self.weight_bytes / 2**20:.0f} MB, "
                f"{self.activations} activations{why}, {threads}{pool}{moe}")  # fmt: skip


class FastDecoder:
    """Decodes one token per native call, on a cache of `BufferLayer`s.

    Args:
        model: a llama, mistral, qwen2, qwen3, gemma2 or gemma3 (text) transformers causal LM,
            float32, on the CPU.
        level: one of `LEVELS` but ``off``: how the weights are packed.
        threads: threads for the kernels; None: 1 or torch's thread count
            (`torch.set_num_threads`), whichever measures faster (`ThreadTuner`).
        gguf: the GGUF file the model was loaded from (default: the loader's note of it,
            ``model.chatbot_gguf``); at ``auto``, ``exact`` and ``fast`` its matrices are used as stored.
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
        config, arch = check_model(model)
        try:
            self.lib = kernels.load_library()
        except kernels.KernelsUnavailable as exc:
            raise FastPathUnavailable(str(exc)) from None
        self.model = model
        self.level = level
        self.threads = threads
        self.tuner: ThreadTuner | None = None
        gguf = gguf if gguf is not None else getattr(model, "chatbot_gguf", None)
        self.native: NativeModel = read_model(model, config, arch, level, gguf, use_gguf)
        native = self.native
        self.embed, self.lm_head = native.embed, native.lm_head
        self.wqkv, self.wo, self.wgu, self.wdown = native.wqkv, native.wo, native.wgu, native.wdown
        self.source, self.vocab, self.dims = native.source, native.vocab, native.dims
        self.inputs = choose_inputs(level, native, self.lib)
        """How the inputs of the products are held, where and why (`choose_inputs`)."""
        self._c = native_struct(native, self.inputs.act)
        self.struct = self._c.struct
        self.struct.act_i16_sites = self.inputs.int16_sites
        self._kptrs, self._vptrs = self._c.kptrs, self._c.vptrs
        self._ropes = native.ropes
        self._rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._old_rope: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._rope_lock = threading.Lock()
        self._cache_key: tuple[int, ...] = ()
        self._scratch = torch.empty(0)
        self._local = threading.local()  # the batched calls' scratch: one per thread (they may run at once)
        self._serial = threading.RLock()  # `decode`'s struct and scratch: one call at a time
        self.experts = bool(native.routers)
        """A mixture of experts: the batched kernel has no experts, so its rows run one by one."""
        # Grown on demand: a 128k-context model need not hold 128k rows of cos/sin.
        self._ensure_rope(min(4096, int(getattr(config, "max_position_embeddings", 2048) or 2048)))
        hold_freed_memory()  # prefill's activations reuse the heap's pages, layer after layer
        self.prefill_model = with_activations(model, self.prefill_form)
        """The model as prefill runs it through transformers: `model` itself, or for a GGUF
        model at ``auto``/``exact``/``fast`` a view of it whose packed linears take their
        inputs as the decode step does (`prefill_form`; `packed.with_activations`: every
        weight shared, `model` unchanged)."""

    def prefill_form(self, p: kernels.PackedMatrix) -> int:
        """The form of the inputs of packed matrix `p` in prefill (`kernels.ACT_*`), as the
        decode step takes them: for a GGUF model at ``auto``/``exact``/``fast`` whose matrices
        have integer products, int8 (llama.cpp's Q8_K) where the step takes int8 and `p` is
        in 8-row tiles (the batched int8 tile product), int16 elsewhere (the batched int16
        product: at an int8 site, finer than the step's inputs, as no batched int8 product
        of `p`'s format exists); float32 otherwise. A mixture's Q4_K/Q6_K experts take int8
        wherever the step takes int8 anywhere (`kernels.experts`' multi-input int8 product,
        llama.cpp's inputs: faster than the int16 one), int16 at ``exact``."""
        if not (is_packed(self.model) and self.level in FILE_LEVELS and self._has_int16_products()):
            return kernels.ACT_F32
        if p.x8 and id(p) in self._int8_ids or p.data.data_ptr() in self._expert_ptrs:
            return kernels.ACT_Q8
        return kernels.ACT_I16

    @functools.cached_property
    def _expert_ptrs(self) -> frozenset[int]:
        """A mixture's expert matrices (their bytes' addresses) where their prefill takes int8."""
        if not self.experts or self.inputs.act != kernels.ACT_Q8:
            return frozenset()
        mats = [p for site in (self.native.wgu, self.native.wdown) for g in site for p in g]
        return frozenset(p.data.data_ptr() for p in mats if p.fmt in (kernels.FMT_Q4_K, kernels.FMT_Q6_K))

    @functools.cached_property
    def _int8_ids(self) -> frozenset[int]:
        """The matrices whose decode products take int8 inputs (`choose_inputs`), by `id`."""
        if self.inputs.act != kernels.ACT_Q8:
            return frozenset()
        return frozenset(
            id(p)
            for i, site in enumerate(self.native.sites())
            if not self.inputs.int16_sites >> i & 1
            for group in site
            for p in group
        )

    # -- set-up ---------------------------------------------------------------------------

    def _has_int16_products(self) -> bool:
        mats = [self.native.embed, self.native.lm_head, *self.native.layer_matrices()]
        return any(p.fmt in kernels.INT16_PRODUCTS for p in mats)

    def _ensure_rope(self, length: int) -> None:
        """cos/sin tables for positions [0, length), computed as transformers does. Safe
        beside a call in another thread (a batched step beside a prefill): the tables grow
        under a lock, the new ones are in place before `rope_len` says so, and the old ones
        are kept (that call may still read them)."""
        if length <= self.struct.rope_len:
            return
        with self._rope_lock:
            if length <= self.struct.rope_len:
                return
            length = max(length, 2 * self.struct.rope_len)
            positions = torch.arange(length, dtype=torch.float32)[:, None]
            tables = []
            for inv_freq, scaling in self._ropes:
                freqs = positions * inv_freq[None, :]
                cos, sin = (freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous()
                tables.append((cos, sin))
            if getattr(self, "_rope_tables", None):
                self._old_rope.append(self._rope_tables)
            self._rope_tables = tables
            cos, sin = tables[0]
            cos2, sin2 = tables[-1]
            self.struct.rope_cos, self.struct.rope_sin = cos.data_ptr(), sin.data_ptr()
            self.struct.rope_cos2, self.struct.rope_sin2 = cos2.data_ptr(), sin2.data_ptr()
            self.struct.rope_len = length

    def _parts(self) -> list[kernels.PackedMatrix]:
        """Every packed row block of the layers."""
        return self.native.layer_matrices()

    def info(self) -> DecodeInfo:
        mats = [self.embed, *self._parts()]
        if self.lm_head is not self.embed:
            mats.append(self.lm_head)
        formats: dict[str, int] = {}
        for p in mats:
            formats[p.format_name] = formats.get(p.format_name, 0) + 1
        threads = self.threads or torch.get_num_threads()
        total = sum(p.nbytes for p in mats)
        experts, read = (0, 0, 0), total
        if self.experts:
            n, used = self.native.routers[0].rows, self.native.experts_used
            experts = (n, used, self.native.expert_dim)
            stacked = sum(p.nbytes for layer in (*self.wgu, *self.wdown) for p in layer)
            routers = sum(r.nbytes for r in self.native.routers)
            read = total - stacked + stacked * used // n + routers
        # a token reads one row of the embedding, not the table (where it is not the head too)
        if self.lm_head is not self.embed:
            read -= self.embed.nbytes
        return DecodeInfo(
            self.level, formats, total, threads, self.inputs.label, self.source,
            sum(p.rows * p.cols for p in mats), not kernels.uses_openmp(self.lib), sum(p.x8 for p in mats),
            self.inputs.why, experts, read,
        )  # fmt: skip

    def _threads(self) -> int:
        if self.threads:
            return self.threads
        most = torch.get_num_threads()
        if self.tuner is None or self.tuner.candidates[-1] != most:
            self.tuner = ThreadTuner(most)
        return self.tuner.pick()

    # -- caches ---------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        """An empty growing cache made of `BufferLayer`s."""
        cache = new_cache(self.model.config)
        adopt_layers(cache)
        return cache

    def prepare(self, cache: KVCache) -> None:
        """Take over `cache`'s layers (a no-op once done).

        Raises:
            FastPathUnavailable: a layer kind the kernels cannot read.
        """
        if not adopt_layers(cache):
            raise FastPathUnavailable("the fast decode path cannot take over this cache's layers")

    def reserve(self, cache: KVCache, needed: int, limit: int | None = None) -> None:
        """Give every layer of `cache` room for `needed` positions now, before a forward
        pass, in buffers of one capacity: a multiple of 64 positions, and when the cache
        holds tokens already, at least 1.5x what it had (but no more than `limit`, the most
        the cache will ever hold, unless `needed` is more).

        Reserved before the pass, the buffers are not grown (by doubling, a copy each
        time) between that pass's short-lived activations, where the allocator could not
        hand the old ones back, and one token past a power of two does not double them.
        """
        self.prepare(cache)
        self._reserve_layers(cast(list[BufferLayer], cache.layers), needed, limit)

    def _reserve_layers(self, layers: Sequence[BufferLayer], needed: int, limit: int | None = None) -> None:
        cap = min(layer.capacity for layer in layers)
        if cap >= needed and all(layer.capacity == cap for layer in layers):
            return
        held = any(layer.length for layer in layers)
        target = max(needed, cap * 3 // 2) if held else needed
        target = -(-max(target, *(layer.capacity for layer in layers)) // 64) * 64
        if limit is not None:
            target = max(needed, min(target, limit))
        _, _, _, kv_heads, head_dim, _ = self.dims
        like = next((layer.key_buffer for layer in layers if layer.key_buffer is not None), None)
        if like is None:
            like = torch.empty(1, kv_heads, 0, head_dim, dtype=torch.float32)
        for layer in layers:
            layer.reserve(target, like=like, exact=True)

    def _bind_cache(self, layers: Sequence[BufferLayer], needed: int) -> None:
        """Give every layer room for `needed` positions in buffers of one common capacity
        (as `reserve`), and point the kernels at them."""
        self._reserve_layers(layers, needed)
        key = tuple(layer.version for layer in layers)
        if key == self._cache_key:
            return
        for i, layer in enumerate(layers):
            keys, values = layer.key_buffer, layer.value_buffer
            assert keys is not None and values is not None
            self._kptrs[i] = keys.data_ptr()
            self._vptrs[i] = values.data_ptr()
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
    def decode(self, cache: KVCache, token: int, threads: int | None = None) -> torch.Tensor:
        """Feed one token at the end of `cache`; return the logits after it. Not for two
        threads at once (the decoder's own cache pointers and scratch serve every call):
        `prefill_rows` and `decode_batch` of more than one cache are.

        Args:
            cache: a cache whose layers are `BufferLayer`s (see `prepare`), holding at
                least one token already (prefill goes through transformers).
            token: the token id.
            threads: threads for this step (default: the decoder's, or the tuner's choice).

        Returns:
            float32 logits ``[vocab]``.
        """
        with self._serial:
            return self._decode(cache, token, threads)

    def _decode(self, cache: KVCache, token: int, threads: int | None) -> torch.Tensor:
        layers, pos = self._decode_layers(cache)
        self._bind_cache(layers, pos + 1)
        self._ensure_rope(pos + 1)
        tuned = threads is None
        threads = self.struct.n_threads = threads or self._threads()
        self._reserve_scratch(threads)
        logits = torch.empty(self.vocab, dtype=torch.float32)
        start = time.perf_counter()
        if self.lib.chatbot_decode(ctypes.byref(self.struct), int(token), pos, logits.data_ptr()) != 0:
            raise ValueError(f"token {token} or position {pos} out of range for the fast decoder")
        if self.tuner is not None and not self.threads and tuned:
            self.tuner.record(threads, time.perf_counter() - start)
        for layer in layers:
            layer.length = pos + 1
        return logits

    @property
    def max_batch(self) -> int:
        """The most conversations `decode_batch` steps in one call."""
        return int(self.lib.chatbot_max_batch())

    @torch.inference_mode()
    def _decode_layers(self, cache: KVCache) -> tuple[list[BufferLayer], int]:
        """The layers of a prefilled cache, made ours, and the position its next token takes.

        Raises:
            ValueError: the cache is empty, or its layers hold different numbers of tokens.
        """
        if type(cache.layers[0]) is not BufferLayer:
            self.prepare(cache)
        layers = cast(list[BufferLayer], cache.layers)
        pos = layers[0].length
        if layers[0].key_buffer is None:
            raise ValueError("decode needs a prefilled cache")
        if any(layer.length != pos for layer in layers):
            raise ValueError("cache layers hold different numbers of tokens; crop it first")
        return layers, pos

    def decode_batch(
        self, caches: Sequence[KVCache], tokens: Sequence[int], threads: int | None = None
    ) -> torch.Tensor:
        """Feed one token at the end of each cache in one pass over the weights; return the
        logits after each (``[B, vocab]``), equal to what `decode` gives for each alone.

        Args:
            caches: distinct caches of `BufferLayer`s, each prefilled (as for `decode`).
            tokens: one token id per cache.
            threads: threads for this step (default: the decoder's, else torch's count).

        Raises:
            ValueError: a token or position out of range, or more caches than `max_batch`.
        """
        if len(caches) != len(tokens) or not 0 < len(caches) <= self.max_batch:
            raise ValueError(f"decode_batch takes 1 to {self.max_batch} caches, one token each")
        if len(caches) == 1:
            return self.decode(caches[0], int(tokens[0]), threads)[None]
        if self.experts:
            with self._serial:
                steps = [self.decode(c, int(t), threads) for c, t in zip(caches, tokens, strict=True)]
                return torch.stack(steps)
        rows: list[list[BufferLayer]] = []
        positions = []
        for cache in caches:
            layers, pos = self._decode_layers(cache)
            self._reserve_layers(layers, pos + 1)
            rows.append(layers)
            positions.append(pos)
        logits = self._run_rows(rows, positions, tokens, False, threads)
        for layers, pos in zip(rows, positions):
            for layer in layers:
                layer.length = pos + 1
        return logits

    @torch.inference_mode()
    def prefill_rows(self, cache: KVCache, tokens: Sequence[int], every: bool = False) -> torch.Tensor:
        """Feed a few tokens (up to `max_batch`) at the end of `cache` in one pass over the
        weights, as rows of one batch that share the cache; return the logits after the last
        (``[vocab]``), or with `every` after each token (``[n, vocab]``: a speculative draft's
        verification). The cache and the logits are those of decoding the tokens one by one,
        bit for bit, at about the cost of one batched step (a short prompt, a chat turn's
        new message: the batched prefill product is made for longer inputs).

        Raises:
            ValueError: no tokens or more than `max_batch`, or a token or position out of
                range.
        """
        n = len(tokens)
        if not 0 < n <= self.max_batch:
            raise ValueError(f"prefill_rows takes 1 to {self.max_batch} tokens")
        self.prepare(cache)
        layers = cast(list[BufferLayer], cache.layers)
        pos = layers[0].length
        if any(layer.length != pos for layer in layers):
            raise ValueError("cache layers hold different numbers of tokens; crop it first")
        self._reserve_layers(layers, pos + n)
        if self.experts:
            with self._serial:
                rows = [self.decode(cache, int(token)) for token in tokens]
                return torch.stack(rows) if every else rows[-1]
        logits = self._run_rows([layers] * n, list(range(pos, pos + n)), tokens, not every, None)
        for layer in layers:
            layer.length = pos + n
        return logits if every else logits[0]

    def _run_rows(
        self,
        rows: Sequence[list[BufferLayer]],
        positions: Sequence[int],
        tokens: Sequence[int],
        last_only: bool,
        threads: int | None,
    ) -> torch.Tensor:
        """`chatbot_decode_batch` on rows whose layers have room for their positions, with
        this thread's scratch (calls in several threads may run at once)."""
        n_layers = self.dims[0]
        self._ensure_rope(max(positions) + 1)
        batch = len(rows)
        ptrs = ctypes.c_void_p * (batch * n_layers)
        kptrs = ptrs(*[layer.key_buffer.data_ptr() for layers in rows for layer in layers])  # type: ignore[union-attr]
        vptrs = ptrs(*[layer.value_buffer.data_ptr() for layers in rows for layer in layers])  # type: ignore[union-attr]
        ints = ctypes.c_int32 * batch
        caps = [layers[0].capacity for layers in rows]
        threads = threads or cap_threads(self.threads or torch.get_num_threads())
        floats = int(
            self.lib.chatbot_batch_scratch_floats(ctypes.byref(self.struct), batch, max(caps), threads)
        )
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < floats:
            buf = self._local.scratch = torch.empty(floats, dtype=torch.float32)
        logits = torch.empty(1 if last_only else batch, self.vocab, dtype=torch.float32)
        # held in names for the length of the call (a temporary's address would dangle)
        token_arr, pos_arr, cap_arr = ints(*[int(t) for t in tokens]), ints(*positions), ints(*caps)
        status = self.lib.chatbot_decode_batch(
            ctypes.byref(self.struct), batch, ctypes.addressof(token_arr), ctypes.addressof(pos_arr),
            ctypes.addressof(cap_arr), ctypes.addressof(kptrs), ctypes.addressof(vptrs),
            buf.data_ptr(), logits.data_ptr(), int(last_only), threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(
                f"tokens {list(tokens)} or positions {list(positions)} out of range for the fast decoder"
            )
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
    if level != "off":
        try:
            return FastDecoder(model, level, threads, use_gguf=use_gguf), None
        except FastPathUnavailable as exc:
            reason: str | None = f"fast decode off: {exc}"
    else:
        reason = None
    return None, reason
