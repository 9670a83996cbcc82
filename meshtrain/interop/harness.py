"""lm-eval-harness drives a meshtrain model: `HarnessLM` is an `lm_eval.api.model.LM` (the optional
dependency `pip install meshtrain[eval]`), built from a run or a Hugging Face folder by
`meshtrain.eval.harness_lm` and handed to `lm_eval.simple_evaluate(model=..., tasks=[...])`.

- `loglikelihood`: each (context, continuation) pair encoded as lm-eval's `_encode_pair` does
  (meshtrain/data/tasks.py `encode_pair`) and rated by the compiled scorer (meshtrain/engine/scoring.py):
  (sum of the continuation's log-probabilities, whether greedy decoding would produce it).
- `loglikelihood_rolling`: a whole text's log-likelihood, the text cut into windows of `window`
  predicted tokens each seeing up to `window` tokens before it (lm-eval's `get_rolling_token_windows`
  with context_len 1), the first after the document-end prefix (EOS, or a newline for bytes).
- `generate_until`: greedy (or sampled: `do_sample`, `temperature`) continuations from the KV-cache
  generator (meshtrain/engine/decode.py), the context left-truncated to window - max_gen_toks, cut
  at the first of `until`.
"""
from __future__ import annotations

import numpy as np
from lm_eval.api.model import LM

from meshtrain.data.tasks import encode_pair
from meshtrain.data.tokenizer import document_end
from meshtrain.engine.decode import generate

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generate_until


def rolling_requests(tok, text: str, window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (context ids, continuation ids) windows whose log-likelihoods sum to the text's: each
    predicts the next `window` tokens (fewer at the end) given everything before it, which the
    scorer left-truncates to the window (the document-end prefix first)."""
    ids = np.asarray(tok.encode(text), np.int32)
    whole = np.concatenate([document_end(tok).astype(np.int32), ids])
    return [(whole[:start + 1], ids[start:start + window]) for start in range(0, len(ids), window)]


class HarnessLM(LM):
    """`model`, `params` (model order), `tok`, a `scorer` (meshtrain/engine/scoring.py `Scorer`, whose
    length is the window), `mesh` and `rules` for generation (None: one device)."""

    def __init__(self, model, params, tok, scorer, mesh=None, rules=None):
        super().__init__()
        self.model, self.params, self.tok, self.scorer = model, params, tok, scorer
        self.mesh, self.rules, self.window = mesh, rules, scorer.length

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.tok, *r.args[:2]) for r in requests]
        scores, greedy = self.scorer(self.params, pairs)
        return [(float(s), bool(g)) for s, g in zip(scores, greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows = [rolling_requests(self.tok, r.args[0], self.window) for r in requests]
        scores, _ = self.scorer(self.params, [w for text in windows for w in text])
        ends = np.cumsum([len(w) for w in windows])
        return [float(np.sum(scores[end - len(w):end])) for w, end in zip(windows, ends)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in requests:
            context, kwargs = r.args[0], dict(r.args[1] if len(r.args) > 1 else {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            ids = np.asarray(self.tok.encode(context), np.int32)[-max(1, self.window - max_new):]
            if not len(ids):
                ids = document_end(self.tok).astype(np.int32)
            new = generate(self.model, self.params, [ids], max_new, temperature=temperature,
                           eos_id=self.tok.eos_id, window=self.window, vocab=self.tok.vocab_size, mesh=self.mesh,
                           rules=self.rules)[0]
            text = self.tok.decode(new)
            cut = min((i for i in (text.find(s) for s in until if s) if i >= 0), default=len(text))
            out.append(text[:cut])
        return out
