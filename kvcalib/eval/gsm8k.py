"""GSM8K-100 accuracy with greedy generation through the compressed cache.

Prompt (``n_shot`` worked examples, then the problem)::

    Question: <shot question>
    Answer: <shot solution, calculator annotations <<...>> removed, ending "#### 72">

    ...
    Question: <problem>
    Answer:

The shots are the first ``n_shot`` of the 100 embedded problems; they are never scored, so at
most ``100 - n_shot`` problems are (``limit`` caps that count). With shots the prompt is several
hundred tokens, so most of it is compressed before the first generated token reads it (the
prompt is prefilled in full precision and flushed right after its own attention).

Decoding is greedy, batch 1, up to ``max_new_tokens``; it stops at EOS, at the next
"Question:", or once a "#### <number>" line is complete. The answer is the number after the
last "####" if there is one, else the last number in the completion; it is correct when it
equals the reference number (commas, "$" and trailing zeros ignored). Small models score near
zero here; that is their honest score.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvcalib.recipe import Recipe

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_CALC = re.compile(r"<<[^>]*>>")
_DONE = re.compile(r"####\s*-?\$?\d[\d,]*(?:\.\d+)?\s*\n")


@dataclass(frozen=True)
class Gsm8kResult:
    accuracy: float
    n_problems: int
    predictions: list[str | None]  # extracted answers, in problem order
    completions: list[str]


def normalize_number(text: str) -> str | None:
    """"$1,234.50" -> "1234.5"; "18." -> "18"; not a number -> None."""
    s = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        val = float(s)
    except ValueError:
        return None
    if val == int(val) and abs(val) < 1e15:
        return str(int(val))
    return repr(val)


def extract_answer(completion: str) -> str | None:
    """The model's final number: after the last "####" if present, else the last number."""
    text = completion.split("Question:")[0]
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER.search(tail)
        if m:
            return normalize_number(m.group(0))
    nums = _NUMBER.findall(text)
    return normalize_number(nums[-1]) if nums else None


def is_correct(prediction: str | None, reference: str) -> bool:
    gold = normalize_number(reference)
    if prediction is None or gold is None:
        return False
    return abs(float(prediction) - float(gold)) < 1e-6


def format_shot(question: str, solution: str) -> str:
    return f"Question: {question.strip()}\nAnswer: {_CALC.sub('', solution).strip()}\n\n"


def build_gsm8k_prompt(question: str, shots: Sequence[tuple[str, str]] = ()) -> str:
    """Few-shot prompt text for ``question``; ``shots`` = (question, solution) pairs."""
    return "".join(format_shot(q, s) for q, s in shots) + f"Question: {question.strip()}\nAnswer:"


def _stop_fn(tokenizer) -> Callable[[torch.Tensor], bool]:
    eos = getattr(tokenizer, "eos_token_id", None)

    def stop(new: torch.Tensor) -> bool:  # new: (1, n)
        if eos is not None and int(new[0, -1]) == eos:
            return True
        text = tokenizer.decode(new[0], skip_special_tokens=True)
        return "Question:" in text or bool(_DONE.search(text))

    return stop


@torch.no_grad()
def gsm8k_accuracy(model, tokenizer, recipe: Recipe | None = None, limit: int = 100, n_shot: int = 4,
                   max_new_tokens: int = 256,
                   on_item: Callable[[int], None] | None = None) -> Gsm8kResult:
    """Accuracy of greedy generation (``recipe=None``: full precision) on the embedded GSM8K-100."""
    from kvcalib.data import load_gsm8k_100
    from kvcalib.eval.agreement import greedy_decode
    from kvcalib.runtime.cache import CompressedCache

    problems = load_gsm8k_100()
    if not 0 <= n_shot < len(problems):
        raise ValueError(f"n_shot must lie in [0, {len(problems) - 1}], got {n_shot}")
    shots = [(p.question, p.answer_text) for p in problems[:n_shot]]
    scored = problems[n_shot:][:limit]
    bos = getattr(tokenizer, "bos_token_id", None)
    stop = _stop_fn(tokenizer)
    preds: list[str | None] = []
    completions: list[str] = []
    for p in scored:
        ids = ([bos] if bos is not None else []) + list(
            tokenizer(build_gsm8k_prompt(p.question, shots), add_special_tokens=False)["input_ids"])
        prompt = torch.tensor([ids], dtype=torch.long)  # (1, P)
        cache = CompressedCache.from_recipe(model, recipe) if recipe is not None else None
        new = greedy_decode(model, [prompt], max_new_tokens, cache, stop)  # (1, n)
        text = tokenizer.decode(new[0], skip_special_tokens=True)
        completions.append(text)
        preds.append(extract_answer(text))
        if on_item is not None:
            on_item(1)
    correct = sum(is_correct(pr, p.final_answer) for pr, p in zip(preds, scored))
    return Gsm8kResult(correct / max(len(scored), 1), len(scored), preds, completions)


__all__ = ["Gsm8kResult", "build_gsm8k_prompt", "extract_answer", "gsm8k_accuracy", "is_correct",
           "normalize_number"]
