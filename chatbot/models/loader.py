"""Find and load a model: the embedded default, a transformers folder, a GGUF file, a hub id.

A GGUF file of a llama, mistral, qwen2, qwen3, gemma2 or gemma3 model is run as it is on the
CPU: its matrices stay in their block formats on a memory map of the file (`gguf_model`), with
the config and tokenizer read from its metadata (cached, a few MB). Other GGUF files, or any GGUF with a GPU,
`--quantize` or a dtype other than float32, are dequantized by transformers once and a
converted copy (safetensors + tokenizer files) is kept in the user's cache directory, keyed
by the file's content hash. A copy whose manifest does not match its files is rebuilt.

The checks and options before a load are in `load_checks`, the GGUF checks and the conversion
cache in `gguf_convert`; their public names are importable from here as before.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chatbot.errors import ModelLoadError, first_line
from chatbot.models.gc_pause import paused_gc
from chatbot.models.gguf_convert import (
    MANIFEST,  # noqa: F401  (imported from here by catalog)
    cache_root,
    convert_gguf,
    converted_dir,
    manifest_ok,
    writable_target,
)
from chatbot.models.load_checks import (
    LoadOptions,
    check_causal,
    check_safetensors,
    disk_size,
    is_oom,
    parse_device_map,
    parse_max_memory,
    pick_device,
    pick_dtype,
    quiet_transformers,
)
from chatbot.models.quantize import bnb_config, check_quantization, compute_dtype, describe_quantization
from chatbot.models.source import (  # noqa: F401 - the defaults are imported from here too
    DEFAULT_GGUF,
    DEFAULT_NAME,
    DEFAULT_PACKAGE,
    check_gguf,
    check_source,
    default_gguf_path,
)
from chatbot.models.template_budget import install as install_template_budget

if TYPE_CHECKING:  # templates imports transformers: inside `load_model`, with the collector paused
    from chatbot.models.templates import TemplateInfo


@dataclass
class LoadedModel:
    """A model and tokenizer ready for the engine, with what the banner shows."""

    model: Any
    tokenizer: Any
    name: str
    source: str
    kind: str  # "default", "gguf", "folder", "hub"
    load_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    template: TemplateInfo | None = None

    @property
    def device(self) -> torch.device:
        """Where the input ids go: the embedding's device (the first of a device map)."""
        weight = self.model.get_input_embeddings().weight
        if weight.device.type == "meta":  # offloaded to disk: accelerate runs it on the CPU
            return torch.device("cpu")
        return weight.device

    @property
    def devices(self) -> list[str]:
        """Every device holding part of the model, in first-use order ("disk" for offload)."""
        placed = getattr(self.model, "hf_device_map", None)
        if isinstance(placed, dict) and placed:
            seen: list[str] = []
            for where in placed.values():
                name = f"cuda:{where}" if isinstance(where, int) else str(where)
                if name not in seen:
                    seen.append(name)
            return seen
        return [str(self.device)]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def num_parameters(self) -> int:
        """Parameters as the model was trained (a 4-bit tensor packs two per byte)."""
        from chatbot.engine.backends.native.packed import packed_parameters

        total = packed_parameters(self.model)  # a GGUF model's matrices, in their blocks
        for p in self.model.parameters():
            n = p.numel()
            if type(p).__name__ == "Params4bit":
                n *= 2
            total += n
        return total

    @property
    def context_limit(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)

    @property
    def quantization(self) -> str:
        """The weights' format: a GGUF file's block formats (as stored: e.g. "GGUF 210 q4_1 +
        1 q8_0 matrices"), else what the config says ("none" for plain floats)."""
        from chatbot.engine.backends.native.packed import packed_formats

        formats = packed_formats(self.model)
        if formats:
            mats = " + ".join(f"{n} {name}" for name, n in sorted(formats.items(), key=lambda kv: -kv[1]))
            return f"GGUF {mats} matrices"
        return describe_quantization(self.model.config)

    def describe(self) -> dict[str, str]:
        dtype = str(self.dtype).removeprefix("torch.")
        quantization = self.quantization
        return {
            "model": self.name,
            "source": self.source,
            "parameters": _count(self.num_parameters),
            # block-quantized weights compute in this dtype (the activations'), not stored in it
            "dtype": f"{dtype} compute" if quantization.startswith("GGUF") else dtype,
            "device": ", ".join(self.devices),
            "quantization": quantization,
            "context": str(self.context_limit),
            "template": self.template.label()
            if self.template
            else ("chat template" if getattr(self.tokenizer, "chat_template", None) else "none"),
            "load time": f"{self.load_time_s:.1f} s",
        }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _load_folder(folder: Path, opts: LoadOptions, where: str | None = None) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = where or str(folder)
    trust = {"trust_remote_code": opts.trust_remote_code}
    with quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(str(folder), **trust)
        except Exception as exc:
            if "trust_remote_code" in str(exc):
                raise ModelLoadError(
                    f"{where} contains its own model code, which is not run by default: "
                    "rerun with --trust-remote-code if you trust its author"
                ) from exc
            raise ModelLoadError(f"cannot read the model config in {where}: {first_line(exc)}") from exc
        check_causal(config, where)
        prequantized = getattr(config, "quantization_config", None)
        if prequantized is not None and opts.quantize:
            raise ModelLoadError(
                f"{where} is already quantized ({describe_quantization(config)}): drop --quantize"
            )
        check_safetensors(folder)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), **trust)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the tokenizer in {where}: {first_line(exc)}") from exc
        kwargs: dict[str, Any] = {"config": config, "dtype": opts.dtype, **trust}
        if opts.quantize:
            kwargs["quantization_config"] = bnb_config(opts.quantize, opts.dtype)
        device_map = opts.device_map
        if device_map is None and (opts.quantize or prequantized is not None):
            device_map = {"": str(opts.device)}  # quantized weights are placed while loading
        if device_map is not None:
            kwargs["device_map"] = device_map
            kwargs["offload_folder"] = str(cache_root() / "offload" / folder.name)
            if opts.max_memory:
                kwargs["max_memory"] = opts.max_memory
        try:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                str(folder), output_loading_info=True, **kwargs
            )
            model, info = loaded
            _check_loading_info(info, where, quantized=bool(opts.quantize or prequantized is not None))
            if device_map is None:
                model.to(opts.device)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise _load_error(exc, where, folder, config, opts) from exc
    if model.get_input_embeddings().weight.device.type == "meta":
        # The token ids must go to a real device; offloaded embeddings leave none.
        raise ModelLoadError(
            f"the device map offloads the input embeddings of {where} to disk: give the first "
            "device more room with --max-memory"
        )
    model.eval()
    return model, tokenizer


def _check_loading_info(info: dict[str, Any], where: str, quantized: bool) -> None:
    """Refuse a folder whose weights do not fill the model its config describes: transformers
    would initialise the missing ones at random (a config of 4 layers over the weights of 2
    answers nonsense) and drop the unexpected ones. Tied weights and the buffers a model
    class marks optional are already left out of transformers' lists.

    Raises:
        ModelLoadError: naming the first missing (or unexpected) weight and the count.
    """
    for kind in ("missing", "unexpected"):
        names = sorted(info.get(f"{kind}_keys") or ())
        if kind == "unexpected" and quantized:
            continue  # a quantizer's own tensors (absmax, quant_state...) are its business
        if names:
            what = "lacks" if kind == "missing" else "holds"
            extra = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise ModelLoadError(
                f"{where} {what} weights its config.json does not match: {kind} {names[0]}{extra}; "
                "the folder is incomplete or its config is wrong"
            )


def _load_error(exc: Exception, where: str, folder: Path, config: Any, opts: LoadOptions) -> ModelLoadError:
    """One line for an exception of `from_pretrained`."""
    if is_oom(exc):
        gb = disk_size(folder) / 1e9
        return ModelLoadError(
            f"not enough memory to load {where} ({gb:.1f} GB of weights on disk, as "
            f"{str(opts.dtype).removeprefix('torch.')} on {opts.device}): try --quantize 4bit, "
            "--dtype bfloat16, or --device-map auto with --max-memory"
        )
    if isinstance(exc, ImportError):
        method = describe_quantization(config)
        what = f"a {method} checkpoint" if method != "none" else "this model"
        return ModelLoadError(f"{where} is {what}, which needs a package that is missing: {first_line(exc)}")
    if isinstance(exc, ValueError) and "Unrecognized configuration class" in str(exc):
        return ModelLoadError(
            f"{where} holds a {config.model_type} model, which is not a causal language model and cannot chat"
        )
    return ModelLoadError(f"cannot load the model in {where}: {first_line(exc)}")


def _nonfinite_weight(model: Any) -> str | None:
    """The name of the first parameter holding NaN or infinity (damage a size check cannot
    see), or None."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.device.type != "meta" and not bool(torch.isfinite(p).all()):
                return name
    return None


def _packable(opts: LoadOptions) -> bool:
    """The block-format model runs on the CPU in float32 activations, on one device."""
    return (
        opts.device.type == "cpu" and opts.dtype == torch.float32 and not opts.quantize
        and opts.device_map is None
    )  # fmt: skip


def _kernels_load(gguf: Path, notes: list[str]) -> bool:
    """Whether the native kernels build and load (a file run as stored needs them for every
    product); if not, a note says why and what the chat runs on instead."""
    from chatbot.engine.backends.native.kernels import KernelsUnavailable, load_library

    try:
        load_library()
    except KernelsUnavailable as exc:
        notes.append(f"{exc}; {gguf.name} runs through transformers from a dequantized copy (slower)")
        return False
    return True


def _load_gguf(gguf: Path, opts: LoadOptions, checked: bool = False) -> tuple[Any, Any, list[str]]:
    """A GGUF file as it is (`gguf_model`: its blocks on a memory map, no conversion), or,
    where that cannot run (another architecture, a GPU, --quantize, another dtype), through
    a dequantized copy converted once by transformers."""
    from chatbot.models.gguf_model import (
        NotPackable,
        build_packed_model,
        load_config_and_tokenizer,
        metadata_key,
    )

    notes: list[str] = []
    if not checked:
        check_gguf(gguf)
    _check_metadata(gguf)
    _check_finite(gguf)
    if _packable(opts) and _kernels_load(gguf, notes):
        try:
            with quiet_transformers():
                cache = cache_root() / "gguf-meta" / f"{gguf.stem}-{metadata_key(gguf)}"
                config, tokenizer = load_config_and_tokenizer(gguf, cache, notes)
        except Exception as exc:  # transformers raises many kinds for a file it cannot read
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from exc
        check_causal(config, str(gguf))
        try:
            with quiet_transformers():
                return build_packed_model(gguf, config), tokenizer, notes
        except NotPackable as exc:
            notes.append(f"{gguf.name} runs from a dequantized copy: {exc}")
        except Exception as exc:
            if is_oom(exc):
                raise ModelLoadError(f"not enough memory to map {gguf}: {first_line(exc)}") from exc
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from exc
    model, tokenizer, more = _load_gguf_converted(gguf, opts)
    return model, tokenizer, notes + more


def _check_metadata(gguf: Path) -> None:
    """Refuse a GGUF file whose metadata disagrees with its tensors (`gguf_metadata`)."""
    from chatbot.gguf.metadata import InconsistentMetadata, check_metadata

    try:
        check_metadata(gguf)
    except InconsistentMetadata as exc:
        raise ModelLoadError(f"cannot use GGUF file {gguf}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from exc


def _check_finite(gguf: Path) -> None:
    """Refuse a GGUF file with NaN or infinity in its norms, small float tensors, or the
    block scales of its embedding and output matrices (a few ms: `gguf_weights.check_finite`)."""
    from chatbot.engine.backends.native.gguf_weights import NonFiniteWeights, check_finite

    try:
        check_finite(gguf)
    except NonFiniteWeights as exc:
        raise ModelLoadError(
            f"cannot use GGUF file {gguf}: {exc}; the file is damaged, download it again"
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from exc


def _load_gguf_converted(gguf: Path, opts: LoadOptions) -> tuple[Any, Any, list[str]]:
    from chatbot.gguf.table import FileStamp, read_tensor_table

    arch, table = read_tensor_table(gguf)
    if any(t.file for t in table):
        raise ModelLoadError(
            f"{gguf.name} is a split file of architecture {arch!r}, which runs through transformers, "
            "and it reads whole files only: join the parts (llama.cpp's llama-gguf-split --merge)"
        )
    notes: list[str] = []
    stamp = FileStamp.of(gguf)  # the fast path maps the file's matrices
    target = converted_dir(gguf)
    if not manifest_ok(target):
        target = writable_target(target, notes)
        if target.exists():
            notes.append(f"converted copy in {target} was incomplete or corrupt; rebuilt it")
        else:
            notes.append(f"converted {gguf.name} once into {target}")
        convert_gguf(gguf, target)
    try:
        model, tokenizer = _load_folder(target, opts, str(gguf))
    except ModelLoadError as exc:
        if is_oom(exc.__cause__ or exc) or opts.quantize:
            raise
        # The files passed the size check but do not load: rebuild once, then trust the error.
        notes.append(f"converted copy in {target} did not load; rebuilt it")
        convert_gguf(gguf, target)
        model, tokenizer = _load_folder(target, opts, str(gguf))
    if not opts.quantize and _nonfinite_weight(model):
        # Sizes match but the numbers are damaged (NaN written into the file): rebuild once.
        notes.append(f"converted copy in {target} holds NaN or infinite weights; rebuilt it")
        del model
        convert_gguf(gguf, target)
        model, tokenizer = _load_folder(target, opts, str(gguf))
        bad = _nonfinite_weight(model)
        if bad:  # then the GGUF file itself holds them, where the load-time check does not look
            raise ModelLoadError(
                f"cannot use GGUF file {gguf}: its weights for {bad} hold NaN or infinity; "
                "the file is damaged, download it again"
            )
    # The fast decode path packs its matrices straight from this file, in their stored
    # formats (chatbot.engine.backends.native.gguf_weights), rather than from the float32 copy.
    model.chatbot_gguf = str(gguf)
    model.chatbot_file_stamp = stamp
    if getattr(getattr(model, "model", None), "rotary_emb", None) is not None:
        from chatbot.engine.backends.native.gguf_weights import GGUFWeights
        from chatbot.models.gguf_model import NotPackable, apply_rope_freqs

        try:
            apply_rope_freqs(model, GGUFWeights(gguf))  # Llama-3.1+ rope scaling
        except (NotPackable, ValueError, OSError) as exc:
            notes.append(f"rope scaling of {gguf.name} not applied: {exc}")
    return model, tokenizer, notes


@paused_gc()  # a third of the load is the collector walking what the imports create
def load_model(
    source: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    *,
    quantize: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: str | dict[Any, Any] | None = None,
    template: str | None = "auto",
) -> LoadedModel:
    """Load what `--model` names; None means the embedded default model.

    Args:
        source: a transformers folder, a .gguf file, a hub id, or None for the default.
        device: auto, cpu, cuda, cuda:N or mps (ignored for placement with `device_map`).
        dtype: auto, float32, bfloat16 or float16 (with `quantize`: the compute dtype).
        revision: a hub branch, tag or commit.
        trust_remote_code: run model code shipped with the checkpoint.
        quantize: "4bit" or "8bit" through bitsandbytes.
        device_map: accelerate's placement: "auto", "balanced", "sequential" or a JSON map.
        max_memory: per-device budget for `device_map`, e.g. "0=20GiB,cpu=64GiB".
        template: "auto", a fallback template name, or a .jinja file.

    Raises:
        ModelLoadError: with one line saying what is wrong and what to do.
        ConfigError: a malformed device map, memory budget or template name.
    """
    install_template_budget()  # the templates this load renders (and every later one)
    start = time.perf_counter()
    dev = pick_device(device)
    if quantize:
        torch_dtype = compute_dtype(quantize, dtype, dev)
        if dtype != "auto":
            pick_dtype(dtype, dev)  # validates the name
        check_quantization(quantize, dev, torch_dtype)
    else:
        torch_dtype = pick_dtype(dtype, dev)
    opts = LoadOptions(
        dev,
        torch_dtype,
        quantize,
        parse_device_map(device_map),
        parse_max_memory(max_memory),
        trust_remote_code,
        revision,
    )
    if opts.max_memory and opts.device_map is None:
        opts.device_map = "auto"
    notes: list[str] = []
    checked = check_source(source)
    if checked.kind == "hub-gguf":
        from chatbot.models.hub import parse_ref, resolve

        ref = parse_ref(checked.name)
        assert ref is not None
        checked = check_source(str(resolve(ref, revision, progress=True)))
    name, kind = checked.name, checked.kind
    if checked.path is None:
        model, tokenizer = _load_hub(checked.name, opts)
        where = checked.name + (f"@{revision}" if revision else "")
    elif kind == "folder":
        model, tokenizer = _load_folder(checked.path, opts)
        where = str(checked.path)
    else:
        model, tokenizer, notes = _load_gguf(checked.path, opts, checked=True)
        where = str(checked.path)
    from chatbot.models.templates import apply_template

    install_template_budget()  # (a no-op where the load did not import transformers)
    info = apply_template(tokenizer, model, template)
    if info.warning:
        notes.append(info.warning)
    logging.getLogger(__name__).debug("loaded %s", where)
    return LoadedModel(model, tokenizer, name, where, kind, time.perf_counter() - start, notes, info)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _load_hub(repo_id: str, opts: LoadOptions) -> tuple[Any, Any]:
    from huggingface_hub import snapshot_download

    from chatbot.models.hub import SMALL_FILES, pull_repo

    at = f"{repo_id}@{opts.revision}" if opts.revision else repo_id
    if not _hub_offline():  # as `chatbot pull`: what the hub names is checked, then downloaded
        folder, _ = pull_repo(repo_id, opts.revision)
        return _load_folder(folder, opts, at)
    try:
        cached = snapshot_download(
            repo_id,
            revision=opts.revision,
            local_files_only=True,
            allow_patterns=[*SMALL_FILES, "*.safetensors", "*.bin"],
        )
    except Exception as exc:
        raise ModelLoadError(
            f"{at} is not in the local hub cache and HF_HUB_OFFLINE is set: download it "
            "where the hub is reachable (chatbot pull), or give a local folder"
        ) from exc
    return _load_folder(Path(cached), opts, at)
