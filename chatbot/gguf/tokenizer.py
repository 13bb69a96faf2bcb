"""A GGUF file's cached tokenizer read with the `tokenizers` library alone: what transformers'
plain `TokenizersBackend` does with the same files (tokenizer.json, tokenizer_config.json,
chat_template.jinja), for the calls a chat makes, without importing transformers (~1 s of a
one-shot answer: docs/benchmarks.md, "Start-up").

`Tokenizer.from_folder` reads a cache folder whose manifest says its tokenizer is the plain
backend class (`fast_tokenizer`), and only where its settings are ones this class knows;
else the caller loads transformers' class. A call this class does not make itself (a chat
template tokenized, an assistant mask, an attribute it lacks) goes to transformers' class,
loaded then. tests/test_without_transformers.py compares the two.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# tokenizer_config.json keys whose meaning this class keeps (the others: transformers' class)
_KNOWN = frozenset({
    "backend", "bos_token", "eos_token", "pad_token", "unk_token", "is_local", "local_files_only",
    "model_max_length", "tokenizer_class", "added_tokens_decoder", "clean_up_tokenization_spaces",
})  # fmt: skip
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode, decode, the special tokens and the chat template of a cached tokenizer.

    Args:
        folder: the cache folder (its name_or_path).
        backend: its `tokenizers.Tokenizer`.
        settings: its tokenizer_config.json.
        chat_template: its chat template (None: it has none).
    """

    def __init__(
        self, folder: Path, backend: Any, settings: dict[str, Any], chat_template: str | None
    ) -> None:
        self.name_or_path = str(folder)
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.model_max_length = settings.get("model_max_length")
        self.clean_up_tokenization_spaces = bool(settings.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map = {k: settings[k] for k in _SPECIAL if isinstance(settings.get(k), str)}
        for key in _SPECIAL:
            text = self.special_tokens_map.get(key)
            setattr(self, key, text)
            setattr(self, f"{key}_id", None if text is None else backend.token_to_id(text))
        self.all_special_tokens = list(dict.fromkeys(self.special_tokens_map.values()))
        self.all_special_ids = [backend.token_to_id(t) for t in self.all_special_tokens]
        self.added_tokens_decoder = backend.get_added_tokens_decoder()
        self._lock = threading.Lock()  # `encode_special_tokens` is the backend's, for one call
        self._transformers: Any = None

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer | None:
        """The tokenizer saved in `folder`, or None where its settings ask for more than
        this class does (or a file is missing).

        Raises:
            Exception: what `tokenizers` raises for a damaged tokenizer.json.
        """
        from tokenizers import Tokenizer as Backend

        try:
            settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(settings, dict) or set(settings) - _KNOWN:
            return None
        if settings.get("tokenizer_class") not in (None, "TokenizersBackend"):
            return None
        if settings.get("backend", "tokenizers") != "tokenizers":
            return None
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.exists() else None
        return cls(folder, Backend.from_file(str(folder / "tokenizer.json")), settings, template)

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """The ids of `text` (with the post-processor's tokens where `add_special_tokens`; a
        special token's text as plain text where `split_special_tokens`)."""
        return list(self._encoding(text, add_special_tokens, split_special_tokens).ids)

    def _encoding(self, text: str, add_special_tokens: bool, split_special_tokens: bool) -> Any:
        backend = self.backend_tokenizer
        with self._lock:
            backend.encode_special_tokens = split_special_tokens
            try:
                return backend.encode(text, add_special_tokens=add_special_tokens)
            finally:
                backend.encode_special_tokens = False

    def __call__(
        self,
        text: str,
        add_special_tokens: bool = True,
        split_special_tokens: bool = False,
        return_offsets_mapping: bool = False,
        **kwargs: Any,
    ) -> Any:
        """`{"input_ids": ..., "attention_mask": ...}` of one text, as transformers' call, with
        each token's `(start, end)` characters as `offset_mapping` where asked; anything more
        (tensors, a batch, padding...) by transformers' class."""
        if kwargs or not isinstance(text, str):
            return self.transformers()(
                text,
                add_special_tokens=add_special_tokens,
                split_special_tokens=split_special_tokens,
                return_offsets_mapping=return_offsets_mapping,
                **kwargs,
            )
        encoding = self._encoding(text, add_special_tokens, split_special_tokens)
        ids = list(encoding.ids)
        out: dict[str, Any] = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if return_offsets_mapping:
            out["offset_mapping"] = [tuple(pair) for pair in encoding.offsets]
        return out

    def decode(
        self,
        ids: Sequence[int] | int,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """The text of `ids` (one id or several)."""
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        clean = (
            self.clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces
        )
        return _clean_up(text) if clean else text

    def convert_ids_to_tokens(self, ids: Sequence[int] | int, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in special]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The chat template's text of `conversation` (`tokenize=False`), rendered as
        transformers renders it (`template_budget.render_chat`); anything more (ids, a mask,
        documents, a message to continue, tools as functions, a list of conversations) by
        transformers' class.

        Raises:
            ValueError: the tokenizer has no chat template.
            jinja2.TemplateError, TemplateBudgetExceeded: the template fails.
        """
        own = (
            not tokenize
            and not set(kwargs) & {"documents", "continue_final_message", "return_assistant_tokens_mask",
                                   "chat_template", "return_dict", "padding", "truncation", "max_length"}
            and all(isinstance(t, dict) for t in tools or ())
            and (not conversation or isinstance(conversation[0], dict))
        )  # fmt: skip
        if not own:
            theirs = self.transformers()
            theirs.chat_template = self.chat_template  # (a fallback template may have been set here)
            return theirs.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                **kwargs,
            )
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        from chatbot.models.template_budget import render_chat

        template_kwargs = {**self.special_tokens_map, **kwargs}
        return render_chat(self.chat_template, conversation, tools, add_generation_prompt, **template_kwargs)

    def transformers(self) -> Any:
        """transformers' class over the same files (loaded on first use)."""
        if self._transformers is None:
            from transformers import TokenizersBackend

            from chatbot.models.template_budget import install

            self._transformers = TokenizersBackend.from_pretrained(self.name_or_path)
            install()  # its templates render under the budget too
        return self._transformers

    def __getattr__(self, name: str) -> Any:
        # what a chat does not use (padding, batches...): transformers' class answers
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.transformers(), name)


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization`: the spaces of English contractions and
    punctuation that old tokenizers wrote, removed."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text
