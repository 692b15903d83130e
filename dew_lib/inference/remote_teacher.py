"""A distillation teacher behind an OpenAI/vLLM-compatible engine: its log-prob of each sampled id.

`RemoteTeacher(OpenAICompletion(name, client))` asks a vLLM (or `dew serve`) completions route for
`prompt_logprobs` of whole rows, prompt and completion together:

    {"model": name, "prompt": [[ids of row 1], [ids of row 2], ...], "max_tokens": 1, "prompt_logprobs": 0}

and reads each choice's `prompt_logprobs` (null for the first id, then per id a dict keyed by
token-id strings of `{"logprob", "rank", "decoded_token"}` that holds that id): the teacher's
log p(id_t | ids_<t) for every id after the first. `sampled_log_probs(batch)` does it for packed
rows (`input_ids`, `text_segment_ids`, `response_mask`) and returns them aligned to `input_ids`, so
`DistillObjective` reads the teacher's log-prob of the id at t beside the student's, 0 where
`response_mask` is 0. The engine reports its raw model's log-softmax (temperature 1).

It sends up to `rows_per_request` rows per request and `options.workers` requests at once, over
`openai_engine`'s HTTP layer (the same `openai` client, copied with `options`' timeouts and its own
retries off). There is no scheduler above a teacher to resubmit a failed request, so a request that
fails for a reason that may pass (a timeout, a dropped connection, HTTP 408, 429 or 5xx) is sent
again up to `retries` times, `backoff * 2**n` seconds apart; any other failure, and the last retry's,
raises `EngineError` naming the engine.

`context()` is the engine's `max_model_len` (given, or read once from GET /v1/models); a scoring
request holds a row's ids plus the one id the engine samples, so a row of W ids needs W + 1.
`check_tokenizer(tokenizer)` asks the engine's `POST /tokenize` (vLLM's, and `dew serve`'s) to
encode a probe text and refuses a teacher whose ids differ from `tokenizer`'s.

Not here: SGLang (its prompt log-probs are another request: `return_logprob`, `logprob_start_len`),
the teacher's top alternatives or whole distribution (what a JSD loss would need), chat routes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.inference.openai_engine import OpenAICompletion, _post
from dew_lib.inference.remote import EngineError, RemoteOptions, field
from dew_lib.options import integer, number

TRANSIENT = (408, 429)  # statuses that may pass; 5xx too
# What check_tokenizer asks both tokenizers to encode: words, digits, arithmetic, a newline,
# accents, a non-Latin script and an emoji, so byte-level and word-piece vocabularies differ on it.
PROBE = "Distil 12 + 30 = 42, then check:\n  Ünïcödé — naïve café, 東京, 🙂 done."


class RemoteTeacher:
    """The teacher's log-probs of given ids, from `completion`'s engine (see the module docstring).

    completion: the served teacher (provider "vllm": vLLM or `dew serve`). max_model_len: the
    engine's context when known (None: read from /v1/models). rows_per_request: rows batched in
    one request. options: workers and timeouts (`RemoteOptions`). retries, backoff: resends of a
    request that failed for a passing reason, and the first wait in seconds (doubling).
    """

    def __init__(self, completion: OpenAICompletion, *, max_model_len: int | None = None,
                 rows_per_request: int = 8, options: RemoteOptions | None = None, retries: int = 2,
                 backoff: float = 0.5):
        import openai

        if not isinstance(completion, OpenAICompletion):
            raise TypeError("RemoteTeacher.completion must be an OpenAICompletion(name, client), got "
                            f"{type(completion).__name__}")
        if completion.provider != "vllm":
            raise ValueError(f"RemoteTeacher reads vLLM's prompt_logprobs; provider={completion.provider!r} "
                             "asks for them another way. Serve the teacher with vLLM or `dew serve`")
        if max_model_len is not None:
            integer("RemoteTeacher.max_model_len", max_model_len)
        integer("RemoteTeacher.rows_per_request", rows_per_request)
        integer("RemoteTeacher.retries", retries, at_least=0)
        number("RemoteTeacher.backoff", backoff, at_least=0)
        options = RemoteOptions() if options is None else options
        if not isinstance(options, RemoteOptions):
            raise TypeError(f"RemoteTeacher.options must be a RemoteOptions, got {type(options).__name__}")
        client = completion.client.with_options(
            timeout=openai.Timeout(options.timeout, connect=options.connect_timeout), max_retries=0)
        self.completion = dataclasses.replace(completion, client=client)
        self.engine = completion.engine
        self.max_model_len = max_model_len
        self.rows_per_request, self.retries, self.backoff = rows_per_request, retries, float(backoff)
        self.options = options
        self._pool = concurrent.futures.ThreadPoolExecutor(options.workers, thread_name_prefix="dew-teacher")

    # ---- the engine ---------------------------------------------------------------------------

    def context(self) -> int | None:
        """The most ids one request may hold (prompt and sampled), or None when the engine does
        not say: `max_model_len`, else the served model's card in GET /v1/models (read once)."""
        if self.max_model_len is None:
            try:
                cards = self.completion.client.models.list().data
            except Exception as error:  # noqa: BLE001 - any failure to ask is the engine's
                raise EngineError(f"{self.engine} did not list its models: {error}") from error
            card = next((c for c in cards if getattr(c, "id", None) == self.completion.name), None)
            value = None if card is None else (card.model_extra or {}).get("max_model_len")
            self.max_model_len = int(value) if isinstance(value, int) else None
        return self.max_model_len

    def check_tokenizer(self, tokenizer) -> bool:
        """Refuse (ValueError) a teacher whose engine encodes `PROBE` otherwise than `tokenizer`
        (the student's, a Hugging Face tokenizer) does: its ids would mean other tokens. True once
        checked; False when the engine cannot tell (no /tokenize route, or served without a
        tokenizer), which the caller should report, since nothing was checked."""
        import httpx

        root = str(self.completion.client.base_url).rstrip("/").removesuffix("/v1")
        body = {"model": self.completion.name, "prompt": PROBE, "add_special_tokens": False}
        try:
            key = self.completion.client.api_key
            answer = httpx.post(f"{root}/tokenize", json=body, timeout=self.options.timeout,
                                headers={"Authorization": f"Bearer {key}"} if key else None)
        except httpx.HTTPError as error:
            raise EngineError(f"{self.engine} did not answer POST /tokenize: {error}") from error
        if answer.status_code in (400, 404, 405, 501):  # no such route, or nothing to tokenize with
            return False
        if answer.status_code != 200:
            raise EngineError(f"{self.engine} answered POST /tokenize with HTTP {answer.status_code}: "
                              f"{answer.text[:300]}")
        theirs = [int(i) for i in field(self.engine, answer.json(), "tokens", list)]
        ours = [int(i) for i in tokenizer.encode(PROBE, add_special_tokens=False)]
        if theirs != ours:
            at = next((n for n, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise ValueError(
                f"the teacher served by {self.engine} as {self.completion.name!r} tokenizes text otherwise than "
                f"the student: {PROBE!r} is {len(theirs)} ids there and {len(ours)} here, first differing at "
                f"id {at} ({theirs[at:at + 4]} there, {ours[at:at + 4]} here), so the ids the student sends "
                "would mean other tokens to the teacher. Serve a teacher that shares the student's tokenizer")
        return True

    def score(self, rows: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
        """For each row of n >= 2 ids, the teacher's log p(id_t | ids_<t) for t = 1 .. n - 1,
        float64 `[n - 1]`. Rows go `rows_per_request` to a request, requests in parallel."""
        rows = [[int(i) for i in row] for row in rows]
        short = [n for n, row in enumerate(rows) if len(row) < 2]
        if short:
            raise ValueError(f"RemoteTeacher.score needs at least two ids per row (the first is never "
                             f"scored); rows {short[:10]} have fewer")
        size = self.rows_per_request
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        return [lp for chunk in self._pool.map(self._request, chunks) for lp in chunk]

    def sampled_log_probs(self, batch: Mapping[str, Any]) -> np.ndarray:
        """Packed rows' teacher log-probs `[R, W]` float32, aligned to `input_ids`: at t, log
        p_teacher(input_ids[t] | the ids of its session before t); 0 where `response_mask` is 0.
        Each row must hold one session, its ids contiguous (what `DistillRollout` packs)."""
        ids = np.asarray(batch["input_ids"])
        segments = np.asarray(batch["text_segment_ids"])
        mask = np.asarray(batch["response_mask"]) > 0
        out = np.zeros(ids.shape, np.float32)
        spans, sequences = [], []
        for r in range(ids.shape[0]):
            where = np.flatnonzero(segments[r] != 0)
            if where.size == 0 or not mask[r].any():
                continue
            start, end = int(where[0]), int(where[-1]) + 1
            if where.size != end - start or len(set(segments[r, start:end].tolist())) != 1:
                raise ValueError(f"RemoteTeacher.sampled_log_probs scores one contiguous session per row; "
                                 f"row {r} holds segments {sorted(set(segments[r].tolist()) - {0})}")
            spans.append((r, start, end))
            sequences.append(ids[r, start:end])
        for (r, start, end), scores in zip(spans, self.score(sequences), strict=True):
            out[r, start + 1:end] = scores
        return np.where(mask, out, 0.0).astype(np.float32)

    def annotate(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """`batch` with its `teacher_log_probs` (`sampled_log_probs`), what DistillObjective reads
        of a remote teacher, for held-out rows that did not come through DistillRollout."""
        return {**batch, "teacher_log_probs": self.sampled_log_probs(batch)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RemoteTeacher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one request --------------------------------------------------------------------------

    def _request(self, rows: list[list[int]]) -> list[np.ndarray]:
        import openai

        named = {"model": self.completion.name, "prompt": rows, "max_tokens": 1}
        for attempt in range(self.retries + 1):
            try:
                answer = _post(self.completion, dict(named), {"prompt_logprobs": 0})
                return _read(self.engine, answer, rows)
            except EngineError as error:
                cause = error.__cause__
                passing = (isinstance(cause, openai.APITimeoutError | openai.APIConnectionError)
                           or (isinstance(cause, openai.APIStatusError)
                               and (cause.status_code in TRANSIENT or cause.status_code >= 500)))
                if not passing or attempt == self.retries:
                    raise
                time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")  # the loop returns or raises


def _read(engine: str, answer: dict, rows: list[list[int]]) -> list[np.ndarray]:
    """Each row's log-probs from the answer's choices (matched by `index`); EngineError when a
    choice, a position or a row's own id is missing."""
    choices = field(engine, answer, "choices", list)
    by_index = {item.get("index", n) if isinstance(item, dict) else n: item for n, item in enumerate(choices)}
    if sorted(by_index) != list(range(len(rows))):
        raise EngineError(f"{engine} answered choices {sorted(by_index)[:20]} to {len(rows)} prompts")
    out = []
    for n, row in enumerate(rows):
        path = f"choices.{n}"
        listed = field(engine, by_index[n], "prompt_logprobs", list, at=path)
        if len(listed) != len(row):
            raise EngineError(f"{engine} answered {path}.prompt_logprobs with {len(listed)} entries for a prompt "
                              f"of {len(row)} ids; is prompt_logprobs supported there (vLLM, or dew serve)?")
        values = []
        for t in range(1, len(row)):
            entry = listed[t]
            item = entry.get(str(row[t])) if isinstance(entry, dict) else None
            value = item.get("logprob") if isinstance(item, dict) else None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise EngineError(f"{engine} answered {path}.prompt_logprobs.{t} without the log-prob of "
                                  f"the prompt's id {row[t]}: {str(entry)[:200]}")
            values.append(float(value))
        out.append(np.asarray(values, np.float64))
    return out


__all__ = ["RemoteTeacher"]
