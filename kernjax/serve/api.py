"""OpenAI's completion and chat requests, read and checked, and their answers, rendered.

`read_completion` and `read_chat` turn a request body into a `Job`: the prompts (text or token
ids, tokenized later), what the head is asked (`head.Ask`), and how to answer (`echo`, how many
log-probabilities, stop strings, streaming). Every field is checked where it is read, and one the
server cannot honour is a `Bad` naming it and saying what to send, never ignored. `Choice`
collects one sequence's events from the head and renders them: text (detokenized as it grows,
stop strings found and cut), OpenAI's legacy completion log-probabilities (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) or chat's (`content` entries), the finish
reason and, when streaming, each chunk's delta. Nothing here touches aiohttp or the pipeline.
"""

from __future__ import annotations

import dataclasses
import json
import math

from kernjax.core.item import GREEDY
from kernjax.kernels.head import K
from kernjax.serve.head import Ask


class Bad(Exception):
    """A request answered with an error: `status`, the message and the field it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def show(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


# Fields accepted and, at these values, meaning what the server does anyway.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
           "logit_bias": {}, "suffix": "", "response_format": {"type": "text"}, "tools": [],
           "tool_choice": "none", "parallel_tool_calls": False}
WHY = {"presence_penalty": "applies no penalties", "frequency_penalty": "applies no penalties",
       "repetition_penalty": "applies no penalties",
       "logit_bias": "samples from the model's own distribution, unbiased",
       "suffix": "does not complete toward a suffix", "response_format": "has no structured output",
       "tools": "has no tool calls", "tool_choice": "has no tool calls",
       "parallel_tool_calls": "has no tool calls"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop",
          "stop_token_ids", "stream", "stream_options", "user", "ignore_eos",
          "skip_special_tokens", *NEUTRAL}
FIELDS = {False: COMMON | {"prompt", "echo", "logprobs", "best_of"},
          True: COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                          "add_generation_prompt"}}
MAX_N = 16
MAX_STOPS = 16


@dataclasses.dataclass
class Job:
    """A request, checked: its prompts and what to do with them."""

    chat: bool
    prompts: list
    ask: Ask
    echo: bool = False
    logprobs: int | None = None  # log-probabilities of each token and of its `logprobs` likeliest
    stop: tuple = ()
    stream: bool = False
    usage: bool = False
    skip_special: bool = True
    fill: bool = False  # no max_tokens given to a chat: generate until the context is full

    def sized(self, prompt_tokens: int, context: int) -> Job:
        """The job with `max_tokens` the room left after the prompt where it is to `fill`."""
        if not self.fill:
            return self
        room = max(context - prompt_tokens, 1)
        return dataclasses.replace(self, ask=dataclasses.replace(self.ask, max_tokens=room))


def _number(body: dict, key: str, default, *, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(key)
    if v is None:
        return default
    ok = (type(v) is int) if integer else (type(v) in (int, float) and math.isfinite(v))
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if not ok:
        kind = "an integer" if integer else "a number"
        rng = "" if lo is None and hi is None else " " + (
            f"{'above' if lo_open else 'from'} {lo}" if lo is not None else "") + (
            f"{' ' if lo is not None else ''}up to {hi}" if hi is not None else "")
        raise Bad(f"{key} is {show(v)}; give {kind}{rng}", key)
    return v


def _flag(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    v = default if v is None else v
    if not isinstance(v, bool):
        raise Bad(f"{key} must be true or false", key)
    return v


def read(body, *, chat: bool, context: int, eos: frozenset, has_score: bool,
         defaults: dict | None = None) -> Job:
    """The `Job` of a completion (`chat` False) or chat request body, every field checked; the
    prompts are left as the body gives them (`prompts`, `messages` for the caller). `defaults`
    are the checkpoint's sampling defaults (`weights.sampling_defaults`), else OpenAI's."""
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, **(defaults or {})}
    if not isinstance(body, dict):
        raise Bad("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[chat])
    if unknown:
        raise Bad(f"unknown field {show(unknown[0])}; this server takes "
                  f"{', '.join(sorted(FIELDS[chat]))}", unknown[0])
    for k, ok in NEUTRAL.items():
        v = body.get(k)
        if v is not None and v != ok and not (k == "tool_choice" and v == "auto"
                                              and not body.get("tools")):
            raise Bad(f"`{k}` is {show(v)}: this server {WHY[k]}; leave it out", k)
    if not isinstance(body.get("model", ""), str | None):
        raise Bad(f"model is {show(body['model'])}; give the model's name, a string", "model")
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = [k for k in keys if body.get(k) is not None]
    max_tokens = _number(body, given[0], None, lo=0, integer=True) if given else None
    if max_tokens is None:  # chat: until the context is full, as vLLM's (`Job.fill`)
        max_tokens = 0 if chat else 16
    temperature = _number(body, "temperature", d["temperature"], lo=0, hi=100)
    top_p = _number(body, "top_p", d["top_p"], lo=0, hi=1, lo_open=True)
    top_k = _number(body, "top_k", int(d["top_k"]), lo=-1, integer=True)
    min_p = _number(body, "min_p", d["min_p"], lo=0, hi=1)
    seed = _number(body, "seed", None, lo=-(2**63), hi=2**64 - 1, integer=True)
    n = _number(body, "n", 1, lo=1, hi=MAX_N, integer=True)
    best = body.get("best_of")
    if best is not None and best != n:
        raise Bad(f"best_of is {show(best)}: this server returns every sequence it makes; leave "
                  "it out or give n", "best_of")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)
            and len(stop) <= MAX_STOPS):
        raise Bad(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings",
                  "stop")
    ids = body.get("stop_token_ids") or []
    if not (isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)):
        raise Bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    ignore_eos = _flag(body, "ignore_eos")
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - {
            "include_usage", "continuous_usage_stats"}
            or not isinstance(opts.get("include_usage", False), bool)):
        raise Bad("stream_options takes {\"include_usage\": true|false}, with stream true",
                  "stream_options")
    if chat:
        want = _flag(body, "logprobs")
        top = _number(body, "top_logprobs", None, lo=0, hi=K, integer=True)
        if top is not None and not want:
            raise Bad("top_logprobs needs logprobs true", "top_logprobs")
        logprobs = (top or 0) if want else None
        echo = False
    else:
        logprobs = _number(body, "logprobs", None, lo=0, hi=K, integer=True)
        echo = _flag(body, "echo")
    score = echo and logprobs is not None
    if score and not has_score:
        raise Bad("echo with logprobs scores the prompt, and this pipeline cannot: serve it with "
                  "--transport host (or re-cut it with this kernjax)", "echo")
    if max_tokens == 0 and not echo and given:
        raise Bad("max_tokens 0 generates nothing; give max_tokens 1 or more, or echo true to "
                  "answer with the prompt (and its logprobs)", given[0] if given else
                  "max_tokens")
    greedy = temperature == 0
    sampling = GREEDY if greedy else (float(temperature), float(top_p),
                                      int(max(top_k, 0)), float(min_p))
    stops = frozenset(ids) | (frozenset() if ignore_eos else eos)
    ask = Ask(max_tokens=max_tokens, sampling=sampling,
              seed=(seed if seed is not None else _fresh_seed()) % 2**32, n=n, stop_ids=stops,
              score=score)
    return Job(chat, [], ask, echo=echo, logprobs=logprobs, stop=tuple(stop), stream=stream,
               usage=bool(opts and opts.get("include_usage")),
               skip_special=_flag(body, "skip_special_tokens", True), fill=not given and chat)


def _fresh_seed() -> int:
    import secrets
    return secrets.randbits(32)


class Choice:
    """One sequence's answer as it grows: its tokens, text, log-probabilities and finish."""

    def __init__(self, index: int, prompt_ids, job: Job, tokenizer, prompt_text: str | None):
        self.index, self.job, self.tok = index, job, tokenizer
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.prompt_text = prompt_text
        self.ids: list[int] = []
        self.lps: list = []         # per generated token: (logprob, top ids, top logprobs)
        self.prompt_scores = None
        self.text = ""              # the generated text, cut at a stop string
        self.sent = 0               # characters of `text` streamed
        self.sent_tokens = 0        # tokens whose log-probabilities were streamed
        self.finish: str | None = None
        self.error = None
        self.stopped = False        # a stop string ended it: the head is told to drop it

    # -- events --------------------------------------------------------------------------------

    def prompt(self, data: dict) -> None:
        self.prompt_scores = data

    def token(self, data: dict) -> None:
        if self.finish:
            return
        self.ids.append(data["id"])
        self.lps.append((data.get("logprob"), data.get("top_ids"), data.get("top_logprobs")))
        full = self.decode(self.ids)
        for s in self.job.stop:  # the first stop string in the text ends it, cut before it
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                self.text, self.finish = full[:at], "stop"
                self.stopped = not data.get("finish_reason")  # the head has more to drop
                return
        self.text = full
        if data.get("finish_reason"):  # its last token
            self.done(data)

    def done(self, data: dict) -> None:
        if not self.finish:
            reason = data["finish_reason"]
            if reason == "stop" and self.ids and self.job.skip_special:
                self.text = self.decode(self.ids)  # the stop token itself shows no text
            self.finish = reason

    # -- rendering -----------------------------------------------------------------------------

    def decode(self, ids) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode(list(ids), skip_special_tokens=self.job.skip_special)

    def piece(self, t: int) -> str:
        """A token as log-probabilities name it: its text, or `token_id:N` without a tokenizer."""
        if self.tok is None:
            return f"token_id:{t}"
        return self.tok.decode([int(t)], skip_special_tokens=False)

    def _top(self, ids, lps, chosen: int, lp: float):
        k = self.job.logprobs or 0
        pairs = [(int(i), float(v)) for i, v in zip(ids[:k], lps[:k])]
        if chosen not in [i for i, _ in pairs]:
            pairs.append((chosen, float(lp)))
        return pairs

    def _legacy(self, upto: int | None = None, start: int = 0, offset: int = 0) -> dict:
        """Completion log-probabilities of the echoed prompt (first, from the start) and of the
        generated tokens `start..upto`."""
        toks, lps, tops = [], [], []
        if start == 0 and self.job.echo:
            ps = self.prompt_scores or {}
            for j, t in enumerate(self.prompt_ids):
                toks.append(self.piece(t))
                if j == 0 or not ps:
                    lps.append(None)
                    tops.append(None)
                    continue
                lp = ps["logprobs"][j - 1]
                lps.append(float(lp))
                tops.append(dict((self.piece(i), v) for i, v in self._top(
                    ps["top_ids"][j - 1], ps["top_logprobs"][j - 1], t, lp)))
        for t, (lp, ti, tl) in list(zip(self.ids, self.lps))[start:upto]:
            toks.append(self.piece(t))
            lps.append(lp)
            tops.append(dict((self.piece(i), v) for i, v in self._top(ti, tl, t, lp)))
        at, offsets = offset, []
        for s in toks:
            offsets.append(at)
            at += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat(self, upto: int | None = None, start: int = 0) -> dict:
        out = []
        for t, (lp, ti, tl) in list(zip(self.ids, self.lps))[start:upto]:
            s = self.piece(t)
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": self.piece(i), "logprob": v,
                                          "bytes": list(self.piece(i).encode())}
                                         for i, v in self._top(ti, tl, t, lp)[:self.job.logprobs]]})
        return {"content": out}

    def final(self) -> dict:
        """The whole choice, for an answer that is not streamed."""
        job = self.job
        if job.chat:
            c = {"index": self.index, "message": {"role": "assistant", "content": self.text},
                 "logprobs": self._chat() if job.logprobs is not None else None}
        else:
            text = ((self.prompt_text or "") if job.echo else "") + self.text
            c = {"index": self.index, "text": text,
                 "logprobs": self._legacy() if job.logprobs is not None else None,
                 "token_ids": list(self.ids)}
            if job.echo:
                c["prompt_token_ids"] = list(self.prompt_ids)
        return {**c, "finish_reason": self.finish}

    def delta(self) -> dict | None:
        """What is new since the last delta, as a streamed chunk's choice, or None. Text that a
        stop string could still claim, or that ends inside a character, is held back."""
        job = self.job
        hold = 0 if self.finish else max((len(s) - 1 for s in job.stop), default=0)
        end = max(len(self.text) - hold, self.sent)
        new = self.text[self.sent:end]
        if new.endswith("\ufffd") and not self.finish:
            new = new[:-1]
        first = self.sent == 0 and self.sent_tokens == 0
        ntok = len(self.ids)
        if not new and ntok == self.sent_tokens and not self.finish and not (
                first and job.echo and not job.chat):
            return None
        lp = None
        if job.logprobs is not None:  # the echoed prompt's come with the first chunk
            lp = (self._chat(ntok, self.sent_tokens) if job.chat else
                  self._legacy(ntok, self.sent_tokens, 0 if first else self.sent + (
                      len(self.prompt_text or "") if job.echo else 0)))
        self.sent += len(new)
        self.sent_tokens = ntok
        if job.chat:
            d = {"content": new}
            if first:
                d["role"] = "assistant"
            c = {"index": self.index, "delta": d, "logprobs": lp}
        else:
            text = ((self.prompt_text or "") if first and job.echo else "") + new
            c = {"index": self.index, "text": text, "logprobs": lp}
        return {**c, "finish_reason": self.finish}

    def usage(self) -> int:
        return len(self.ids)
