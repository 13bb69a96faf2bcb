"""Helpers shared by the test files: driving the CLI in-process, and the independent
references the engine is compared with (a full recompute with no cache, a fresh
tokenization of the rendered conversation).

Imported as a plain module (`from helpers import cli`): pytest puts tests/ on the path.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# --- the native kernels --------------------------------------------------------------------


def _kernels_build() -> bool:
    from chatbot.engine import kernels

    try:
        kernels.load_library()
    except kernels.KernelsUnavailable:  # pragma: no cover - depends on the machine
        return False
    return True


HAVE_KERNELS = _kernels_build()
needs_kernels = pytest.mark.skipif(not HAVE_KERNELS, reason="no C compiler for the native kernels")


# --- the CLI -------------------------------------------------------------------------------


def cli(capsys, *args: str) -> tuple[int | str | None, str, str]:
    """Run `chatbot ARGS`; the exit code (0 when main returns), stdout and stderr."""
    from chatbot.cli import main  # here, so that engine tests do not import the terminal

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


# --- models --------------------------------------------------------------------------------


def tiny_llama(num_layers: int = 2, attn: str = "sdpa") -> LlamaForCausalLM:
    """A random Llama with a 128-token vocabulary and plain init (seed 0), for tests that
    feed random ids (unlike conftest.make_llama, which is sized for the test tokenizer)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    assert model.config._attn_implementation == attn
    return model
