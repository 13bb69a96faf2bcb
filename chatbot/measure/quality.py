"""How close a decode path's next-token distributions are to float32's, on the same tokens:
perplexity, the KL divergence from the float32 reference, and how often its most likely token
is the reference's (`chatbot bench decode --ppl-tokens N`).

The reference is transformers' forward pass in float32 on the loaded model (`--opt off`),
written once per run to a file (`write_reference`); every set-up, llama.cpp included, is then
fed those very token ids one at a time, as it decodes, and judged position by position
(`Judge`), so that no tokenizer or batching difference enters the comparison.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def write_reference(loaded: Any, ids: list[int], path: Path) -> None:
    """The float32 log-probabilities of `ids` (each position's next token) from one
    transformers forward pass, saved to `path` (.npz: `ids`, `logprobs`)."""
    import torch

    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits.double(), -1).numpy()  # float32 would be ~1e-5 nats off
    np.savez(path, ids=np.asarray(ids, dtype=np.int64), logprobs=logprobs.astype(np.float32))


class Judge:
    """Scores one set-up's logits, position by position, against the saved reference."""

    def __init__(self, reference: str | Path) -> None:
        data = np.load(reference)
        self.ids: list[int] = [int(x) for x in data["ids"]]
        self.reference = data["logprobs"]
        self.nll = self.kl = 0.0
        self.same_top = self.count = 0
        self.gaps: list[float] = []  # per position: the reference's log-probability of the next id less ours

    def add(self, logits: np.ndarray) -> None:
        """The logits after the first `count + 1` ids (the next position's)."""
        row = np.asarray(logits, dtype=np.float64)[: self.reference.shape[1]]
        row = row - row.max()
        logp = row - math.log(np.exp(row).sum())
        ref = self.reference[self.count].astype(np.float64)
        nxt = self.ids[self.count + 1]
        self.nll -= float(logp[nxt])
        self.gaps.append(float(ref[nxt] - logp[nxt]))
        self.kl += float(np.sum(np.exp(ref) * (ref - logp)))
        self.same_top += int(np.argmax(logp) == np.argmax(ref))
        self.count += 1

    def result(self) -> dict[str, float]:
        """{"ppl", "kl" (mean, nats), "top1" (share of positions), "ppl_se", "ref_ppl"} over
        what was added. ``ref_ppl`` is float32's perplexity on the same positions; ``ppl_se``
        the standard error of log(ppl / ref_ppl) from the spread of the per-position gaps:
        how far chance alone moves a perplexity's distance from float32's on a text of this
        length (perplexity is one token's probability per position, KL the whole
        distribution's, so the KL column is the steadier of the two)."""
        n = max(self.count, 1)
        gaps = np.asarray(self.gaps or [0.0])
        se = float(gaps.std(ddof=1) / math.sqrt(len(gaps))) if len(gaps) > 1 else 0.0
        ref_nll = self.nll - float(gaps.sum()) if self.gaps else self.nll
        return {"ppl": math.exp(self.nll / n), "kl": self.kl / n, "top1": self.same_top / n,
                "ppl_se": se, "ref_ppl": math.exp(ref_nll / n)}  # fmt: skip


def judge_decoder(model: Any, decoder: Any, reference: str | Path) -> dict[str, float]:
    """The native decoder (`decoder`, or transformers' forward pass when None) fed the
    reference's ids one token at a time, judged against it."""
    import torch

    judge = Judge(reference)
    ids = judge.ids
    with torch.inference_mode():
        if decoder is None:  # transformers' own step, with its cache
            out = model(input_ids=torch.tensor([ids[:1]]), use_cache=True)
            for i in range(1, len(ids)):
                judge.add(out.logits[0, -1].float().numpy())
                if i + 1 < len(ids):
                    step = torch.tensor([[ids[i]]])
                    out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
            return judge.result()
        cache = decoder.new_cache()
        first = torch.tensor([ids[:1]])
        logits = decoder.prefill_model(input_ids=first, cache=cache, use_cache=True).logits[0, -1]
        for i in range(1, len(ids)):
            judge.add(logits.float().numpy())
            if i + 1 < len(ids):
                logits = decoder.decode(cache, ids[i])
    return judge.result()


def judge_llama_cpp(llm: Any, reference: str | Path) -> dict[str, float]:
    """llama.cpp (a llama-cpp-python `Llama`) fed the reference's ids one token at a time."""
    judge = Judge(reference)
    vocab = llm.n_vocab()
    llm.reset()
    for token in judge.ids[:-1]:
        llm.eval([token])
        judge.add(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).copy())
    return judge.result()
