"""The C interface of the native kernels: ctypes mirrors of the structs of csrc/kernels.h,
checked against the compiler's sizes (`check_abi`), and the argument types of its functions
(`declare_functions`).
"""

from __future__ import annotations

import ctypes
from typing import Any

from chatbot.errors import ChatbotError


class KernelsUnavailable(ChatbotError):
    """The native kernels cannot be built or loaded here (no compiler, unsupported CPU...)."""


class Mat(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("fmt", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("x8", ctypes.c_int32),
    ]


class Group(ctypes.Structure):
    """Row blocks of one product, each in its own format, and an optional bias."""

    _fields_ = [
        ("part", Mat * 3),
        ("bias", ctypes.c_void_p),
        ("n_parts", ctypes.c_int32),
        ("rows", ctypes.c_int32),
    ]


class ModelStruct(ctypes.Structure):
    _fields_ = [
        ("n_layers", ctypes.c_int32),
        ("dim", ctypes.c_int32),
        ("n_heads", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("ffn_dim", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("n_threads", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        ("rope_len", ctypes.c_int32),
        ("cap", ctypes.c_int32),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("embed", ctypes.POINTER(Mat)),
        ("lm_head", ctypes.POINTER(Mat)),
        ("final_norm", ctypes.c_void_p),
        ("attn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("ffn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("wqkv", ctypes.POINTER(Group)),
        ("wo", ctypes.POINTER(Group)),
        ("wgu", ctypes.POINTER(Group)),
        ("wdown", ctypes.POINTER(Group)),
        ("kcache", ctypes.POINTER(ctypes.c_void_p)),
        ("vcache", ctypes.POINTER(ctypes.c_void_p)),
        ("scratch", ctypes.c_void_p),
        ("act", ctypes.c_int32),
        ("act_i16_sites", ctypes.c_int32),
        ("q_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("k_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("post_attn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("post_ffn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("window", ctypes.POINTER(ctypes.c_int32)),
        ("rope_sel", ctypes.POINTER(ctypes.c_int32)),
        ("rope_cos2", ctypes.c_void_p),
        ("rope_sin2", ctypes.c_void_p),
        ("embed_scale", ctypes.c_float),
        ("attn_softcap", ctypes.c_float),
        ("final_softcap", ctypes.c_float),
        ("act_fn", ctypes.c_int32),
        ("n_experts", ctypes.c_int32),
        ("n_experts_used", ctypes.c_int32),
        ("norm_topk", ctypes.c_int32),
        ("expert_dim", ctypes.c_int32),
        ("router", ctypes.POINTER(Mat)),
        ("shexp_gu", ctypes.POINTER(Group)),
        ("shexp_down", ctypes.POINTER(Group)),
        ("shexp_gate", ctypes.POINTER(ctypes.c_void_p)),
        ("sinks", ctypes.POINTER(ctypes.c_void_p)),
        ("router_bias", ctypes.POINTER(ctypes.c_void_p)),
        ("exp_gu_bias", ctypes.POINTER(ctypes.c_void_p)),
        ("exp_down_bias", ctypes.POINTER(ctypes.c_void_p)),
    ]


ABI_MIRRORS: dict[str, type[ctypes.Structure]] = {"mat": Mat, "group": Group, "model": ModelStruct}
"""The C structs by the suffix of their exported size function (``chatbot_sizeof_<name>``)."""


def check_abi(lib: Any, mirrors: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Compare the size of every ctypes mirror with the C compiler's `sizeof` of its struct.

    A field added or retyped on one side only shifts the fields after it, and the kernels
    would then follow garbage pointers; a size check catches that before any call.

    Raises:
        KernelsUnavailable: a mirror whose size differs from the C struct's (names both).
    """
    for name, mirror in (mirrors or ABI_MIRRORS).items():
        fn = getattr(lib, f"chatbot_sizeof_{name}")
        fn.argtypes, fn.restype = [], ctypes.c_long
        c_size, py_size = int(fn()), ctypes.sizeof(mirror)
        if c_size != py_size:
            raise KernelsUnavailable(
                f"the native kernels do not match their Python side: struct {name} is {c_size} bytes "
                f"in csrc/kernels.h but {py_size} in kernels.py's {mirror.__name__}; update both together"
            )


def declare_functions(lib: ctypes.CDLL) -> None:
    """The argument and result types of the kernels' functions."""
    lib.chatbot_decode.argtypes = [
        ctypes.POINTER(ModelStruct),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.chatbot_decode.restype = ctypes.c_int
    lib.chatbot_scratch_floats.argtypes = [ctypes.POINTER(ModelStruct), ctypes.c_int]
    lib.chatbot_decode_batch.argtypes = [
        ctypes.POINTER(ModelStruct),
        ctypes.c_int,
        ctypes.c_void_p,  # tokens [B] int32
        ctypes.c_void_p,  # positions [B] int32
        ctypes.c_void_p,  # cache capacities [B] int32
        ctypes.c_void_p,  # key caches [B * n_layers] pointers
        ctypes.c_void_p,  # value caches
        ctypes.c_void_p,  # scratch
        ctypes.c_void_p,  # logits [B, vocab], or [vocab] with last_only
        ctypes.c_int,  # last_only: the last row's logits alone
        ctypes.c_int,  # threads
    ]
    lib.chatbot_decode_batch.restype = ctypes.c_int
    lib.chatbot_batch_scratch_floats.argtypes = [
        ctypes.POINTER(ModelStruct),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.chatbot_batch_scratch_floats.restype = ctypes.c_long
    lib.chatbot_max_experts_used.argtypes = []
    lib.chatbot_max_experts_used.restype = ctypes.c_long
    lib.chatbot_max_batch.argtypes = []
    lib.chatbot_max_batch.restype = ctypes.c_long
    lib.chatbot_scratch_floats.restype = ctypes.c_long
    lib.chatbot_matvec.argtypes = [
        ctypes.POINTER(Mat),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.chatbot_matvec.restype = None
    lib.chatbot_matmul.argtypes = [
        ctypes.POINTER(Mat),
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.chatbot_matmul.restype = ctypes.c_int
    lib.chatbot_matmul_x8.argtypes = lib.chatbot_matmul.argtypes
    lib.chatbot_experts.argtypes = [
        *([ctypes.POINTER(Mat)] * 3),
        ctypes.c_int,  # n_experts
        ctypes.c_void_p,  # x [n, hidden]
        ctypes.c_int,  # n
        ctypes.c_void_p,  # ids [n, k] int32
        ctypes.c_void_p,  # weights [n, k]
        ctypes.c_int,  # k
        *([ctypes.c_int] * 3),  # act_gu, act_down, act_fn
        ctypes.c_void_p,  # gate/up biases [n_experts, 2 width] or NULL
        ctypes.c_void_p,  # down biases [n_experts, hidden] or NULL
        ctypes.c_void_p,  # out [n, hidden]
        ctypes.c_int,  # threads
    ]
    lib.chatbot_experts.restype = ctypes.c_int
    lib.chatbot_matmul_x8.restype = ctypes.c_int
    lib.chatbot_matvec_scratch.argtypes = [ctypes.c_int]
    lib.chatbot_matvec_scratch.restype = ctypes.c_long
    lib.chatbot_dequantize.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_int]
    lib.chatbot_dequantize.restype = None
    lib.chatbot_rows.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.chatbot_rows.restype = None
    lib.chatbot_repack.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p]
    lib.chatbot_repack.restype = ctypes.c_int
    lib.chatbot_quantize.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.chatbot_quantize.restype = None
    lib.chatbot_openmp.argtypes, lib.chatbot_openmp.restype = [], ctypes.c_int
    lib.chatbot_int8_faster.argtypes, lib.chatbot_int8_faster.restype = (
        [ctypes.c_int, ctypes.c_int],
        ctypes.c_int,
    )
