"""What the native kernels run of a transformers model, read from it without changing it.

`check_model` says whether the kernels can run a model (its architecture is a row of
`chatbot.engine.backends.native.architectures`, it is float32 on the CPU, its activation and rotary
embedding are ones kernels.c computes); `read_model` packs its matrices
(`chatbot.engine.backends.native.weights`) and copies its small tensors (norms as the kernels apply
them, biases, rotary frequencies) into a `NativeModel`; `native_struct` lays that out as the
C struct the kernels take. The model's modules, weights and settings are left as they were.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatbot.config import FILE_LEVELS
from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.architectures import BY_MODEL_TYPE, NativeArchitecture
from chatbot.engine.backends.native.weights import from_gguf, from_model, from_packed, is_packed
from chatbot.errors import ChatbotError

SUPPORTED_ROPE = {"default", "linear", "llama3", "yarn"}
"""The rotary embedding types (``rope_type``) kernels.c computes."""
ACTIVATIONS = {
    "silu": kernels.ACT_FN_SILU,
    "gelu_pytorch_tanh": kernels.ACT_FN_GELU_TANH,
    "gelu_new": kernels.ACT_FN_GELU_TANH,  # the same tanh approximation
}
"""The MLP activations the kernels compute, by transformers' name."""
NORM_SLOTS = ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm")
"""The per-layer norm vectors of `kernels.ModelStruct` (each present in all layers or none)."""

_MISSING = object()


class FastPathUnavailable(ChatbotError):
    """The fast decode path cannot run this model here; the engine falls back to transformers."""


def text_config(model: Any) -> Any:
    """The config of a model's text decoder (itself, or the text part of a multimodal one)."""
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_model(model: Any) -> tuple[Any, NativeArchitecture]:
    """The text config and architecture of a model the kernels can run.

    Raises:
        FastPathUnavailable: what the kernels cannot run (the message says what).
    """
    config = text_config(model)
    kind = getattr(config, "model_type", "?")
    if kind not in BY_MODEL_TYPE:
        raise FastPathUnavailable(
            f"no fast decode for {kind} models (only {', '.join(sorted(BY_MODEL_TYPE))})"
        )
    if not hasattr(getattr(model, "model", None), "layers"):  # e.g. Gemma 3 with its vision tower
        raise FastPathUnavailable(f"no fast decode for {type(model).__name__} (a text-only model runs)")
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
    if activation_name(config) not in ACTIVATIONS:
        raise FastPathUnavailable(f"no fast decode for the {activation_name(config)} activation")
    rope = getattr(config, "rope_parameters", None) or {}
    # one dict, or one per layer type (gemma3: local and global layers)
    nested = [d for d in rope.values() if isinstance(d, dict)] if isinstance(rope, dict) else []
    for params in nested or [rope if isinstance(rope, dict) else {}]:
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE:
            raise FastPathUnavailable(f"no fast decode for {rope_type} rotary embeddings")
    if getattr(config, "use_bidirectional_attention", False):
        raise FastPathUnavailable("no fast decode for bidirectional attention")
    return config, BY_MODEL_TYPE[kind]


def activation_name(config: Any) -> str:
    """The MLP activation's name: Gemma calls it ``hidden_activation``, the others ``hidden_act``."""
    return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"))


def norm_weight(module: Any, offset: float) -> torch.Tensor:
    """The float32 vector the kernels apply for an RMSNorm module (``v * x / rms(x)``): its
    weight plus `offset` (the architecture's `norm_offset`), checked by running the module
    on a fixed vector.

    Raises:
        FastPathUnavailable: the module does not compute that.
    """
    w = module.weight.detach().float() + offset
    eps = float(getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or 1e-6)
    x = torch.linspace(-2.0, 3.0, w.numel(), dtype=torch.float32)
    y = module(x[None]).detach().float()[0]
    if not torch.allclose(y, x * torch.rsqrt(x.pow(2).mean() + eps) * w, rtol=1e-4, atol=1e-6):
        raise FastPathUnavailable(f"no fast decode for the norm {type(module).__name__}")
    return w.contiguous()


def layer_window(attention: Any, config: Any) -> int:
    """How many positions (the new one included) a layer attends to; 0: all of them. A
    layer's own ``sliding_window`` (gemma, qwen2: None on full-attention layers), else the
    config's (mistral applies it to every layer)."""
    window: Any = getattr(attention, "sliding_window", _MISSING)
    if window is _MISSING:
        window = getattr(config, "sliding_window", None)
        if not getattr(config, "use_sliding_window", True):
            window = None
    return int(window or 0)


def layer_ropes(
    rotary: Any, config: Any, n_layers: int
) -> tuple[list[tuple[torch.Tensor, float]], list[int]]:
    """The distinct rotary embeddings of the layers, (inverse frequencies, attention
    scaling) each, and which one each layer uses: one for all layers, or one per layer type
    (gemma3's module has ``{type}_inv_freq``).

    Raises:
        FastPathUnavailable: a layer type without frequencies, or more than two kinds.
    """
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    ropes: list[tuple[torch.Tensor, float]] = []
    selectors = []
    for kind in types:
        inv = getattr(rotary, f"{kind}_inv_freq", None)
        scale = getattr(rotary, f"{kind}_attention_scaling", None)
        if inv is None:
            inv, scale = getattr(rotary, "inv_freq", None), getattr(rotary, "attention_scaling", 1.0)
        if not isinstance(inv, torch.Tensor):
            raise FastPathUnavailable(f"no rotary frequencies for the {kind} layers")
        rope = (inv.detach().float(), float(1.0 if scale is None else scale))
        same = [i for i, (o, c) in enumerate(ropes) if c == rope[1] and torch.equal(o, rope[0])]
        if not same:
            ropes.append(rope)
        selectors.append(same[0] if same else len(ropes) - 1)
    if len(ropes) > 2:
        raise FastPathUnavailable(f"no fast decode for {len(ropes)} kinds of rotary embedding")
    return ropes, selectors


def _bias(*mods: Any) -> torch.Tensor | None:
    """The biases of row blocks stacked as one product (zeros for a block without), or None."""
    if all(getattr(m, "bias", None) is None for m in mods):
        return None
    parts = [m.bias.detach().float() if m.bias is not None else torch.zeros(m.weight.shape[0]) for m in mods]
    return torch.cat(parts).contiguous()


@dataclass
class NativeModel:
    """A model as the kernels run it: packed matrices (embed, lm_head, then per layer the
    row blocks of qkv, o, gate/up and down), float32 copies of its small tensors, and its
    settings. `dims`: (layers, hidden, heads, kv heads, head size, MLP size)."""

    embed: kernels.PackedMatrix
    lm_head: kernels.PackedMatrix
    wqkv: list[list[kernels.PackedMatrix]]
    wo: list[list[kernels.PackedMatrix]]
    wgu: list[list[kernels.PackedMatrix]]
    wdown: list[list[kernels.PackedMatrix]]
    source: str  # "gguf": the file's (or the packed modules') matrices as stored; "model"
    dims: tuple[int, int, int, int, int, int]
    vocab: int
    # a mixture of experts: per layer the router [n_experts, hidden] (float32), and the experts
    # per token; then wgu/wdown hold every expert's rows and dims[5] is one expert's width
    routers: list[kernels.PackedMatrix] = field(default_factory=list)
    experts_used: int = 0
    norm_topk: bool = False
    expert_dim: int = 0
    # qwen2moe's shared expert, per layer: its gate and up, its down, its gate vector [hidden]
    shexp_gu: list[list[kernels.PackedMatrix]] = field(default_factory=list)
    shexp_down: list[list[kernels.PackedMatrix]] = field(default_factory=list)
    shexp_gate: list[torch.Tensor] = field(default_factory=list)
    # gpt-oss, per layer: the heads' sink logits, the router's bias, the experts' gate/up
    # biases [n_experts, 2 * width] (each expert's gate's then up's) and down biases
    sinks: list[torch.Tensor] = field(default_factory=list)
    router_bias: list[torch.Tensor] = field(default_factory=list)
    exp_gu_bias: list[torch.Tensor] = field(default_factory=list)
    exp_down_bias: list[torch.Tensor] = field(default_factory=list)
    biases: list[tuple[torch.Tensor | None, ...]] = field(default_factory=list)
    norms: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # NORM_SLOTS -> per layer
    final_norm: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    ropes: list[tuple[torch.Tensor, float]] = field(default_factory=list)
    rope_selectors: list[int] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)
    embed_scale: float = 0.0  # 0: none
    eps: float = 1e-6
    attn_scale: float = 1.0
    softcaps: tuple[float, float] = (0.0, 0.0)  # attention scores, final logits; 0: none
    act_fn: int = kernels.ACT_FN_SILU

    def layer_matrices(self) -> list[kernels.PackedMatrix]:
        """Every packed row block of the layers."""
        groups = (self.wqkv, self.wo, self.wgu, self.wdown, self.shexp_gu, self.shexp_down)
        return [p for site in groups for g in site for p in g]

    def sites(self) -> list[list[list[kernels.PackedMatrix]]]:
        """The matrices of each product site (kernels.c SITE_*: q/k/v, o, gate/up, down, the
        head), each as its groups: a layer's row blocks (with a shared expert's), the head
        as one group of one."""
        return [
            self.wqkv,
            self.wo,
            [*self.wgu, *self.shexp_gu],
            [*self.wdown, *self.shexp_down],
            [[self.lm_head]],
        ]


def _packed_matrices(
    model: Any, level: str, gguf: str | Path | None, use_gguf: bool, heads: tuple[int, int]
) -> tuple[tuple[Any, ...], str]:
    """The packed matrices (`fast_weights`) and where they come from ("gguf" or "model")."""
    from_file = use_gguf and level in FILE_LEVELS
    packed = from_packed(model) if from_file else None
    if packed is None and from_file and gguf and not is_packed(model):
        packed = from_gguf(model, gguf, *heads)
    if packed is not None:
        return packed, "gguf"
    return from_model(model, level), "model"


def read_model(
    model: Any, config: Any, arch: NativeArchitecture, level: str, gguf: str | Path | None, use_gguf: bool
) -> NativeModel:
    """Read what the kernels run of `model` (checked by `check_model`); `level` and
    `gguf`/`use_gguf` choose the packed matrices as `FastDecoder` documents.

    Raises:
        FastPathUnavailable: a norm or rotary embedding the kernels do not compute.
    """
    inner = model.model
    n_layers = config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    ffn_dim = config.moe_intermediate_size if arch.experts else config.intermediate_size
    if arch.shared_expert:  # the scratch holds the wider of the two
        ffn_dim = max(ffn_dim, config.shared_expert_intermediate_size)
    if arch.experts and not (is_packed(model) and level in FILE_LEVELS and use_gguf):
        raise FastPathUnavailable(
            f"a mixture of experts runs natively from its GGUF file as stored (--opt {'/'.join(FILE_LEVELS)})"
        )
    with torch.no_grad():
        packed, source = _packed_matrices(model, level, gguf, use_gguf, (heads, kv_heads))
        embed, lm_head, wqkv, wo, wgu, wdown = packed
        native = NativeModel(
            embed, lm_head, wqkv, wo, wgu, wdown, source=source,
            dims=(n_layers, config.hidden_size, heads, kv_heads, head_dim, ffn_dim),
            vocab=model.get_output_embeddings().weight.shape[0],
        )  # fmt: skip
        if arch.experts:
            _read_experts(native, inner.layers, config, arch)
        slots = [slot for slot, _, _ in arch.norms] + (["q_norm", "k_norm"] if arch.qk_norm else [])
        native.norms = {slot: [] for slot in slots}
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            dense = not arch.experts
            native.biases.append((
                _bias(att.q_proj, att.k_proj, att.v_proj), _bias(att.o_proj),
                _bias(mlp.gate_proj, mlp.up_proj) if dense else None, _bias(mlp.down_proj) if dense else None,
            ))  # fmt: skip
            for slot, module, _ in arch.norms:
                native.norms[slot].append(norm_weight(getattr(layer, module), arch.norm_offset))
            if arch.qk_norm:
                native.norms["q_norm"].append(norm_weight(att.q_norm, arch.norm_offset))
                native.norms["k_norm"].append(norm_weight(att.k_norm, arch.norm_offset))
        native.final_norm = norm_weight(inner.norm, arch.norm_offset)
        native.ropes, native.rope_selectors = layer_ropes(inner.rotary_emb, config, n_layers)
        native.windows = [layer_window(layer.self_attn, config) for layer in inner.layers]
        embed_scale = getattr(model.get_input_embeddings(), "embed_scale", None)
        native.embed_scale = float(embed_scale) if embed_scale is not None else 0.0
    norm0 = inner.layers[0].input_layernorm
    native.eps = float(
        getattr(norm0, "variance_epsilon", None) or getattr(norm0, "eps", None) or config.rms_norm_eps
    )
    native.attn_scale = float(getattr(inner.layers[0].self_attn, "scaling", head_dim**-0.5))
    native.softcaps = (
        float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        float(getattr(config, "final_logit_softcapping", None) or 0.0),
    )
    native.act_fn = kernels.ACT_FN_SWIGLU_OAI if arch.gpt_oss else ACTIVATIONS[activation_name(config)]
    return native


def _read_experts(native: NativeModel, layers: Any, config: Any, arch: NativeArchitecture) -> None:
    """A mixture's routers, routing settings and shared expert, checked as the kernels need them.

    Raises:
        FastPathUnavailable: more experts per token than the kernels take, or none.
    """
    used, most = int(config.num_experts_per_tok), int(kernels.load_library().chatbot_max_experts_used())
    if not 1 <= used <= min(most, int(config.num_experts)):
        raise FastPathUnavailable(
            f"no fast decode for {used} experts per token of {config.num_experts} (1 to {most})"
        )
    native.experts_used = used
    native.norm_topk = bool(getattr(config, "norm_topk_prob", arch.norm_topk))
    routers = [getattr(layer.mlp, "router", None) or layer.mlp.gate for layer in layers]  # gpt-oss: router
    native.routers = [kernels.pack_f32(r.weight.detach().float()) for r in routers]
    native.expert_dim = int(config.moe_intermediate_size)
    if arch.gpt_oss:
        for layer, router in zip(layers, routers, strict=True):
            experts = layer.mlp.experts
            native.sinks.append(layer.self_attn.sinks.detach().float().contiguous())
            native.router_bias.append(router.bias.detach().float().contiguous())
            gate_up = torch.cat((experts.gate_bias, experts.up_bias), dim=1)
            native.exp_gu_bias.append(gate_up.float().contiguous())
            native.exp_down_bias.append(experts.down_bias.detach().float().contiguous())
    if arch.shared_expert:
        for layer in layers:
            shared = layer.mlp.shared_expert
            native.shexp_gu.append([shared.gate_proj.packed, shared.up_proj.packed])
            native.shexp_down.append([shared.down_proj.packed])
            native.shexp_gate.append(
                layer.mlp.shared_expert_gate.weight.detach().float().reshape(-1).contiguous()
            )


@dataclass
class NativeStruct:
    """`kernels.ModelStruct` for a `NativeModel`, with the ctypes arrays it points into
    (held here so that they live as long as the struct). `kptrs`/`vptrs`: one cache buffer
    pointer per layer, which the decoder fills in."""

    struct: kernels.ModelStruct
    kptrs: Any
    vptrs: Any
    held: list[Any]


def native_struct(native: NativeModel, act: int) -> NativeStruct:
    """The C view of `native`, decoding with activations in form `act` (`kernels.ACT_*`);
    the rotary tables, the cache pointers and the scratch are set by the decoder."""
    n_layers, dim, heads, kv_heads, head_dim, ffn_dim = native.dims
    mats = {
        name: (kernels.Group * n_layers)(
            *[kernels.group_struct(parts, native.biases[i][slot]) for i, parts in enumerate(groups)]
        )
        for slot, (name, groups) in enumerate(
            [("wqkv", native.wqkv), ("wo", native.wo), ("wgu", native.wgu), ("wdown", native.wdown)]
        )
    }
    embed, head = native.embed.as_struct(), native.lm_head.as_struct()
    ptrs = ctypes.c_void_p * n_layers
    ints = ctypes.c_int32 * n_layers
    norms = {slot: ptrs(*[t.data_ptr() for t in native.norms[slot]]) if native.norms.get(slot) else None
             for slot in NORM_SLOTS}  # fmt: skip
    windows = ints(*native.windows) if any(native.windows) else None
    selectors = ints(*native.rope_selectors) if any(native.rope_selectors) else None
    kptrs, vptrs = ptrs(), ptrs()
    struct = kernels.ModelStruct(
        n_layers=n_layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=ffn_dim,
        vocab=native.vocab, n_threads=1, eps=native.eps, attn_scale=native.attn_scale, rope_len=0, cap=0,
        embed=ctypes.pointer(embed), lm_head=ctypes.pointer(head), final_norm=native.final_norm.data_ptr(),
        attn_norm=norms["attn_norm"], ffn_norm=norms["ffn_norm"],
        wqkv=mats["wqkv"], wo=mats["wo"], wgu=mats["wgu"], wdown=mats["wdown"],
        kcache=kptrs, vcache=vptrs, act=act, q_norm=norms["q_norm"], k_norm=norms["k_norm"],
        post_attn_norm=norms["post_attn_norm"], post_ffn_norm=norms["post_ffn_norm"],
        window=windows, rope_sel=selectors, embed_scale=native.embed_scale,
        attn_softcap=native.softcaps[0], final_softcap=native.softcaps[1], act_fn=native.act_fn,
    )  # fmt: skip
    routers = None
    if native.routers:
        routers = (kernels.Mat * n_layers)(*[r.as_struct() for r in native.routers])
        struct.router = routers
        struct.n_experts, struct.n_experts_used = native.routers[0].rows, native.experts_used
        struct.norm_topk, struct.expert_dim = int(native.norm_topk), native.expert_dim
    shared: list[Any] = []
    if native.shexp_gu:
        gu = (kernels.Group * n_layers)(*[kernels.group_struct(parts) for parts in native.shexp_gu])
        down = (kernels.Group * n_layers)(*[kernels.group_struct(parts) for parts in native.shexp_down])
        gates = ptrs(*[t.data_ptr() for t in native.shexp_gate])
        struct.shexp_gu, struct.shexp_down, struct.shexp_gate = gu, down, gates
        shared = [gu, down, gates]
    if native.sinks:  # gpt-oss
        vectors = [ptrs(*[t.data_ptr() for t in v]) for v in
                   (native.sinks, native.router_bias, native.exp_gu_bias, native.exp_down_bias)]  # fmt: skip
        struct.sinks, struct.router_bias, struct.exp_gu_bias, struct.exp_down_bias = vectors
        shared += vectors
    return NativeStruct(
        struct, kptrs, vptrs, [mats, embed, head, norms, windows, selectors, routers, *shared]
    )
