"""The architectures the native kernels run: one row per architecture, with its quirks.

The single source for Python of which models `chatbot.engine.backends.native.decoder` decodes,
which GGUF files `chatbot.models.gguf_model` builds from their blocks, and how each differs from Llama: where
its norms sit, how GGUF stores them, whether llama.cpp permuted its q/k rows. A new native
architecture is one row here (and, where it needs an operation the kernels lack, that
operation in kernels.c and its field in `kernels.ModelStruct`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LLAMA_NORMS: tuple[tuple[str, str, str], ...] = (
    ("attn_norm", "input_layernorm", "attn_norm"),
    ("ffn_norm", "post_attention_layernorm", "ffn_norm"),
)
"""A Llama decoder layer's norms: (kernel slot, transformers module, GGUF tensor ``blk.N.<name>``)."""
GEMMA_NORMS: tuple[tuple[str, str, str], ...] = (
    ("attn_norm", "input_layernorm", "attn_norm"),
    ("post_attn_norm", "post_attention_layernorm", "post_attention_norm"),
    ("ffn_norm", "pre_feedforward_layernorm", "ffn_norm"),
    ("post_ffn_norm", "post_feedforward_layernorm", "post_ffw_norm"),
)
"""A Gemma decoder layer's four norms, before and after attention and the MLP."""


@dataclass(frozen=True)
class NativeArchitecture:
    """One architecture the native kernels run, and what sets it apart from Llama.

    Attributes:
        model_type: transformers' ``model_type`` of its (text) config.
        gguf_arch: llama.cpp's ``general.architecture`` of its GGUF files; None where
            llama.cpp writes the model as another architecture (mistral as llama).
        norms: the layer's norms as (kernel slot, transformers module, GGUF tensor name).
        norm_offset: what the kernels add to a norm module's weight (they compute
            ``w * x / rms(x)``; Gemma's RMSNorm computes ``(1 + w) * x / rms(x)``, and its
            GGUF files store ``1 + w``).
        qk_norm: an RMSNorm per head on q and k (``self_attn.q_norm``/``k_norm``;
            ``attn_q_norm``/``attn_k_norm`` in GGUF).
        qkv_bias: its q/k/v projections have biases (``attn_q.bias``...).
        scaled_embedding: the embedding is multiplied by sqrt(hidden size) (the tied output
            matrix is not).
        permuted_qk: llama.cpp's converter stores the q/k rows permuted for its rotary
            layout; they are put back in transformers' order when read.
        logit_softcapping: its config soft-caps attention scores and final logits.
        rope_scaling_in_metadata: its GGUF metadata holds a rope scaling that transformers'
            GGUF reader does not read (``<arch>.rope.scaling.type``/``.factor``).
        rope_dims_in_metadata: its GGUF files give the rotary dimension count.
        sentencepiece: its GGUF files hold a sentencepiece (``llama``) vocabulary, not BPE.
        experts: its MLP is a mixture of experts (a router ``ffn_gate_inp``, the experts'
            matrices as 3-D ``ffn_{gate,up,down}_exps`` tensors), not one MLP.
        norm_topk: the chosen experts' router weights are renormalised to sum to 1
            (Qwen3-MoE's ``norm_topk_prob``; llama.cpp's ``norm_w``).
        shared_expert: beside the routed experts, one expert every token goes through, scaled
            by the sigmoid of its own gate (Qwen2-MoE: ``ffn_{gate,up,down}_shexp`` and
            ``ffn_gate_inp_shexp``).
        gpt_oss: gpt-oss's layer (``gpt-oss`` files): a learned sink logit per head in each
            attention softmax (``attn_sinks``), biases on q/k/v/o, on the router and on every
            expert (``ffn_*_exps.bias``), the experts' clamped SwiGLU (``swiglu_oai``: alpha
            1.702, limit 7, (up + 1) form), routed by the softmax of the chosen logits.
        own_model: a GGUF file of it is built as our own `skeleton.CausalLM` (transformers'
            modules, forward pass and config, without importing its model classes), where its
            config asks for nothing more (`skeleton.own_model_for`).
    """

    model_type: str
    gguf_arch: str | None
    norms: tuple[tuple[str, str, str], ...] = LLAMA_NORMS
    norm_offset: float = 0.0
    qk_norm: bool = False
    qkv_bias: bool = False
    scaled_embedding: bool = False
    permuted_qk: bool = False
    logit_softcapping: bool = False
    rope_scaling_in_metadata: bool = False
    rope_dims_in_metadata: bool = True
    sentencepiece: bool = False
    experts: bool = False
    norm_topk: bool = False
    shared_expert: bool = False
    gpt_oss: bool = False
    own_model: bool = False


GPT_OSS_NORMS: tuple[tuple[str, str, str], ...] = (
    ("attn_norm", "input_layernorm", "attn_norm"),
    ("ffn_norm", "post_attention_layernorm", "post_attention_norm"),
)
"""gpt-oss's two norms: llama.cpp names the one before the MLP ``post_attention_norm``."""

_GEMMA2 = NativeArchitecture(
    "gemma2",
    "gemma2",
    GEMMA_NORMS,
    norm_offset=1.0,
    scaled_embedding=True,
    logit_softcapping=True,
    rope_dims_in_metadata=False,
    sentencepiece=True,
)

ARCHITECTURES: tuple[NativeArchitecture, ...] = (
    NativeArchitecture("llama", "llama", permuted_qk=True, own_model=True),
    NativeArchitecture("mistral", None),
    NativeArchitecture("qwen2", "qwen2", qkv_bias=True),
    NativeArchitecture("qwen3", "qwen3", qk_norm=True),
    NativeArchitecture("qwen3_moe", "qwen3moe", qk_norm=True, experts=True, norm_topk=True),
    NativeArchitecture("qwen2_moe", "qwen2moe", qkv_bias=True, experts=True, shared_expert=True),
    NativeArchitecture(
        "gpt_oss", "gpt-oss", GPT_OSS_NORMS, qkv_bias=True, experts=True, norm_topk=True, gpt_oss=True
    ),
    _GEMMA2,
    replace(
        _GEMMA2,
        model_type="gemma3_text",
        gguf_arch="gemma3",
        qk_norm=True,
        logit_softcapping=False,
        rope_scaling_in_metadata=True,
    ),
)

BY_MODEL_TYPE: dict[str, NativeArchitecture] = {a.model_type: a for a in ARCHITECTURES}
"""The architectures by transformers' model type (``gemma3_text``)."""
BY_GGUF_ARCH: dict[str, NativeArchitecture] = {a.gguf_arch: a for a in ARCHITECTURES if a.gguf_arch}
"""The architectures by the ``general.architecture`` of their GGUF files (``gemma3``)."""
