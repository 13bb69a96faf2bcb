"""Helpers shared by the test files: driving the CLI in-process, and the independent
references the engine is compared with (a full recompute with no cache, a fresh
tokenization of the rendered conversation).

The one factory of tiny random models (`make_model`), the test tokenizer (`make_tokenizer`)
and a GGUF writer (`write_tiny_gguf`) live here too; conftest.py holds only fixtures and
hooks, and test modules import nothing from it.

Imported as a plain module (`from helpers import cli`): pytest puts tests/ on the path.
"""

from __future__ import annotations

import json
from collections.abc import Container, Sequence
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

# --- the native kernels --------------------------------------------------------------------

# Tests that call the C kernels carry this mark; conftest.py builds the library once per
# session (in a fixture, not at import) and skips them, with the reason, where it cannot be
# built (no C compiler).
needs_kernels = pytest.mark.needs_kernels


# --- the CLI -------------------------------------------------------------------------------


def cli(capsys, *args: str) -> tuple[int | str | None, str, str]:
    """Run `chatbot ARGS`; the exit code (0 when main returns), stdout and stderr."""
    from chatbot.cli.app import main  # here, so that engine tests do not import the terminal

    code = 0
    capsys.readouterr()  # drop what the set-up printed (progress bars of save_pretrained)
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(capsys, *args: str, match: str | None = None) -> str:
    """Run `chatbot ARGS` and check it fails as a user error should: exit code 2, one line
    `chatbot: error: ...` on stderr (containing `match` where given), no traceback.

    Returns:
        The error line.
    """
    code, _, err = cli(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("chatbot: error: "), err
    assert "Traceback" not in err
    if match is not None:
        assert match in lines[0], lines[0]
    return lines[0]


# --- references ----------------------------------------------------------------------------


def full_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """The logits of one forward pass over all of `ids` with no cache: [S, V], float32."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def greedy_by_recompute(model, ids: Sequence[int], n: int, stop: Container[int] = ()) -> list[int]:
    """Up to `n` greedy tokens after `ids`, each from a full recompute; ends before a token
    in `stop`."""
    ids, out = list(ids), []
    for _ in range(n):
        tok = int(full_logits(model, ids)[-1].argmax())
        if tok in stop:
            break
        out.append(tok)
        ids.append(tok)
    return out


def assert_ids_match_text(session) -> None:
    """The session's ids decode to its rendered conversation, and each prompt span holds
    the tokens a fresh tokenization of the whole rendered text gives inside it."""
    tok = session.tokenizer
    rendered = session.render(session.messages(), add_generation_prompt=False)
    assert session.rendered == rendered
    assert tok.decode(session.all_ids, clean_up_tokenization_spaces=False) == rendered
    fresh = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    offsets = fresh["offset_mapping"]
    # A message that spells special tokens is encoded as text (no forged turns), unlike a
    # fresh tokenization of the whole: its spans are checked by decoding only.
    specials = [t for t in tok.all_special_tokens if t]
    forged = [m["content"] for m in session.messages() if any(t in m["content"] for t in specials)]
    pos = 0
    for seg in session.segments:
        start, end = pos, pos + len(seg.text)
        pos = end
        if seg.kind != "prompt" or any(c in seg.text for c in forged):
            continue
        # The fresh tokens that lie inside this span, by character offsets.
        inside = [i for i, (a, b) in zip(fresh["input_ids"], offsets) if a >= start and b <= end and b > a]
        assert inside == seg.ids, seg.text


# --- tiny models and the test tokenizer ------------------------------------------------------

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "Hello there! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog. Café, naïve, résumé, Zürich.",
    "日本語のテキストと中文文本, emoji 🙂🚀🎉 and symbols like € and ✓.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "You are a helpful assistant. Answer briefly and clearly.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few lines (about 400 tokens), with ChatML special tokens
    and template; eos is <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHATML
    return fast


HARMONY_TOKENS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]
GPT_OSS_TEMPLATE = Path(__file__).resolve().parents[1] / "devtools" / "data" / "gpt-oss-chat-template.jinja"


def make_harmony_tokenizer() -> PreTrainedTokenizerFast:
    """`make_tokenizer`'s, with gpt-oss's control tokens and its real chat template (OpenAI's
    harmony format); eos is <|return|>, as in gpt-oss's tokenizer."""
    fast = make_tokenizer()
    fast.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    fast.eos_token = "<|return|>"
    fast.chat_template = GPT_OSS_TEMPLATE.read_text(encoding="utf-8")
    return fast


# The transformers classes of each architecture the tests build.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),  # the text model (gemma3-1b's shape)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),  # takes the sizes below by their common names
}


def make_model(
    vocab_size: int = 128,
    layers: int = 2,
    *,
    arch: str = "llama",
    seed: int = 0,
    attn: str = "sdpa",
    sharp: bool = True,
    randomize: bool = False,
    **overrides,
) -> PreTrainedModel:
    """The tiny random model of every test: 64 wide, 4 heads (2 key/value heads), 512
    positions, ids bos 1, eos 2, pad 2; built under `torch.manual_seed(seed)`, in eval mode.

    Args:
        vocab_size: `len(make_tokenizer())` for tests that chat; 128 for random ids.
        arch: a key of ARCHS.
        attn: the attention implementation ("sdpa", "eager").
        sharp: tie the embeddings and scale the head by 8: random init gives near-uniform
            logits, and greedy choices are then well separated. False keeps transformers'
            plain init and the architecture's own tying (for tests that compare logits).
        randomize: random biases and norm weights (transformers initializes them to 0 and 1,
            which would hide a missing bias or norm).
        overrides: further config fields (hidden_act, max_position_embeddings, head_dim...).
    """
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[arch])
    settings = dict(  # noqa: C408 - keyword form, as the configs take them
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attn_implementation=attn,
    )
    if arch != "gpt2":
        settings.update(intermediate_size=128, num_key_value_heads=2)
    if arch.startswith("gemma"):
        settings.update(head_dim=16)  # gemma configs default to 256, whatever the width
    if sharp:
        settings["tie_word_embeddings"] = True
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**settings, **overrides})).eval()
    with torch.no_grad():
        if randomize:
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
                elif "norm" in name:
                    p.uniform_(0.5, 1.5)
        if sharp:
            model.lm_head.weight.mul_(8.0)
    assert model.config._attn_implementation == attn
    return model


def _permute(w, n_head):
    """llama.cpp's q/k row order (interleaved rotary halves); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model, tok) -> None:
    """A llama GGUF (F32) with a byte-level BPE tokenizer in llama.cpp's metadata keys."""
    import gguf

    cfg = model.config
    data = json.loads(tok.backend_tokenizer.to_str())
    tokens = [""] * len(tok)
    for text, i in data["model"]["vocab"].items():
        tokens[i] = text
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    specials = set(tok.all_special_tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(CHATML)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])  # tied: no output.weight
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(
            f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        )
        w.add_tensor(
            f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        )
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
