"""A causal LM of our own for the architectures whose row says `own_model`: the modules of
transformers' class for that architecture, by the same names, computing the same forward pass
op for op, without importing transformers' model classes.

Why: importing `transformers.models.<arch>.modeling_<arch>` and its config class pulls in
transformers' model loading (`torch.distributed.tensor`), its masks (`torch._dynamo`),
accelerate and PIL: 1.7-2.0 s of a one-shot's ~4 s on an idle core, for a model whose
matrices are the GGUF file's blocks (`packed`) and whose decode steps run in the kernels.
A pass that asks for a cache and is given none gets our `KVCache` (the engine always gives
one). The generation config is our own `GenerationDefaults`;
so are the output class and the attention: `sdpa_attention` makes the call of torch's
`scaled_dot_product_attention` that transformers' "sdpa" attention makes on the CPU (the same
arguments, so the products are the very same; tests/test_own_model.py compares them).

The forward pass follows transformers' `LlamaForCausalLM` (5.x): RMSNorm in float32, the
default rotary embedding, and the mask `create_causal_mask` makes for sdpa: none where
sdpa's `is_causal` does the same (one query, or as many queries as keys), else a boolean
[1, 1, q, kv] mask from the cache's query offset and mask sizes. What this class lacks of
transformers' (`generate`, loss, gradient checkpointing) no caller of a GGUF model uses; a
file whose config needs more (another rope, a sliding window) is built with transformers'
class instead (`own_model_for`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from chatbot.engine.backends.native.architectures import BY_MODEL_TYPE
from chatbot.engine.cache.layers import new_cache
from chatbot.engine.cache.queries import PassQueries

Cache = Any  # a transformers-style cache: update(k, v, layer), get_seq_length(), mask sizes


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """Each key/value head repeated for the `groups` query heads that share it:
    [B, KV, S, D] -> [B, KV * groups, S, D]."""
    if groups == 1:
        return states
    batch, kv_heads, length, dim = states.shape
    return states[:, :, None].expand(batch, kv_heads, groups, length, dim).reshape(batch, -1, length, dim)


def sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of `query` [B, H, q, D] over `key`/`value` [B, KV, kv, D]: the output
    [B, q, H, D], by the call of `scaled_dot_product_attention` that transformers' "sdpa"
    attention (5.x, on the CPU) makes. Grouped heads: torch's `enable_gqa` without a mask;
    with one, a single query's heads as the rows of its key/value heads; else the key/value
    heads repeated. `is_causal` where there are several queries and no mask."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_length = query.shape[2]
    extra: dict[str, Any] = {}
    if groups > 1:
        if attention_mask is None and key.shape[-1] == value.shape[-1] <= 256:
            extra["enable_gqa"] = True
        elif q_length == 1 and not torch.compiler.is_compiling():
            batch, heads, _, dim = query.shape
            query = query.reshape(batch, heads // groups, groups, dim)  # [B, KV, groups, D]
            if attention_mask is not None and attention_mask.shape[1] != 1:
                attention_mask = attention_mask.reshape(attention_mask.shape[0], heads // groups, groups, -1)
        else:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    is_causal = q_length > 1 and attention_mask is None and getattr(module, "is_causal", True)
    if is_causal and key.shape[2] > q_length:  # (as transformers: the first q keys)
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        **extra,
    )  # fmt: skip
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1])  # [B, H, q, D]
    return out.transpose(1, 2).contiguous(), None


@dataclasses.dataclass
class CausalLMOutput:
    """What `CausalLM.forward` returns, read as transformers' output is: `logits`, the cache
    (also as `past_key_values`)."""

    logits: torch.Tensor
    cache: Any = None

    @property
    def past_key_values(self) -> Any:
        return self.cache


@dataclasses.dataclass
class GenerationDefaults:
    """Our own model's `generation_config`: what transformers' `GenerationConfig.from_model_config`
    makes of a GGUF file's config, which holds no generation settings: its token ids only
    (no sampling setting, so the settings' own defaults apply:
    `chatbot.engine.sampling.sampling_from_model` reads those it finds). The chat template's stop
    ids join `eos_token_id` (`chatbot.models.templates`). `to_transformers` gives transformers'
    (for callers of its `generate` builders, `chatbot.compat.colossal`)."""

    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_model_config(cls, config: Any) -> GenerationDefaults:
        ids = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        return cls(**ids)

    def to_transformers(self, config: Any) -> Any:
        """transformers' `GenerationConfig.from_model_config(config)`, with what is set here."""
        from transformers.generation.configuration_utils import GenerationConfig

        generation = GenerationConfig.from_model_config(config)
        for key, value in dataclasses.asdict(self).items():
            if value is not None:
                setattr(generation, key, value)
        return generation


attention_function: Callable[..., tuple[torch.Tensor, Any]] = sdpa_attention
"""The attention every layer runs: `sdpa_attention`, and, after
`compiled.use_decode_attention`, that backend's `decode_attention` (sdpa outside a compiled
step)."""


def own_model_for(config: Any) -> bool:
    """Whether `config` is built as `CausalLM` (its architecture's row says `own_model`, and
    it asks for nothing this class does not compute)."""
    if os.environ.get("CHATBOT_OWN_MODEL") == "0":  # transformers' class (bench decode's baseline)
        return False
    arch = BY_MODEL_TYPE.get(getattr(config, "model_type", ""))
    rope = getattr(config, "rope_parameters", None) or {}
    return bool(
        arch is not None
        and arch.own_model
        and rope.get("rope_type", "default") == "default"
        and getattr(config, "hidden_act", "silu") == "silu"
        and not getattr(config, "sliding_window", None)
        and not getattr(config, "use_bidirectional_attention", False)
        and getattr(config, "pretraining_tp", 1) == 1
    )


class Linear(nn.Linear):
    """`nn.Linear` without the random initialisation: a place holder on the meta device, given
    the file's weights (initialising it there imports torch._dynamo, 0.3-0.6 s)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """`nn.Embedding` without the random initialisation, as `Linear`."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """The default rotary embedding (`rope_type: default`); `inv_freq` may be rescaled after
    (`gguf_model.apply_rope_freqs`)."""

    inv_freq: torch.Tensor

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = "default"
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # on the CPU even under `torch.device("meta")` (there, arange imports torch._dynamo)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = Linear(config.hidden_size, heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # [B, S, H*D] -> [B, H, S, D]
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        lead: PassQueries | None = kwargs.get("pass_queries")
        if lead is not None and lead.continuing:  # the call the whole prompt's pass made
            query = torch.cat((lead.layers[self.layer_idx], query), dim=2)
        elif lead is not None:
            lead.layers.append(query[:, :, : lead.rows].clone())
        out, _ = attention_function(
            self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        if lead is not None and lead.continuing:
            out = out[:, lead.rows :]  # [B, S, H, D]: this pass's positions
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, width, bias = config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        self.gate_proj = Linear(hidden, width, bias=bias)
        self.up_proj = Linear(hidden, width, bias=bias)
        self.down_proj = Linear(width, hidden, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


def causal_mask(cache: Cache | None, q_length: int, device: torch.device) -> torch.Tensor | None:
    """The mask transformers' `create_causal_mask` gives sdpa for a batch of one without
    padding: None where sdpa's `is_causal` (or no mask, for one query) does the same."""
    if cache is None:
        return None
    q_offset = cache.get_query_offset(0)
    kv_length, kv_offset = cache.get_mask_sizes(q_length, 0)
    skip = not (cache.is_compileable and q_length == 1)
    if skip and (q_length == 1 or kv_length == q_length):
        return None
    q_arange = torch.arange(q_length, device=device) + q_offset
    kv_arange = torch.arange(kv_length, device=device) + kv_offset
    return kv_arange[None, None, None, :] <= q_arange[None, None, :, None]  # [1, 1, q, kv]


class Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.padding_idx = getattr(config, "pad_token_id", None)
        self.vocab_size = config.vocab_size
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: Cache | None,
        use_cache: bool,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Cache | None]:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = new_cache(self.config)  # (no caller of ours comes here: the engine gives one)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (
                torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past
            ).unsqueeze(0)
        lead: PassQueries | None = kwargs.get("pass_queries")
        if lead is not None and lead.continuing:
            # the rest of a prompt's first pass, after its first `lead.rows` positions: sdpa's
            # `is_causal` over all of them, as for the whole prompt
            mask = None
        else:
            mask = causal_mask(cache, inputs_embeds.shape[1], inputs_embeds.device)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask=mask, position_embeddings=position_embeddings,
                position_ids=position_ids, cache=cache, use_cache=use_cache, **kwargs,
            )  # fmt: skip
        return self.norm(hidden_states), cache


class CausalLM(nn.Module):
    """transformers' `LlamaForCausalLM` as a GGUF model runs it: the same modules by the same
    names (`model.layers[i].self_attn.q_proj`...), `config`, `generation_config`, and the
    forward pass's arguments and output (`logits`, the cache). A prefill may also be given
    `pass_queries` (`chatbot.engine.cache.queries.PassQueries`): a prompt's first pass keeps
    its first queries there, the rest of that prompt after a stored start continues from them.
    """

    keeps_pass_queries = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.generation_config = GenerationDefaults.from_model_config(config)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """Logits of the last `logits_to_keep` positions (0: all), the cache updated in place.

        Raises:
            ValueError: an attention mask that hides a position (padding is not supported).
        """
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("a GGUF model runs without padding: every position is attended to")
        cache = cache if cache is not None else past_key_values
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        hidden_states, cache = self.model(input_ids, inputs_embeds, position_ids, cache, use_cache, **kwargs)
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:, :]
        return CausalLMOutput(logits=self.lm_head(hidden_states), cache=cache)
