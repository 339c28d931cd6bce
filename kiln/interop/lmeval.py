"""kiln's causal LMs behind lm-evaluation-harness's LM interface, so a directory or a run's checkpoint is
scored by lm-eval's tasks without an export.

`KilnLM` follows lm-eval's own HF backend (lm_eval.models.huggingface.HFLM) where scores depend on it:
contexts and continuations are tokenized by lm-eval's TemplateLM (trailing spaces of a context moved to
the continuation, the whole encoded then split), an empty context is the BOS (else EOS) token, inputs keep
their last `max_length` + 1 tokens, and rolling log-likelihoods use lm-eval's disjoint windows. Generation
runs on kiln.engine (greedy unless the task asks for sampling) and stops at the first `until` string.
`evaluate` runs lm-eval's `simple_evaluate` over task names or local task YAMLs (offline: the YAML's
data files are read from disk) and returns its results, JSON-ready.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import functional as F

from kiln.errors import KilnError

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
except ImportError:  # the eval extra is optional; evaluate() says how to get it
    TemplateLM = object
    lm_utils = None


class KilnLM(TemplateLM):
    """A kiln causal LM as an lm-eval LM: loglikelihood, loglikelihood_rolling, generate_until."""

    def __init__(self, model: Any, batch_size: int = 8, max_length: int | None = None, max_gen_toks: int = 256,
                 device: str | torch.device = "cpu"):
        if lm_utils is None:
            raise KilnError("kiln eval needs lm-evaluation-harness: pip install 'kiln[eval]'")
        super().__init__()
        if model.tokenizer is None:
            raise KilnError("the model has no tokenizer; lm-eval tasks are text")
        self.model = model.to(device).eval()
        self.tok = model.tokenizer
        self._device = torch.device(device)
        self.batch_size = batch_size
        self._max_length = max_length or getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_gen_toks = max_gen_toks

    # ---- what TemplateLM asks ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tok.token_id("eos_token")
        if eos is None:
            raise KilnError("the tokenizer has no eos_token; lm-eval needs one to end texts")
        return eos

    @property
    def prefix_token_id(self) -> int:
        bos = self.tok.token_id("bos_token")
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # None: the tokenizer's own post-processing (what HF's encode does by default), unless the text
        # already starts with the BOS it would add
        special = add_special_tokens if add_special_tokens is not None else True
        bos = self.tok.specials.get("bos_token")
        if add_special_tokens is None and bos and string.startswith(bos):
            special = False
        return list(self.tok.backend.encode(string, add_special_tokens=special).ids)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    # ---- scoring ---------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request."""
        rows = []
        for _, context_enc, continuation_enc in requests:
            if not continuation_enc:
                raise KilnError("lm-eval asked for the log-likelihood of an empty continuation")
            whole = (context_enc + continuation_enc)[-(self.max_length + 1):]
            rows.append((whole[:-1], len(continuation_enc)))
        out: list[tuple[float, bool]] = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), self.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (row, _) in enumerate(chunk):  # right padding: a row's positions are its own from 0
                ids[i, :len(row)] = torch.tensor(row)
                mask[i, :len(row)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            logprobs = F.log_softmax(logits.float(), dim=-1)
            for i, (row, n) in enumerate(chunk):
                cont = requests[start + i][2][-n:]
                lp = logprobs[i, len(row) - n:len(row)]  # the positions that predict the continuation
                want = torch.tensor(cont, device=lp.device)
                out.append((float(lp.gather(1, want[:, None]).sum()), bool((lp.argmax(-1) == want).all())))
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in lm-eval's disjoint windows of max_length tokens."""
        scores = []
        for (string,) in [r.args for r in requests]:
            windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            parts = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            scores.append(sum(lp for lp, _ in parts))
        return scores

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task's gen_kwargs say do_sample) continuations cut at `until`. Requests
        with the same settings run together through kiln.engine (continuous batching; the stop strings end a
        sequence as soon as one appears), or one by one through the model's loop for families it does not run."""
        from kiln.engine.continuer import Continuer

        jobs: dict[tuple, list[int]] = {}  # the generation settings -> the requests that share them
        settings, contexts = [], []
        for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok.decode([self.eot_token_id], skip_special_tokens=False)
            if eos_text not in until:
                until.append(eos_text)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            sample = do_sample or temperature > 0
            key = (max_new, (temperature if temperature > 0 else 1.0) if sample else 0.0,
                   int(kw.pop("top_k", 0) or 0), float(kw.pop("top_p", 1.0) or 1.0), tuple(until))
            settings.append(key)
            jobs.setdefault(key, []).append(i)
            contexts.append(self.tok_encode(context)[-(self.max_length - max_new):] if max_new < self.max_length
                            else self.tok_encode(context)[-1:])
        out = [""] * len(requests)
        eos = self.model.config.eos_token_id  # the model's own end tokens end a text too, as its generate loop does
        ends = [self.eot_token_id] + [t for t in ([eos] if isinstance(eos, int) else eos or []) if t != self.eot_token_id]
        for (max_new, temperature, top_k, top_p, until), members in jobs.items():
            run = Continuer(self.model, max_new, temperature, top_k, top_p, eos_token_ids=ends,
                            stop=tuple(u for u in until if u), max_seqs=max(1, min(64, len(members))))
            for i, new in zip(members, run.many([contexts[i] for i in members])):
                text = self.tok.decode(new, skip_special_tokens=False)
                for u in until:  # everything from the first stop string on is dropped, as lm-eval's HF backend does
                    text = text.split(u)[0]
                out[i] = text
        return out


def evaluate(model: Any, tasks: list[str], include: Sequence[str | os.PathLike[str]] | None = None, num_fewshot: int | None = None,
             limit: int | None = None, batch_size: int = 8, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """lm-eval's results for `tasks` (names, or names defined by YAMLs under `include`), JSON-ready."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local YAMLs read local files; nothing is fetched
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise KilnError("kiln eval needs lm-evaluation-harness: pip install 'kiln[eval]'") from None
    paths = [str(p) for p in include] if include else None
    manager = None
    if paths:  # indexing lm-eval's thousands of built-in YAMLs takes long: skip it when the local ones suffice
        manager = TaskManager(include_path=paths, include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = None
    manager = manager or TaskManager(include_path=paths)
    known = set(manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        raise KilnError(f"unknown lm-eval task(s): {', '.join(missing)}"
                        + ("" if include else "; give --include DIR for task YAMLs of your own"))
    lm = KilnLM(model, batch_size=batch_size, device=device)
    results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                              log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, bootstrap_iters=0)
    if results is None:
        raise KilnError("lm-eval returned no results (this process is not its rank 0)")
    return json.loads(json.dumps({k: results[k] for k in ("results", "versions", "n-shot", "configs")
                                  if k in results}, default=str))
