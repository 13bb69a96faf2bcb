"""torch modules over packed weight matrices: a GGUF model runs in transformers as it is stored.

`PackedLinear` and `PackedEmbedding` stand in for `nn.Linear` / `nn.Embedding` in a
transformers model whose weights stay in their GGUF block formats on the file's memory map
(`chatbot.models.gguf_model` builds one). The model then works everywhere a transformers model
does (prefill, `--opt off`, the compat APIs, perplexity) without a float32 copy of its weights:

- a product with a few rows of input (decoding one token through transformers) runs the
  native matrix-vector kernel on the packed rows, in float32 activations;
- a product with more rows (prefill) either runs one of the kernels' batched integer products
  on the blocks (`--opt auto`/`exact`/`fast` prefill through `with_activations`: `ACT_I16`,
  int16 inputs, AVX2 and up; `ACT_Q8`, int8 inputs into a matrix in 8-row tiles, as the
  decode step's int8 sites take them), or dequantizes the matrix into a per-thread scratch
  buffer, in bands of at most 64 MB, and multiplies each band with torch's GEMM, so at most
  one matrix (or band) of float32 weights exists at a time.

In float32 (the default, `--opt f32` and `off`) both compute with the weights the file
stores, exactly as a model dequantized once would, up to the order of the additions; with
int16 or int8 inputs, as the decode kernels do (kernels.c, ACT_I16 and ACT_Q8).

`weight` of these modules is a stand-in with the true shape and dtype and no storage (the
embedding's on the CPU, so that code asking where the input ids go gets an answer; the
linears' on the meta device, so that code reading values fails loudly); the weights are
`packed`.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.threads import ThreadTuner, cap_threads

SMALL_INPUT_ROWS = 4
"""Up to this many input rows, a product runs as matrix-vector products on the packed rows."""
BAND_FLOATS = 1 << 24
"""Most floats of one dequantized band (64 MB): every matrix of a 1.5B model fits in one band
(a 3B-8B model's MLP matrices take 2-4), so a forward pass makes about one GEMM call per
matrix, as with float32 weights. Each GEMM call ends in a barrier of torch's threads, where
on a busy machine a descheduled thread stalls the others: fewer, larger calls wait less
(docs/benchmarks.md has figures)."""

_local = threading.local()
_tuners: dict[tuple[int, bool], ThreadTuner] = {}
"""Thread counts of the batched integer products, by the most they may use and whether the
product is the int8 one: timed per weight and input, as the decoder times its steps. A forward
pass makes ~7 products per layer, each ending in a barrier; on a busy machine a descheduled
thread stalls the others there, so one thread can beat several: the tuner measures which."""


_matvec_tuners: dict[tuple[int, int], ThreadTuner] = {}
"""The same choice for the matrix-vector products of a few input rows (a token decoded through
transformers' eager forward: `--opt off`, the compat APIs), by the most threads and the
matrix's size: a small matrix's product can be over before a second thread has started."""


def _tuner(table: dict[Any, ThreadTuner], most: int, key: Any) -> ThreadTuner:
    return table.get(key) or table.setdefault(key, ThreadTuner(most))


def _int_product(
    p: kernels.PackedMatrix, x: torch.Tensor, threads: int | None, act: int
) -> torch.Tensor | None:
    """The batched integer product for `act`: int8 inputs into a matrix in 8-row tiles
    (`kernels.matmul_x8`, as the decode step's tile products take them), int16 otherwise
    (`kernels.matmul_i16`: finer than int8, so no matrix takes coarser inputs than asked);
    None where neither runs."""
    product = kernels.matmul_x8 if act == kernels.ACT_Q8 and p.x8 else kernels.matmul_i16
    tuner = None
    if not threads:
        most = cap_threads(torch.get_num_threads())
        tuner = _tuner(_tuners, most, (most, product is kernels.matmul_x8))
        threads = tuner.pick()
    start = time.perf_counter()
    y = product(p, x, threads)
    if y is None and product is kernels.matmul_x8:
        return kernels.matmul_i16(p, x, threads)
    if y is not None and tuner is not None:
        tuner.record(threads, (time.perf_counter() - start) / (x.shape[0] * p.rows * p.cols))
    return y


def _scratch(floats: int) -> torch.Tensor:
    """A float32 buffer of at least `floats`, one per thread, reused across calls."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _local.buf = torch.empty(floats, dtype=torch.float32)
    return buf


def _row_bytes(p: kernels.PackedMatrix) -> int:
    per_block, block_bytes = kernels.BLOCK_SHAPES[p.fmt]
    return p.cols // per_block * block_bytes


def packed_matmul(
    p: kernels.PackedMatrix, x: torch.Tensor, threads: int | None = None, act: int = kernels.ACT_F32
) -> torch.Tensor:
    """x @ W.T for a packed W ([rows, cols]) and float32 x ([n, cols]); returns [n, rows].

    Args:
        p: the packed matrix.
        x: float32 inputs, one per row.
        threads: threads for the native parts. By default, a few input rows (matrix-vector
            products) and the integer forms: 1 or torch's thread count, whichever measures faster
            (`_matvec_tuners`, `_tuners`: on a busy machine a descheduled thread stalls the
            others at every product's barrier, hundreds of times per forward pass); the
            float32 form's dequantization: 1 (torch's GEMM does the heavy part).
        act: `ACT_F32` (float32 inputs: the float32 product of the stored weights),
            `ACT_I16` (inputs as int16 per block, exact integer products, as the decode
            kernels take them; formats without integer products use float32) or `ACT_Q8`
            (int8 per super-block of 256, as llama.cpp: the int8 product of a matrix in
            8-row tiles, the int16 one of the other formats).
    """
    x = x.to(torch.float32).contiguous()
    n = x.shape[0]
    if p.fmt == kernels.FMT_F32:
        return torch.nn.functional.linear(x, p.data)
    if act in (kernels.ACT_I16, kernels.ACT_Q8) and n > SMALL_INPUT_ROWS:
        y = _int_product(p, x, threads, act)
        if y is not None:
            return y
    lib = kernels.load_library()
    if n <= SMALL_INPUT_ROWS:
        tuner = None
        if threads is None:
            most = cap_threads(torch.get_num_threads())
            tuner = _tuner(_matvec_tuners, most, (most, p.rows * p.cols))
            threads = tuner.pick()
        start = time.perf_counter()
        y = torch.empty(n, p.rows, dtype=torch.float32)
        mat = p.as_struct()
        scratch = kernels.matvec_scratch(p.cols)
        for i in range(n):
            lib.chatbot_matvec(
                ctypes.byref(mat),
                x[i].data_ptr(),
                scratch.data_ptr(),
                y[i].data_ptr(),
                threads,
                act,
            )
        if tuner is not None:
            tuner.record(threads, (time.perf_counter() - start) / n)
        return y
    threads = threads or 1
    band = max(1, min(p.rows, BAND_FLOATS // p.cols))
    if p.x8:  # whole tiles of 8 rows
        band = max(8, band // 8 * 8)
    buf = _scratch(band * p.cols)
    base, stride = p.data.data_ptr(), _row_bytes(p)
    out = torch.empty(n, p.rows, dtype=torch.float32) if band < p.rows else None
    for r0 in range(0, p.rows, band):
        r1 = min(p.rows, r0 + band)
        sub = kernels.Mat(base + r0 * stride, p.fmt, r1 - r0, p.cols, int(p.x8))
        w = buf[: (r1 - r0) * p.cols].view(r1 - r0, p.cols)
        lib.chatbot_dequantize(ctypes.byref(sub), w.data_ptr(), threads)
        # x @ w.T as F.linear lays it out: at a few dozen rows of x, faster than w @ x.T
        if out is None:
            return torch.nn.functional.linear(x, w)
        out[:, r0:r1] = torch.nn.functional.linear(x, w)
    assert out is not None
    return out


_by_handle: weakref.WeakValueDictionary[int, kernels.PackedMatrix] = weakref.WeakValueDictionary()


def _handle(packed: kernels.PackedMatrix) -> int:
    """An integer naming `packed` for the custom ops below (their arguments are tensors and
    numbers); the matrix stays the module's, the table holds it weakly."""
    _by_handle[id(packed)] = packed
    return id(packed)


# The packed products and row lookups as torch custom ops, so that `torch.compile` traces a
# model holding packed modules (`--opt compile` on a GGUF model) with each product one opaque
# call into the kernels, its output shape given by the fake implementation.
@contextlib.contextmanager
def graph_threads(threads: int) -> Iterator[None]:
    """In this thread, for the block's length, a compiled graph's few-row products (`--opt
    compile`'s step on a GGUF model) take `threads` (1 outside any such block). The compiled
    step picks the count from its own step times (`CompiledBackend.tuners`), not product by
    product: what a second thread costs the graph's other kernels, on torch's own OpenMP
    threads, shows in the step's time, not in the product's."""
    old = getattr(_local, "graph_threads", 1)
    _local.graph_threads = threads
    try:
        yield
    finally:
        _local.graph_threads = old


@torch.library.custom_op("chatbot::packed_matmul", mutates_args=())
def _packed_matmul_op(x: torch.Tensor, handle: int, act: int) -> torch.Tensor:
    threads = getattr(_local, "graph_threads", 1) if x.shape[0] <= SMALL_INPUT_ROWS else None
    return packed_matmul(_by_handle[handle], x, threads=threads, act=act)


@_packed_matmul_op.register_fake
def _(x: torch.Tensor, handle: int, act: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _by_handle[handle].rows, dtype=torch.float32)


@torch.library.custom_op("chatbot::packed_rows", mutates_args=())
def _packed_rows_op(ids: torch.Tensor, handle: int) -> torch.Tensor:
    return _rows(_by_handle[handle], ids)


@_packed_rows_op.register_fake
def _(ids: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty(ids.numel(), _by_handle[handle].cols, dtype=torch.float32, device=ids.device)


def _rows(packed: kernels.PackedMatrix, ids: torch.Tensor) -> torch.Tensor:
    """The dequantized rows `ids` (any shape) of `packed`, ``[ids.numel(), cols]``.

    Raises:
        IndexError: an id out of range.
    """
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= packed.rows):
        raise IndexError(f"token id out of range for an embedding of {packed.rows} rows")
    out = torch.empty(flat.numel(), packed.cols, dtype=torch.float32)
    mat = packed.as_struct()
    kernels.load_library().chatbot_rows(ctypes.byref(mat), flat.data_ptr(), flat.numel(), out.data_ptr())
    return out


class PackedLinear(nn.Module):
    """`nn.Linear` (y = x W^T + b) over a packed weight matrix.

    Args:
        packed: the weights [out_features, in_features] in a kernel format.
        bias: float32 [out_features], or None.
    """

    def __init__(self, packed: kernels.PackedMatrix, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = packed
        self.handle = _handle(packed)  # names `packed` to the custom op a compiled graph calls
        self.in_features, self.out_features = packed.cols, packed.rows
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(torch.float32).contiguous(), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._shape = torch.empty(packed.rows, packed.cols, dtype=torch.float32, device="meta")
        self.act = kernels.ACT_F32
        """The form of the inputs (`packed_matmul`): float32, or int16 or int8 in a
        `with_activations` view."""

    @property
    def weight(self) -> torch.Tensor:
        """Shape and dtype of the weights, on the meta device (the values are in `packed`)."""
        return self._shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = _packed_matmul_op(flat, self.handle, self.act)
        else:
            y = packed_matmul(self.packed, flat, act=self.act)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.packed.format_name}"
        )


class PackedEmbedding(nn.Module):
    """`nn.Embedding` over a packed matrix [num_embeddings, embedding_dim]: rows are
    dequantized as they are looked up."""

    def __init__(self, packed: kernels.PackedMatrix) -> None:
        super().__init__()
        self.packed = packed
        self.handle = _handle(packed)
        self.num_embeddings, self.embedding_dim = packed.rows, packed.cols
        # One float broadcast to the full shape: a CPU tensor of the right shape and dtype
        # that holds 4 bytes.
        self._shape = torch.zeros((), dtype=torch.float32).expand(packed.rows, packed.cols)

    @property
    def weight(self) -> torch.Tensor:
        """Shape, dtype and device of the table, without its values (they are in `packed`)."""
        return self._shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = _packed_rows_op(ids, self.handle)
        else:
            out = _rows(self.packed, ids)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.packed.format_name}"


class ScaledPackedEmbedding(PackedEmbedding):
    """`PackedEmbedding` whose rows are multiplied by `embed_scale`, as Gemma's scaled word
    embedding (`Gemma2TextScaledWordEmbedding`: sqrt(hidden size)) multiplies them, with the
    same attributes: `embed_scale` a 0-dim float32 buffer, `scalar_embed_scale` the float.
    A tied output matrix shares `packed` unscaled.

    Args:
        packed: the table [num_embeddings, embedding_dim] in a kernel format.
        embed_scale: the factor.
    """

    def __init__(self, packed: kernels.PackedMatrix, embed_scale: float) -> None:
        super().__init__(packed)
        self.scalar_embed_scale = embed_scale
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.tensor(embed_scale, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, embed_scale={self.scalar_embed_scale:g}"


_ACT_FN_CODES = {
    "SiLUActivation": kernels.ACT_FN_SILU,
    "SiLU": kernels.ACT_FN_SILU,
    "GELUTanh": kernels.ACT_FN_GELU_TANH,
}
"""The activations of transformers' experts modules (by class) that the kernels' experts take."""


class PackedExperts(nn.Module):
    """A mixture of experts' matrices as transformers' experts module takes them
    (`Qwen3MoeExperts`: ``forward(hidden, top_k_index, top_k_weights)``), over the 3-D tensors
    of a GGUF file as stored: `gate` and `up` [n_experts * expert width, hidden], `down`
    [n_experts * hidden, expert width], expert e's rows from e times their height. The tokens
    are grouped by the expert they go to, so a forward pass reads each chosen expert's rows
    once, whatever the number of tokens (prefill), and never an idle expert's.

    Args:
        gate, up, down: the experts' matrices, not in tiles.
        n_experts: how many experts they hold.
        act_fn: the activation of the gate (``silu``'s module).
    """

    def __init__(
        self,
        gate: kernels.PackedMatrix,
        up: kernels.PackedMatrix,
        down: kernels.PackedMatrix,
        n_experts: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.num_experts = n_experts
        self.hidden_dim, self.intermediate_dim = gate.cols, gate.rows // n_experts
        self.act_fn = act_fn
        self.act_gate_up = self.act_down = kernels.ACT_F32
        """The forms of the inputs (`packed_matmul`), as `PackedLinear.act`."""
        self._experts: dict[int, tuple[kernels.PackedMatrix, ...]] = {}

    def expert(self, e: int) -> tuple[kernels.PackedMatrix, ...]:
        """Expert e's gate, up and down matrices: views of its rows."""
        mats = self._experts.get(e)
        if mats is None:
            f, h = self.intermediate_dim, self.hidden_dim
            mats = self._experts[e] = (
                kernels.rows_of(self.gate, e * f, f), kernels.rows_of(self.up, e * f, f),
                kernels.rows_of(self.down, e * h, h),
            )  # fmt: skip
        return mats

    def in_one_call(
        self,
        x: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        act_fn: int,
        biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The experts of several tokens `x` (float32) in one native call (`kernels.experts`,
        llama.cpp's mul_mat_id: tokens grouped by expert, the experts shared out over the
        threads with no barrier per product, each expert's rows read once), with the
        activation `act_fn` (`ACT_FN_*`) and the experts' `biases` where they have some (gate
        and up [n_experts, 2 width], down [n_experts, hidden]). None where it is not taken:
        float32 inputs (the packed products' own path), one token, or the kernels refuse."""
        if self.act_gate_up == kernels.ACT_F32 or x.shape[0] < 2:
            return None
        acts = (self.act_gate_up, self.act_down, act_fn)
        threads = cap_threads(torch.get_num_threads())
        n = x.shape[0]
        ids, weights = top_k_index.reshape(n, -1), top_k_weights.reshape(n, -1)
        mats = (self.gate, self.up, self.down)
        return kernels.experts(mats, self.num_experts, x, ids, weights, acts, threads, biases)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = hidden_states.to(torch.float32)
        fn = _ACT_FN_CODES.get(type(self.act_fn).__name__)
        y = None if fn is None else self.in_one_call(x, top_k_index, top_k_weights, fn)
        if y is not None:
            return y.to(hidden_states.dtype)
        out = torch.zeros_like(x)
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        tokens, weights = order // k, top_k_weights.reshape(-1)[order].to(torch.float32)
        start = 0
        for e, n in enumerate(torch.bincount(chosen, minlength=self.num_experts).tolist()):
            if n == 0:
                continue
            rows, w = tokens[start : start + n], weights[start : start + n]
            start += n
            gate, up, down = self.expert(e)
            xe = x[rows]
            h = self.act_fn(packed_matmul(gate, xe, act=self.act_gate_up))
            h = h * packed_matmul(up, xe, act=self.act_gate_up)
            out.index_add_(0, rows, packed_matmul(down, h, act=self.act_down) * w[:, None])
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.num_experts} experts of {self.intermediate_dim}, hidden={self.hidden_dim}, "
            f"format={self.gate.format_name}/{self.down.format_name}"
        )


def with_activations(model: nn.Module, act: int | Callable[[kernels.PackedMatrix], int]) -> nn.Module:
    """`model` with every packed linear taking its inputs in the form `act` (`ACT_F32`,
    `ACT_I16` or `ACT_Q8`; or a function of the linear's matrix, giving one of these), so
    that a forward pass computes as the decode kernels do, and `model` left as it is: `model`
    itself where its packed linears take their forms already (or it has none), else a view of
    it, a shallow copy of each packed linear and of each module on the way to one, sharing
    every other module, weight and buffer with `model`."""
    if isinstance(model, PackedLinear):
        form = act(model.packed) if callable(act) else act
        if model.act == form:
            return model
        linear = copy.copy(model)
        linear.act = form
        return linear
    if isinstance(model, PackedExperts):
        forms = (act(model.gate), act(model.down)) if callable(act) else (act, act)
        if (model.act_gate_up, model.act_down) == forms:
            return model
        experts = copy.copy(model)
        experts.act_gate_up, experts.act_down = forms
        return experts
    children = {
        name: with_activations(child, act) for name, child in model._modules.items() if child is not None
    }
    if all(child is model._modules[name] for name, child in children.items()):
        return model
    twin = copy.copy(model)
    twin.__dict__["_modules"] = {**model._modules, **children}
    return twin


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The float32 weights of a linear or embedding module, packed or not (a packed one is
    dequantized: a new tensor)."""
    if isinstance(module, (PackedLinear, PackedEmbedding)):
        return kernels.unpack(module.packed)
    return module.weight  # type: ignore[return-value]


def packed_formats(model: nn.Module) -> dict[str, int]:
    """How many matrices the packed modules hold in each format (e.g. {"q4_1": 210, "q8_0": 1}),
    each shared matrix once; empty for a model without packed modules."""
    seen: dict[int, str] = {}
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedEmbedding)):
            seen[id(m.packed)] = m.packed.format_name
        elif isinstance(m, PackedExperts):
            seen |= {id(p): p.format_name for p in (m.gate, m.up, m.down)}
    counts: dict[str, int] = {}
    for name in seen.values():
        counts[name] = counts.get(name, 0) + 1
    return counts


def packed_parameters(model: nn.Module) -> int:
    """Weights held in packed modules (each matrix once, even when shared)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedEmbedding)):
            seen[id(m.packed)] = m.packed.rows * m.packed.cols
        elif isinstance(m, PackedExperts):
            seen |= {id(p): p.rows * p.cols for p in (m.gate, m.up, m.down)}
    return sum(seen.values())
