"""What the routes stand on: the server's settings (``ServeConfig``), the model's loading
(``runtime_loader``: a local checkpoint, a hub repo fetched or rank-sliced first, progress for
/health), and ``Server``, the state the routes share (engine, metrics, chat template, grammars),
which prepares each request for the engine: rendered, tokenised, checked against the context,
its sampling and output constraint settled. No HTTP here: server/app.py holds the routes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3tools.errors import CheckpointError, NotFoundError
from exl3tools.plan import DEFAULT_MAX_NUM_SEQS
from exl3tools.server import detok, reasoning, tools
from exl3tools.server.api_errors import APIError, bad_request
from exl3tools.server.detok import TokenText
from exl3tools.server.engine import Engine, not_ready
from exl3tools.server.limits import PromptGuard
from exl3tools.server.metrics import Metrics
from exl3tools.server.request_checks import (
    check_chat_extras,
    check_completion_extras,
    completion_prompts,
    message_dicts,
)
from exl3tools.server.request_models import ChatCompletionRequest, CompletionRequest
from exl3tools.server.sampling_params import Prepared, SamplingParams, sampling_params
from exl3tools.server.structured import Constraint, output_constraint
from exl3tools.server.template import ChatTemplate, no_template
from exl3tools.text import first_line

log = logging.getLogger("exl3tools.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model_path: str | None = None
    # --served-model-name: one name or several (the first is reported, every one is accepted)
    served_model_name: str | tuple[str, ...] | None = None
    tp: int = 1
    moe: str = "tp"  # how an unsliced checkpoint's experts are cut over --tp ranks: "tp" | "ep"
    device: str = "cpu"
    backend: str = "auto"
    api_keys: tuple[str, ...] = ()
    metrics_require_key: bool = False  # /metrics behind the key too (vLLM leaves it open for scrapers)
    max_batch: int = DEFAULT_MAX_NUM_SEQS   # --max-num-seqs
    max_queue: int = 256
    max_cache_tokens: int | None = None  # KV cache size in tokens; None: from the memory budget (CUDA)
    max_prefill_tokens: int = 512
    max_context: int | None = None  # --max-model-len: cap the model's context (default: config.json)
    cpu_threads: int | None = None  # None: all cores but one, which the event loop keeps
    # decode steps (runtime/paged_decode.py): None = CUDA graphs per batch bucket on a CUDA device,
    # eager on the CPU; True = graphs; False = eager; "force" = the fixed-shape step without graphs
    cuda_graphs: bool | str | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    prefix_caching: bool = True
    speculative_tokens: int = 0   # MTP drafts per decode step (0: off)
    prefill_wait_s: float = 0.0   # idle engine: gather a burst of requests this long into one prefill
    reasoning_parser: str = "none"   # "none", or <think> tags apart (server/reasoning.py PARSERS)
    chat_template: str | None = None  # --chat-template's text: replaces the checkpoint's
    generation_config: str = "auto"   # "auto": generation_config.json's request defaults; "vllm": none
    seed: int | None = None           # --seed: requests without a seed draw theirs from it, in order
    # CORS (Starlette's CORSMiddleware) only when origins are given: else no CORS headers at all
    allowed_origins: tuple[str, ...] | None = None
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class LoadCount:
    """Weights read so far (runtime.weights.progress_hook, as the terminal's bar), for /health."""

    def __init__(self) -> None:
        self.bytes = self.total = self.tensors = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int, total: int) -> None:
        with self._lock:
            self.bytes, self.total, self.tensors = self.bytes + nbytes, total, self.tensors + 1

    def body(self) -> dict[str, Any]:
        total = self.total or None     # unknown before the first tensor (e.g. a hub download)
        return {"loaded_bytes": self.bytes, "total_bytes": total, "tensors_loaded": self.tensors,
                "fraction": min(self.bytes / total, 1.0) if total else None}


def runtime_loader(cfg: ServeConfig, progress: Callable[[int, int], None] | None = None) -> Callable[[], Any]:
    """The runner factory: everything device-related stays in exl3tools.runtime. ``progress(bytes
    read, total)`` after each tensor read, besides the hook already set (the CLI's bar)."""
    def load() -> Any:
        runner = _counted()
        if runner.tokenizer is None:        # a hub id's download, or a library caller's folder
            runner.close()
            raise CheckpointError(NO_TOKENIZER.format(cfg.model_path))
        defaults = getattr(runner, "generation_defaults", None)
        if cfg.generation_config == "auto" and defaults:   # vLLM warns alike: they change every such request
            log.info("generation_config.json gives requests that leave them out these defaults: %s "
                     "(--generation-config vllm ignores them)", defaults)
        return runner

    def _counted() -> Any:
        if progress is None:
            return _load()
        from exl3tools.runtime import weights

        prev = weights.progress_hook

        def hook(nbytes: int, total: int) -> None:
            progress(nbytes, total)
            if prev is not None:
                prev(nbytes, total)
        weights.progress_hook = hook
        try:
            return _load()
        finally:
            if weights.progress_hook is hook:
                weights.progress_hook = prev

    def _load() -> Any:
        from exl3tools.runtime.runner import load_runner

        kwargs: dict[str, Any] = {"device": cfg.device, "tp": cfg.tp, "backend": cfg.backend}
        if cfg.tp > 1:
            kwargs["moe"] = cfg.moe
        if cfg.max_cache_tokens is not None:
            kwargs["max_cache_tokens"] = cfg.max_cache_tokens
        if cfg.max_context is not None:
            kwargs["max_context"] = cfg.max_context
        decode = {None: None, True: "graphs", False: "eager", "force": "static"}[cfg.cuda_graphs]
        kwargs.update(decode=decode, max_num_seqs=cfg.max_batch, block_size=cfg.block_size,
                      kv_dtype=cfg.kv_cache_dtype, gpu_memory_utilization=cfg.gpu_memory_utilization,
                      prefix_caching=cfg.prefix_caching, max_num_batched_tokens=prefill_tokens(cfg))
        if cfg.speculative_tokens:
            kwargs["speculative_tokens"] = cfg.speculative_tokens
        if cfg.device == "cpu":
            _cpu_threads(cfg.cpu_threads)
        return load_runner(local_path(cfg.model_path, cfg.tp, cfg.moe), **kwargs)
    return load


NO_TOKENIZER = "{}: no tokenizer.json; serve answers in text and needs one (exl3tools generate --token-ids runs without it)"


def check_tokenizer(root: Path) -> None:
    """The server answers in text, so a checkpoint without tokenizer.json is refused in one line
    (CheckpointError, exit 1): before binding where the path is local (cli/serve.py), else when
    the runner has loaded (runtime_loader: the engine fails, /health says why)."""
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(NO_TOKENIZER.format(root))


def prefill_tokens(cfg: ServeConfig) -> int:
    """The prompt tokens a step may take, for the engine and the runner alike (batch-invariant runs
    cap it so that every step fits the fixed-shape step: runtime/invariance.py)."""
    from exl3tools.runtime import invariance

    return invariance.prefill_tokens(cfg.max_prefill_tokens, cfg.max_batch)


def local_path(spec: str, tp: int = 1, moe: str = "tp") -> str:
    """A local checkpoint path as is; a hub repo id (``owner/name[@rev]``) downloaded to the hub
    cache first, or with ``tp`` > 1 rank-sliced straight from the hub into the cache, fetching only
    the byte ranges of ranks not there yet (this runs while /health says 503 loading)."""
    from exl3tools.hub import looks_like_repo_id, split_revision

    if Path(spec).exists() or not looks_like_repo_id(spec):
        return spec
    if tp > 1:
        from exl3tools.hub_slice import ensure_slices

        log.info("rank-slicing %s for --tp %d from the Hugging Face hub (or its local cache)", spec, tp)
        return str(ensure_slices(spec, tp, moe))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, rev = split_revision(spec)
    log.info("fetching %s from the Hugging Face hub (or its local cache)", spec)
    try:
        return snapshot_download(repo, revision=rev)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise NotFoundError(f"{spec}: not a local path, and the hub gave no checkpoint ({first_line(exc)})") from None


def _cpu_threads(n: int | None) -> None:
    """Leave a core to the event loop: with every core in torch's pool, a busy HTTP thread stalls
    each parallel region at its barrier (measured: 64 streams on 2 cores, 7x slower steps)."""
    import torch

    torch.set_num_threads(n or max(1, (os.cpu_count() or 2) - 1))


def runtime_hooks() -> dict[str, Callable]:
    from exl3tools.runtime import sampling

    return {"sample": sampling.sample, "sample_batch": sampling.sample_batch,
            "sample_device": sampling.sample_device,
            "make_adjust": sampling.Adjust, "adjust_rows": sampling.adjust_rows,
            "accept_drafts": sampling.accept_drafts,
            "logprobs": sampling.logprobs, "make_generator": sampling.make_generator}


class Server:
    """State shared by the routes: config, engine, metrics, the chat template."""

    def __init__(self, cfg: ServeConfig, load: Callable[[], Any], hooks: dict[str, Callable]) -> None:
        self.cfg = cfg
        names = cfg.served_model_name
        self.served_names: tuple[str, ...] = (names,) if isinstance(names, str) else tuple(names or ())
        self.metrics = Metrics(self.served_names[0] if self.served_names else _path_name(cfg.model_path))
        self._seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        self.engine = Engine(load, max_batch=cfg.max_batch, max_queue=cfg.max_queue,
                             max_prefill_tokens=prefill_tokens(cfg), metrics=self.metrics,
                             prefill_wait_s=cfg.prefill_wait_s, **hooks)
        self.metrics.bind(self.engine)
        self._template: ChatTemplate | None = None
        self._template_checked = False
        self._token_text: TokenText | None = None
        self._guard: PromptGuard | None = None
        self._grammars: Any = None             # server/structured.Grammars, on the first response_format
        self._grammars_lock = threading.Lock()
        self._detok: dict[frozenset, Any] = {}   # markers -> the tokenizer that keeps them as text

    def guard(self) -> PromptGuard:
        """Prompt-size checks that run before any tokenization (server/limits.py)."""
        if self._guard is None:
            self._guard = PromptGuard.for_runner(self.runner, self.engine.cache_budget)
        return self._guard

    def grammars(self, param: str = "response_format") -> Any:
        """The tokenizer in llguidance's form (structured outputs), built once (~10 ms to ~1 s);
        ``param``: the request field that asked for it, which the 400 of a checkpoint without a
        tokenizer names."""
        with self._grammars_lock:
            if self._grammars is None:
                from exl3tools.server.structured import Grammars

                r = self.runner
                if r.tokenizer is None:
                    raise bad_request("structured outputs need the checkpoint's tokenizer.json", param=param)
                # the larger of the two vocabularies: ids past the model's are masked by Adjust's trim
                vocab = max(r.vocab_size, r.tokenizer.get_vocab_size(with_added_tokens=True))
                self._grammars = Grammars(r.tokenizer.to_str(), sorted(r.eos_token_ids), vocab, param)
            return self._grammars

    def detokenizer(self, markers: frozenset[str]) -> Any:
        """The tokenizer that decodes answers with ``markers`` (what a parser reads) as text; None
        where the runner's already does (none of them is a special token)."""
        if not markers:
            return None
        if markers not in self._detok:
            tok = self.runner.tokenizer
            kept = detok.keeping(tok, markers)
            self._detok[markers] = None if kept is tok else kept
        return self._detok[markers]

    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.runner.tokenizer)
        return self._token_text

    @property
    def runner(self) -> Any:
        if self.engine.state != "ready":
            raise not_ready(self.engine)
        return self.engine.runner

    @property
    def model_name(self) -> str:
        """The name answers report: --served-model-name's first, else the checkpoint's."""
        if self.served_names:
            return self.served_names[0]
        spec = self.cfg.model_path or ""
        from exl3tools.hub import looks_like_repo_id, split_revision

        if not Path(spec).exists() and looks_like_repo_id(spec):
            return split_revision(spec)[0]  # not the snapshot hash the cache dir is named after
        return self.runner.model_name

    def model_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may give (vLLM: all of --served-model-name)."""
        return self.served_names or (self.model_name,)

    def check_model(self, name: str) -> None:
        if name not in self.model_names():
            served = "', '".join(self.model_names())
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{served}'", param="model", code="model_not_found")

    def defaults(self) -> dict[str, Any]:
        """The request defaults of generation_config.json (``--generation-config auto``), or none."""
        if self.cfg.generation_config != "auto":
            return {}
        return getattr(self.runner, "generation_defaults", None) or {}

    def _with_format(self, params: SamplingParams, c: Constraint | None) -> SamplingParams:
        """The request's output constraint (response_format, structured_outputs, guided_*) as the
        answer's grammar (server/structured.py)."""
        return params if c is None else dataclasses.replace(params, grammar=self.grammars(c.param).compile(c))

    def seeded(self, params: SamplingParams) -> SamplingParams:
        """With --seed, a request without a seed gets the next of the server's seeds: drawn at
        submission (the event loop's order), so the same requests sample alike after a restart."""
        if params.seed is not None or self._seeds is None:
            return params
        return dataclasses.replace(params, seed=self._seeds.getrandbits(63))

    def template_source(self) -> str | None:
        return self.cfg.chat_template or getattr(self.runner, "chat_template", None)

    def template(self) -> ChatTemplate:
        if not self._template_checked:
            r = self.runner
            src = self.template_source()
            if src:
                self._template = ChatTemplate(src, bos_token=_special(r, "bos"),
                                              eos_token=_special(r, "eos"))
            self._template_checked = True
        if self._template is None:
            raise no_template()
        return self._template

    # ------------------------------------------------------------ request preparation

    def _limits(self, longest: int, max_tokens: int | None, default: int | None, param: str,
                max_param: str = "max_tokens") -> int:
        """``max_tokens`` checked against the context; None: ``default`` (None: the rest of the
        context), capped by generation_config.json's max_new_tokens, and by the context; 400s name
        the prompt ``param`` and ``max_tokens`` ``max_param``."""
        runner, budget = self.runner, self.engine.cache_budget
        ctx = runner.max_context
        limit = min(ctx, budget) if budget else ctx
        if longest >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"prompt has {longest}", param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(x for x in (default, self.defaults().get("max_tokens"), limit - longest) if x is not None)
        if longest + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; you "
                           f"requested {longest + max_tokens} ({longest} in the prompt, "
                           f"{max_tokens} for the completion)", param=max_param,
                           code="context_length_exceeded")
        return max_tokens

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        check_completion_extras(req)
        constraint = output_constraint(req)   # checked before the prompts are tokenized
        runner = self.runner
        self.token_text()  # built once, here in a worker thread: parsing a big tokenizer takes time
        texts = completion_prompts(req)
        self.guard().check_prompts(texts)  # sizes first: tokenizing megabytes stalls the server
        prompts: list[list[int]] = []
        for p in texts:
            if isinstance(p, str):
                ids = detok.encode_ids(runner.tokenizer, p, add_special_tokens=True)
            else:
                if not p:
                    raise bad_request("token prompts must not be empty", param="prompt")
                if min(p) < 0 or max(p) >= runner.vocab_size:     # (C loops: a burst parses these)
                    raise bad_request(f"prompt token ids must be in [0, {runner.vocab_size})",
                                      param="prompt")
                ids = list(p)
            if not ids:
                if runner.bos_token_id is None:
                    raise bad_request("prompt is empty", param="prompt")
                ids = [runner.bos_token_id]
            prompts.append(ids)
        max_tokens = self._limits(max(map(len, prompts)), req.max_tokens,
                                  DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, vocab_size=runner.vocab_size,
                                 defaults=self.defaults())
        params = self._with_format(params, constraint)
        extras: dict[str, Any] = {}
        if req.echo:     # the prompts' text before the completions; with logprobs, their tokens' too
            extras["echo"] = [t if isinstance(t, str) else runner.tokenizer.decode(ids, skip_special_tokens=False)
                              for t, ids in zip(texts, prompts, strict=True)]
            if req.logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        return Prepared(prompts, params, req.n, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage),
                        req.return_token_ids, extras=extras)

    def prepare_chat(self, req: ChatCompletionRequest, *, limits: bool = True) -> Prepared:
        """``req`` rendered and tokenised, its sampling settled; ``limits`` False: a prompt past
        the context is not refused (count_tokens counts it)."""
        check_chat_extras(req)
        constraint = output_constraint(req)   # checked before the template renders
        runner = self.runner
        mode = tools.tool_mode(req, tools.call_syntax(self.template_source()))
        self.token_text()
        messages = message_dicts(req)
        named = req.own_param("messages")     # another API's request (Responses: input) names its own field
        self.guard().check_messages(messages, named)  # sizes first, before rendering and tokenizing
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:    # the template's thinking switch, unless the request set it
            switch = reasoning.template_switch(reasoning.EFFORTS[req.reasoning_effort])
            for k, v in {**switch, "reasoning_effort": req.reasoning_effort}.items():
                kwargs.setdefault(k, v)
        if req.tools:
            kwargs["tools"] = tools.template_tools(req)
        try:
            text = self.template().render(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        except APIError as exc:                # a template's refusal names the messages
            exc.param = named if exc.param == "messages" else exc.param
            raise
        self.guard().check_text(len(text), named)
        ids = detok.encode_ids(runner.tokenizer, text, add_special_tokens=False)
        if not ids:
            raise bad_request("the chat template rendered an empty prompt", param=named)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = (self._limits(len(ids), wanted, None, named, req.own_param("max_tokens")) if limits
                      else wanted or 1)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, vocab_size=runner.vocab_size,
                                 defaults=self.defaults())
        params = self._with_format(params, constraint)
        if mode.forced is not None:                    # a call the answer must be (server/tools.py)
            params = dataclasses.replace(params, grammar=self.grammars("tools").schema(tools.call_schema(mode.forced), "tools"))
        thinks = self.cfg.reasoning_parser != "none"
        opened = thinks and reasoning.opens_inside(text)   # the answer starts inside the thinking
        if thinks and params.grammar is not None:
            # a grammar holds what follows the thinking where the tags are single tokens, else the
            # whole answer (which then has no thinking to split off)
            gate = reasoning.think_gate(runner.tokenizer, opened)
            thinks = gate is not None
            if thinks:
                params = dataclasses.replace(params, think_gate=gate)
        markers = (mode.syntax.markers if mode.syntax is not None else frozenset()) | (
            frozenset({reasoning.OPEN, reasoning.CLOSE}) if thinks else frozenset())
        return Prepared([ids], params, req.n, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage),
                        req.return_token_ids,
                        extras={"calls": mode if mode.forced is not None or mode.syntax is not None else None,
                                "think": opened if thinks else None,
                                "detok": self.detokenizer(markers)})


def _path_name(spec: str | None) -> str:
    p = Path(spec or "model")
    return p.parent.name if p.name == "model" and p.parent.name else p.name


def _special(runner: Any, which: str) -> str:
    """bos/eos token text for templates that print them: Runner.bos_token / eos_token."""
    text = getattr(runner, f"{which}_token", None)
    return text if isinstance(text, str) else ""

