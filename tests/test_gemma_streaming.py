"""--enable-streaming on gemma2 and gemma3: sliding-window layers and per-layer-type rope.

Tiny random models with a small sliding window (32), the layer types given explicitly, and
for gemma3 a rope of each kind (local base 1e4 on sliding layers, global base 1e6 with
linear scaling on full ones, as the bigger gemma3 models). Checked against transformers:
- one-layer models, logits after every step of a streaming run equal a fresh forward pass
  over the kept ids at positions 0..n-1;
- every layer of a multi-layer model (through the session, as the CLI runs it with
  --opt off): each kept key equals transformers' own rope, for that layer's type, applied to
  the key's pre-rope projection at its new position; negative controls with one rope for
  all layers fail;
- the refusal when the cache exceeds the window, and the default recent size that fits.
"""

from __future__ import annotations

import copy
import importlib
import io

import pytest
import torch
from helpers import assert_one_line_error, cli, full_logits, make_model

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig, default_recent_size
from chatbot.conversation.session import ChatSession
from chatbot.engine.cache.buffers import BufferLayer, adopt_layers
from chatbot.engine.cache.sinks import (
    SinkCache,
    check_streaming_support,
    layer_inv_freqs,
    streaming_window,
)
from chatbot.engine.generate import Engine
from chatbot.errors import StreamingUnsupportedError
from chatbot.terminal.advice import in_user_words

WINDOW = 32
S, F = "sliding_attention", "full_attention"
# gemma3's two ropes: the local one of sliding layers, the global one (scaled) of full layers.
GEMMA3_ROPE = {
    S: {"rope_type": "default", "rope_theta": 10000.0},
    F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
}
GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=40)


def gemma(arch: str, layer_types: list[str], vocab: int = 128, window: int = WINDOW, **overrides):
    """A tiny random gemma2/gemma3 with these layer types (eager attention: gemma2 has no
    sdpa in transformers; gemma3 runs sdpa, as it loads by default)."""
    extra = {"rope_parameters": copy.deepcopy(GEMMA3_ROPE)} if arch == "gemma3" else {}
    return make_model(
        vocab,
        layers=len(layer_types),
        arch=arch,
        attn="eager" if arch == "gemma2" else "sdpa",
        layer_types=list(layer_types),
        sliding_window=window,
        **{**extra, **overrides},
    )


def random_ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PreRopeKeys:
    """Records the keys each attention layer computes before its rope (transformers'
    `apply_rotary_pos_emb` of the modeling module, patched to watch its inputs), so that a
    reference can rotate them to any position with transformers' own rotary module."""

    def __init__(self, model, monkeypatch) -> None:
        self.module = importlib.import_module(type(model).__module__)
        self.apply = self.module.apply_rotary_pos_emb
        self.calls: list[torch.Tensor] = []

        def watch(q, k, cos, sin, *args, **kwargs):
            self.calls.append(k.detach().clone())
            return self.apply(q, k, cos, sin, *args, **kwargs)

        monkeypatch.setattr(self.module, "apply_rotary_pos_emb", watch)
        self.model = model
        self.n_layers = model.config.num_hidden_layers

    def per_layer(self) -> list[torch.Tensor]:
        """Every layer's pre-rope keys of all tokens fed so far, ``[1, kv_heads, seen, D]``."""
        assert len(self.calls) % self.n_layers == 0
        return [torch.cat(self.calls[i :: self.n_layers], dim=-2) for i in range(self.n_layers)]

    def reference(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """`keys` (pre-rope) at positions 0..n-1, by layer `layer`'s rope in transformers."""
        rotary = self.model.model.rotary_emb
        positions = torch.arange(keys.shape[-2])[None]
        kind = {"layer_type": self.model.config.layer_types[layer]} if hasattr(rotary, "layer_types") else {}
        cos, sin = rotary(keys, positions, **kind)
        return self.apply(keys, keys, cos, sin)[1]


def assert_keys_are_rerotated_per_layer(recorder: PreRopeKeys, cache, kept: list[int], atol=1e-4) -> None:
    """Each layer's cached keys equal the reference rope of that layer's type applied to the
    pre-rope keys of the kept tokens (`kept`: their indices among all tokens fed)."""
    for i, pre in enumerate(recorder.per_layer()):
        want = recorder.reference(i, pre[:, :, kept])
        got = cache.layers[i].keys
        assert got.shape == want.shape, i
        assert torch.allclose(got, want, atol=atol), (i, (got - want).abs().max().item())


# --- which rope each layer gets -------------------------------------------------------------


def test_layer_inv_freqs_follow_the_layer_types():
    g3 = gemma("gemma3", [S, S, F, S])
    rotary = g3.model.rotary_emb
    freqs = layer_inv_freqs(g3)
    assert [f is rotary.sliding_attention_inv_freq for f in freqs] == [True, True, False, True]
    assert freqs[2] is rotary.full_attention_inv_freq
    assert not torch.allclose(freqs[0], freqs[2])  # two bases, so a mix-up would show
    g2 = gemma("gemma2", [S, F])
    assert all(f is g2.model.rotary_emb.inv_freq for f in layer_inv_freqs(g2))
    cache = SinkCache.for_model(g3, start_size=4, recent_size=20)
    assert [torch.equal(a, b.float()) for a, b in zip(cache.inv_freqs, freqs)] == [True] * 4
    with pytest.raises(ValueError, match="inv_freqs"):
        _ = cache.inv_freq  # no single rope to hand out


def test_per_layer_frequencies_give_per_layer_rotations():
    local = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    glob = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16)) / 8
    cache = SinkCache(num_layers=3, inv_freq=[local, local, glob], start_size=2, recent_size=16)
    (c0, s0), (c1, s1), (c2, s2) = cache.rotations_for_shift(5)
    assert c0 is c1 and s0 is s1  # layers sharing a rope share its rotation
    # a rotation by -5 * freq in the rotate_half layout, computed here from the definition
    assert torch.allclose(c2, torch.cos(-5 * torch.cat([glob, glob])))
    assert torch.allclose(s2, torch.sin(-5 * torch.cat([glob, glob])))
    assert torch.allclose(s0, torch.sin(-5 * torch.cat([local, local])))
    with pytest.raises(ValueError, match="for 2 layers, the cache has 3"):
        SinkCache(num_layers=3, inv_freq=[local, glob], recent_size=16)


def test_a_layer_type_without_frequencies_is_refused():
    g3 = gemma("gemma3", [S, F])
    del g3.model.rotary_emb.full_attention_inv_freq
    with pytest.raises(StreamingUnsupportedError, match="full_attention layers"):
        SinkCache.for_model(g3, start_size=4, recent_size=20)


# --- one layer: logits equal a fresh pass over the kept ids, at every step --------------------


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("kind", [S, F])
def test_one_layer_logits_match_a_fresh_pass_over_the_kept_ids(arch, kind):
    model = gemma(arch, [kind], sharp=False)
    cache = SinkCache.for_model(model, start_size=4, recent_size=24, evict_block=4)
    ids = random_ids(100)
    kept: list[int] = []
    checked = 0
    with torch.no_grad():
        for t in ids:
            removed = cache.evict_for_space(1)
            if removed is not None:
                del kept[removed[0] : removed[1]]
            logits = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
            kept.append(t)
            if cache.evicted_total:
                ref = full_logits(model, kept)[-1]
                assert torch.allclose(logits, ref, atol=1e-4), (len(kept), (logits - ref).abs().max())
                checked += 1
    assert kept[:4] == ids[:4] and len(kept) <= 28 <= WINDOW
    assert checked > 60 and cache.evicted_total > 60


# --- every layer: each re-rotated with its own layer type's rope ------------------------------


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("layer", [SinkCache, BufferLayer])
def test_every_layer_is_rerotated_with_its_own_rope(arch, layer, monkeypatch):
    """A prefill of 24 tokens, then an eviction of 6 after the sinks: the keys of every layer
    (sliding and full, both caches the engine uses: the sink cache's own layers and the fast
    path's buffer layers) are the pre-rope keys at their new positions, by that layer's rope."""
    model = gemma(arch, [S, F, S, F] if arch == "gemma2" else [S, S, F, S], sharp=False)
    recorder = PreRopeKeys(model, monkeypatch)
    cache = SinkCache.for_model(model, start_size=4, recent_size=24, evict_block=8)
    with torch.no_grad():
        model(input_ids=torch.tensor([random_ids(24)]), cache=cache, use_cache=True)
    if layer is BufferLayer:
        assert adopt_layers(cache) and all(type(x) is BufferLayer for x in cache.layers)
    assert cache.evict_for_space(10) == (4, 10)  # 24 + 10 - 28 = 6 tokens, one block
    assert_keys_are_rerotated_per_layer(recorder, cache, [*range(4), *range(10, 24)])


@pytest.mark.parametrize("wrong", [F, S])
def test_negative_control_one_rope_for_all_gemma3_layers_is_wrong(wrong, monkeypatch):
    """The same check fails when every layer is re-rotated with one layer type's rope (the
    global one, as a cache reading a single `inv_freq` would; or the local one)."""
    model = gemma("gemma3", [S, S, F, S], sharp=False)
    recorder = PreRopeKeys(model, monkeypatch)
    inv_freq = getattr(model.model.rotary_emb, f"{wrong}_inv_freq")
    cache = SinkCache(num_layers=4, inv_freq=inv_freq, start_size=4, recent_size=24, evict_block=8)
    with torch.no_grad():
        model(input_ids=torch.tensor([random_ids(24)]), cache=cache, use_cache=True)
    assert cache.evict_for_space(10) == (4, 10)
    kept = [*range(4), *range(10, 24)]
    with pytest.raises(AssertionError):
        assert_keys_are_rerotated_per_layer(recorder, cache, kept)
    # and precisely on the layers of the other type
    pre = recorder.per_layer()
    for i, kind in enumerate(model.config.layer_types):
        same = torch.allclose(cache.layers[i].keys, recorder.reference(i, pre[i][:, :, kept]), atol=1e-4)
        assert same == (kind == wrong), (i, kind)


# --- through the session, as `chatbot run --enable-streaming --opt off` -----------------------


def session_for(model, tokenizer, **engine) -> ChatSession:
    config = ChatConfig(sampling=GREEDY, engine=EngineConfig(enable_streaming=True, **engine))
    return ChatSession(Engine(model, tokenizer), config)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("kind", [S, F])
def test_session_tokens_equal_transformers_on_the_kept_window(arch, kind, tiny_tokenizer):
    """A one-layer model in a streaming chat: every answer token is transformers' greedy
    choice over the ids the cache holds at that moment (a fresh forward pass at positions
    0..n-1), across evictions and two turns. With a sliding layer the default recent window
    is the one that fits the window (a full layer has none: 24 is asked for)."""
    model = gemma(arch, [kind], vocab=len(tiny_tokenizer))
    session = session_for(model, tiny_tokenizer, **({} if kind == S else {"recent_size": 24}))
    assert session.capacity == 28 <= WINDOW
    checked = 0
    for text in ("Hello there! How are you today?", "The quick brown fox jumps."):
        for chunk in session.send(text):
            for token in chunk.token_ids:  # stream_interval 1: the cache holds what chose it
                assert token == int(full_logits(model, session.cache_ids)[-1].argmax())
                checked += 1
    assert session.evicted_total > 0 and checked >= 40
    assert len(session.cache_ids) <= session.capacity


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_session_keeps_every_layers_keys_at_the_right_positions(arch, tiny_tokenizer, monkeypatch):
    """A four-layer model in a streaming chat with a pinned system prompt: after the
    conversation every layer's cached keys are transformers' rope of that layer's type at
    positions 0..n-1 over the kept tokens (the pinned head and the newest ones)."""
    layers = [S, F, S, F] if arch == "gemma2" else [S, S, F, S]
    model = gemma(arch, layers, vocab=len(tiny_tokenizer), window=64)
    recorder = PreRopeKeys(model, monkeypatch)
    config = ChatConfig(
        system="Be brief.", sampling=GREEDY, engine=EngineConfig(enable_streaming=True, start_size=4)
    )
    session = ChatSession(Engine(model, tiny_tokenizer), config)
    for text in ("Hello there! How are you today?", "The quick brown fox jumps.", "Café, naïve."):
        list(session.send(text))
    kv = session.kv
    assert session.evicted_total > 0 and kv.pinned > 4  # the system prompt is pinned
    n, pinned = len(kv.ids), kv.pinned
    kept = [*range(pinned), *range(len(kv.seen) - (n - pinned), len(kv.seen))]
    assert [kv.seen[i] for i in kept] == kv.ids
    assert_keys_are_rerotated_per_layer(recorder, session.cache, kept)


# --- refusal and the default window ------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_cache_larger_than_the_window_is_refused_naming_the_recent_size_that_fits(arch):
    model = gemma(arch, [S, F])
    assert streaming_window(model) == WINDOW
    with pytest.raises(StreamingUnsupportedError) as info:
        SinkCache.for_model(model, start_size=4, recent_size=40)
    message = str(info.value)
    assert "\n" not in message and "--" not in message  # the engine's words: no flag named
    assert f"sliding window of {WINDOW} tokens" in message and info.value.recent_fits == 28
    # the command line names the flag and the window that fits
    assert in_user_words(info.value).endswith("; use --recent-size 28 or less")
    assert in_user_words(info.value).startswith("--enable-streaming: the attention-sink cache must lie")
    SinkCache.for_model(model, start_size=4, recent_size=28)  # exactly the window: accepted
    with pytest.raises(StreamingUnsupportedError) as info:
        check_streaming_support(model, capacity=33, start_size=8)
    assert in_user_words(info.value).endswith("; use --recent-size 24 or less")
    with pytest.raises(StreamingUnsupportedError) as info:
        check_streaming_support(model, capacity=40, start_size=32)
    assert in_user_words(info.value).endswith("; use fewer --start-size tokens")


def test_only_full_attention_layers_need_no_window():
    model = gemma("gemma3", [F, F])
    assert streaming_window(model) is None
    SinkCache.for_model(model, start_size=4, recent_size=400)


def test_default_recent_size_fits_the_window():
    assert default_recent_size(8192) == 2000  # unchanged without a window
    assert default_recent_size(8192, window=4096) == 2000  # gemma2: 2004 fits in 4096
    assert default_recent_size(32768, window=512) == 384  # gemma3-1b: a quarter left for the head
    assert default_recent_size(131072, window=1024, start_size=4) == 768  # gemma3-4b
    assert default_recent_size(512, window=WINDOW, start_size=4) == 24
    assert default_recent_size(512, window=WINDOW, start_size=12) == 20


def test_a_long_system_prompt_is_pinned_only_as_far_as_the_window_allows(tiny_tokenizer):
    model = gemma("gemma3", [S, F], vocab=len(tiny_tokenizer))
    config = ChatConfig(
        system="You are a helpful assistant. Answer briefly and clearly. " * 3,
        sampling=GREEDY,
        engine=EngineConfig(enable_streaming=True, start_size=4),
    )
    session = ChatSession(Engine(model, tiny_tokenizer), config)
    assert session.system_prompt_tokens() > WINDOW
    assert session.kv.recent_size == 24 and session.kv.pinned == WINDOW - 24
    chunks = list(session.send("Hello there!"))
    assert chunks[-1].finish_reason == "length" and session.evicted_total > 0


# --- the CLI -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    from helpers import make_tokenizer

    folder = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    tok = make_tokenizer()
    gemma("gemma3", [S, S, F], vocab=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_chat(capsys, monkeypatch, folder, lines, *args):
    piped = "".join(line + "\n" for line in lines).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(piped), encoding="utf-8"))
    return cli(capsys, "run", "--model", str(folder), "--device", "cpu", "--temperature", "0",
               "--max-new-tokens", "30", "--opt", "off", "--enable-streaming", *args)  # fmt: skip


def test_cli_streams_gemma3_with_a_recent_window_that_fits(capsys, monkeypatch, gemma3_dir):
    code, out, err = run_chat(capsys, monkeypatch, gemma3_dir, ["Hello there! How are you?", "/cache"])
    assert code == 0, err
    assert "keeps 4 sinks + 24 recent tokens" in out + err
    assert "Traceback" not in out + err


def test_cli_refuses_a_recent_size_beyond_the_window_in_one_line(capsys, gemma3_dir):
    assert_one_line_error(
        capsys,
        "run",
        "--model",
        str(gemma3_dir),
        "--device",
        "cpu",
        "--opt",
        "off",
        "--enable-streaming",
        "--recent-size",
        "40",
        match="--recent-size 28 or less",
    )
