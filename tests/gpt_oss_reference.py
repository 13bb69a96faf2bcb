"""A float32 forward pass of a gpt-oss GGUF file, written here in torch from the model's
published definition (not from the package's code), as the tests' reference.

Every tensor is dequantized by the `gguf` package (MXFP4 experts included). The layer, as
OpenAI's and transformers' gpt-oss compute it and as llama.cpp names it in a GGUF file:
RMSNorm (``attn_norm``), q/k/v with biases, the NeoX rotation with YaRN frequencies (scaled
by 0.1 ln(factor) + 1), attention over the causal positions (those within the window on the
even layers) whose softmax also counts a learned sink logit per head (``attn_sinks``), the
output with its bias; RMSNorm (``post_attention_norm``), the router with its bias, the top k
logits' softmax as the experts' weights, each expert's gate and up with their biases, the
clamped SwiGLU (min(gate, 7) * sigmoid(1.702 * min(gate, 7)) * (clamp(up, -7, 7) + 1)), the
down projection with its bias.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize


class GptOssReference:
    """The file's weights in float32, and `logits(ids)` of a whole sequence."""

    def __init__(self, path: Path) -> None:
        reader = GGUFReader(str(path))

        def meta(key: str, default: object = None) -> object:
            field = reader.fields.get(f"gpt-oss.{key}")
            return default if field is None else field.contents()

        self.w = {
            t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            for t in reader.tensors
        }
        self.layers = int(meta("block_count"))
        self.heads, self.kv_heads = int(meta("attention.head_count")), int(meta("attention.head_count_kv"))
        self.head_dim = int(meta("attention.key_length"))
        self.eps = float(meta("attention.layer_norm_rms_epsilon"))
        self.window = int(meta("attention.sliding_window"))
        self.used = int(meta("expert_used_count"))
        self.theta = float(meta("rope.freq_base"))
        self.factor = float(meta("rope.scaling.factor", 1.0))
        self.original = int(meta("rope.scaling.original_context_length", 4096))

    def rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim / 2] of YaRN: each frequency a blend of the interpolated
        (divided by the factor) and the original, by where its wavelength falls between the
        corrections of 32 and 1 rotations in the original context."""
        d = self.head_dim
        base = self.theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

        def corr(rotations: float) -> float:
            return d * math.log(self.original / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = max(0.0, math.floor(corr(32.0))), min(d - 1.0, math.ceil(corr(1.0)))
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: the original frequency (short wavelengths), 0: interpolated
        freqs = base / self.factor * (1 - keep) + base * keep
        angles = torch.arange(n, dtype=torch.float64)[:, None] * freqs[None]
        scale = 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        return (angles.cos() * scale).float(), (angles.sin() * scale).float()

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] of every position."""
        n, D, H, K = len(ids), self.head_dim, self.heads, self.kv_heads
        w = self.w
        x = w["token_embd.weight"][torch.tensor(ids)]
        cos, sin = self.rope(n)

        def rotate(t: torch.Tensor) -> torch.Tensor:  # [heads, n, D], NeoX halves
            a, b = t[..., : D // 2], t[..., D // 2 :]
            return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

        pos = torch.arange(n)
        for i in range(self.layers):
            b = f"blk.{i}."
            h = self.norm(x, b + "attn_norm.weight")
            q = (h @ w[b + "attn_q.weight"].T + w[b + "attn_q.bias"]).view(n, H, D).transpose(0, 1)
            k = (h @ w[b + "attn_k.weight"].T + w[b + "attn_k.bias"]).view(n, K, D).transpose(0, 1)
            v = (h @ w[b + "attn_v.weight"].T + w[b + "attn_v.bias"]).view(n, K, D).transpose(0, 1)
            q, k = rotate(q), rotate(k)
            k, v = k.repeat_interleave(H // K, 0), v.repeat_interleave(H // K, 0)
            scores = q @ k.transpose(1, 2) / math.sqrt(D)
            seen = pos[None, :] <= pos[:, None]
            if i % 2 == 0:  # the sliding layers: the last `window` positions
                seen &= pos[:, None] - pos[None, :] < self.window
            scores = scores.masked_fill(~seen, float("-inf"))
            sinks = w[b + "attn_sinks.weight"].view(H, 1, 1).expand(H, n, 1)
            probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
            att = (probs @ v).transpose(0, 1).reshape(n, H * D)
            x = x + att @ w[b + "attn_output.weight"].T + w[b + "attn_output.bias"]
            h = self.norm(x, b + "post_attention_norm.weight")
            x = x + self.experts(h, b)
        x = self.norm(x, "output_norm.weight")
        return x @ w["output.weight"].T

    def experts(self, h: torch.Tensor, b: str) -> torch.Tensor:
        w = self.w
        router = h @ w[b + "ffn_gate_inp.weight"].T + w[b + "ffn_gate_inp.bias"]
        top, chosen = router.topk(self.used, dim=-1)
        weights = torch.softmax(top, dim=-1)
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(self.used):
                e = int(chosen[t, j])
                gate = w[b + "ffn_gate_exps.weight"][e] @ h[t] + w[b + "ffn_gate_exps.bias"][e]
                up = w[b + "ffn_up_exps.weight"][e] @ h[t] + w[b + "ffn_up_exps.bias"][e]
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = gate * torch.sigmoid(1.702 * gate) * (up + 1)
                down = w[b + "ffn_down_exps.weight"][e] @ act + w[b + "ffn_down_exps.bias"][e]
                out[t] += weights[t, j] * down
        return out
