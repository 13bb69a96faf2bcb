"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture) as a transformers `GptOssForCausalLM`
whose matrices stay in their blocks: what transformers' GGUF reader misses or gets wrong,
and the experts' module.

transformers 5.x lists gpt-oss in its GGUF reader, but cannot read a file llama.cpp wrote:
its rope-scaling branch takes a field's first part (the key's length) for the value, and fails
on every file with YaRN (all of them); it does not read the sliding window
(``attention.sliding_window``); and it looks for expert tensors by names llama.cpp does not
write. So the config and tokenizer are read with the YaRN keys hidden from it
(`reading_gpt_oss`), then the rope, window and experts' sizes are set from the metadata
(`apply_gpt_oss_metadata`); the layers are filled from the file's own tensors (`load_layer`).

The YaRN frequencies are llama.cpp's: its correction range is always truncated to whole
dimensions (transformers' ``truncate: true``), where OpenAI's config says ``false``: the
file is run as llama.cpp runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.packed import PackedExperts, packed_matmul

ARCH = "gpt-oss"
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
"""gpt-oss's clamped SwiGLU (the kernels' ACT_FN_SWIGLU_OAI has them too)."""


@contextlib.contextmanager
def reading_gpt_oss() -> Iterator[None]:
    """transformers' GGUF reader, for the duration, without a gpt-oss file's
    ``gpt-oss.rope.scaling.*`` fields, which it fails on (`apply_gpt_oss_metadata` sets the
    rope from them afterwards). Other files are read as they are."""
    import gguf

    original = gguf.GGUFReader

    class Reader(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith(f"{ARCH}.rope.scaling.")]:
                del self.fields[key]

    setattr(gguf, "GGUFReader", Reader)  # noqa: B010 - (mypy: not an assignment to a type)
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", original)  # noqa: B010


def apply_gpt_oss_metadata(path: Path, config: Any) -> None:
    """Set in `config` what a gpt-oss file's metadata says and transformers' reader does not
    read: the YaRN rope, the sliding window, the experts' sizes (every other layer, from the
    first, has the window, as in transformers and llama.cpp)."""
    from chatbot.gguf.metadata import read_metadata

    meta = read_metadata(path)

    def number(key: str, default: Any) -> Any:
        value = meta.get(f"{ARCH}.{key}")
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(number("rope.freq_base", 150000.0))}
    if meta.get(f"{ARCH}.rope.scaling.type") == "yarn":
        rope.update(
            rope_type="yarn", factor=float(number("rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(number("rope.scaling.original_context_length", 4096)),
            beta_fast=32.0, beta_slow=1.0, truncate=True,
        )  # fmt: skip
    config.rope_parameters = rope
    config.sliding_window = int(number("attention.sliding_window", 128))
    config.layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)
    ]
    width = int(number("expert_feed_forward_length", config.intermediate_size))
    config.intermediate_size = config.moe_intermediate_size = width
    config.num_local_experts = config.num_experts = int(number("expert_count", config.num_local_experts))
    config.num_experts_per_tok = int(number("expert_used_count", config.num_experts_per_tok))
    config.head_dim = int(number("attention.key_length", config.head_dim))
    config.swiglu_alpha, config.swiglu_limit = SWIGLU_ALPHA, SWIGLU_LIMIT


class PackedOaiExperts(PackedExperts):
    """gpt-oss's experts (transformers' `GptOssExperts`: ``forward(hidden, indices, weights)``)
    over the file's 3-D tensors as stored (MXFP4), as `PackedExperts`, with each expert's
    biases (`gate_bias`, `up_bias` [n_experts, width], `down_bias` [n_experts, hidden]) and
    the clamped SwiGLU: min(gate, 7) sigmoid(1.702 min(gate, 7)) (clamp(up, -7, 7) + 1)."""

    def __init__(
        self,
        gate: kernels.PackedMatrix,
        up: kernels.PackedMatrix,
        down: kernels.PackedMatrix,
        n_experts: int,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        super().__init__(gate, up, down, n_experts, nn.SiLU())
        self.gate_bias, self.up_bias, self.down_bias = biases
        self.gate_up_bias = torch.cat([self.gate_bias, self.up_bias], dim=1).contiguous()
        """[n_experts, 2 width]: each expert's gate bias, then its up bias (`in_one_call`)."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = hidden_states.to(torch.float32)
        biases = (self.gate_up_bias, self.down_bias)
        y = self.in_one_call(x, top_k_index, top_k_weights, kernels.ACT_FN_SWIGLU_OAI, biases)
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
            g = packed_matmul(gate, xe, act=self.act_gate_up) + self.gate_bias[e]
            u = packed_matmul(up, xe, act=self.act_gate_up) + self.up_bias[e]
            g, u = g.clamp(max=SWIGLU_LIMIT), u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
            h = g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)
            y = packed_matmul(down, h, act=self.act_down) + self.down_bias[e]
            out.index_add_(0, rows, y * w[:, None])
        return out.to(hidden_states.dtype)


def load_layer(layer: Any, b: str, config: Any, vector: Any, matrix: Any, stacked: Any) -> None:
    """A gpt-oss layer's sinks, router (weight and bias) and experts from the file, into
    transformers' modules (`layer.self_attn.sinks`, `layer.mlp.router`, `layer.mlp.experts`).
    `vector(name)`, `matrix(name)`, `stacked(name)`: `build_packed_model`'s readers.

    Raises:
        ValueError: a tensor of a shape the config does not give (the message names it).
    """
    n, width, hidden = config.num_local_experts, config.intermediate_size, config.hidden_size

    def sized(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = vector(name)
        if t.numel() != torch.Size(shape).numel():
            raise ValueError(f"{name} has {t.numel()} values, the metadata gives {'x'.join(map(str, shape))}")
        return t.reshape(shape)

    layer.self_attn.sinks = nn.Parameter(sized(b + "attn_sinks.weight", (config.num_attention_heads,)), False)
    router = layer.mlp.router
    weight = kernels.unpack(matrix(b + "ffn_gate_inp.weight"), threads=1)
    if tuple(weight.shape) != (n, hidden):
        raise ValueError(f"{b}ffn_gate_inp.weight is {tuple(weight.shape)}, the metadata gives {(n, hidden)}")
    router.weight = nn.Parameter(weight, requires_grad=False)
    router.bias = nn.Parameter(sized(b + "ffn_gate_inp.bias", (n,)), requires_grad=False)
    parts = {}
    shapes = {"gate": (n * width, hidden), "up": (n * width, hidden), "down": (n * hidden, width)}
    for part, shape in shapes.items():
        p, count = stacked(f"{b}ffn_{part}_exps.weight")
        if count != n or (p.rows, p.cols) != shape:
            raise ValueError(
                f"{b}ffn_{part}_exps.weight holds {count} experts of {p.rows // max(count, 1)}x{p.cols}, "
                f"the metadata says {n} of {shape[0] // n}x{shape[1]}"
            )
        parts[part] = p
    biases = (
        sized(b + "ffn_gate_exps.bias", (n, width)), sized(b + "ffn_up_exps.bias", (n, width)),
        sized(b + "ffn_down_exps.bias", (n, hidden)),
    )  # fmt: skip
    layer.mlp.experts = PackedOaiExperts(parts["gate"], parts["up"], parts["down"], n, biases)
