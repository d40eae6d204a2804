"""The ``quickdraft`` command line: chat, generate, serve, batch and models.

Start-up stays fast: this module imports neither torch nor the engine; a command imports
what it needs when it runs (``--help`` and ``batch --url`` never load torch).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

import quickdraft
from quickdraft.engine.config import (
    KERNEL_BACKENDS,
    SPECULATION_METHODS,
    WEIGHT_FORMATS,
    ConfigError,
    EngineConfig,
)
from quickdraft.engine.model_names import KNOWN_MODELS, canonical_model
from quickdraft.engine.sampling_params import InvalidParameterError, SamplingParams
from quickdraft.server.batch_cli import add_batch_parser
from quickdraft.server.chat_cli import add_chat_parser
from quickdraft.server.draft_head_cli import add_draft_head_parser
from quickdraft.server.models_cli import add_models_parser
from quickdraft.server.serve import add_serve_parser

if TYPE_CHECKING:
    from quickdraft.engine.async_engine import AsyncLLM

EXAMPLES = """\
examples:
  quickdraft chat                         chat in the terminal (the default model, in-process)
  quickdraft chat --url ws://HOST:8000    chat with a running server
  quickdraft generate "Write a haiku about tea." --temperature 0
  quickdraft serve --port 8000            WebSocket /v1/ws, OpenAI API /v1, web UI at /
  quickdraft batch requests.jsonl -o answers.jsonl [--url http://HOST:8000]
  quickdraft models list                  the models --model takes by name

Every command has its own --help. Docs: README.md and docs/ in the repository."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help, unless the help already says it or there
    is nothing to show (None, an empty list, a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "(default" in text or default is argparse.SUPPRESS
                or default is None or default == [] or action.nargs == 0
                or not action.option_strings):  # nargs 0: a switch (store_true/false)
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with :class:`HelpFormatter`, for every subcommand too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def use_colour(stream: IO[str]) -> bool:
    """ANSI colours only on a terminal, and never with ``$NO_COLOR`` set (no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    names = ", ".join(m.name for m in KNOWN_MODELS)
    g.add_argument("--model", default=None,
                   help="a model directory (Hugging Face layout), a .gguf file, or a name: "
                   f"{names} (also short names, see `quickdraft models list`) "
                   "(default: SmolLM2-135M-Instruct, embedded)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="weights and activations (float32 matches Hugging Face "
                   "transformers token for token)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory", type=float, default=1.0,
                   help="GiB for the KV cache")
    g.add_argument("--max-num-seqs", type=int, default=32,
                   help="requests the engine runs at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per engine step (prompt chunks + decodes + drafts)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + answer in tokens (default: the model's context)")
    g.add_argument("--seed", type=int, default=0,
                   help="random seed of sampling: the same seed and prompt give the same "
                   "answer")
    g.add_argument("--draft-model", default=None,
                   help="draft model for speculation (same vocabulary as --model; "
                   "default: none, model-free speculation)")
    g.add_argument("--speculation", default=None, choices=list(SPECULATION_METHODS),
                   help="speculative decoding method; the output is identical either way. "
                   "suffix: suffix tries over the request and its tenant's earlier answers; "
                   "combined: per request and step the suffix tree or the draft head's "
                   "(draft model's) chain, whichever expects more; auto (default): "
                   "combined with a draft head or draft model, else suffix")
    g.add_argument("--draft-head", default="auto",
                   help="EAGLE-3-style draft head directory (`quickdraft draft-head train`); "
                   "auto: the head shipped for --model if there is one; none: no head")
    g.add_argument("--suffix-corpus", default="auto",
                   help="a public corpus suffix decoding drafts from for every request (the "
                   "model's own answers, `quickdraft draft-head corpus`); auto: the one "
                   "shipped for --model, else the shipped one's text re-tokenized for it "
                   "(once, cached); a directory: one for --model, or another model's with "
                   "its text; none: only the request's and its tenant's text")
    g.add_argument("--num-speculative-tokens", type=int, default=8,
                   help="most draft tokens per step (the policy may use fewer)")
    g.add_argument("--no-speed-guard", dest="speed_guard", action="store_false",
                   help="do not check speculation's realised speed against plain decoding "
                   "(by default each method runs short epochs without speculation now and "
                   "then, and is held off where it is slower)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full (no KV sharing between requests)")
    g.add_argument("--device", default="auto",
                   help="auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N")
    g.add_argument("--kernel-backend", default="auto", choices=list(KERNEL_BACKENDS),
                   help="auto: the Triton kernels on CUDA, else the torch path (with the "
                   "native CPU kernels)")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode/verification steps eagerly instead of replaying graphs")
    g.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="GPU: cuBLAS and tuned attention tiles instead of the batch-invariant "
                   "kernels (faster; speculation then equals plain decoding only up to "
                   "rounding)")
    g.add_argument("--weights", default="auto", choices=list(WEIGHT_FORMATS),
                   help="int4-q8: run a GGUF's Q4_0/Q4_1/Q4_K layers on their 4-bit blocks "
                   "with 8-bit activations (CPU, bfloat16; cheap verification rows); int4: "
                   "the same blocks on torch's int4 kernel (bf16 activations); auto: the "
                   "fastest of these and dense in a timed decode + verification step")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=canonical_model(args.model), dtype=args.dtype, block_size=args.block_size,
        kv_cache_memory=int(args.kv_cache_memory * (1 << 30)), max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        seed=args.seed, draft_model=args.draft_model,
        speculation=args.speculation or "auto",
        draft_head=None if args.draft_head == "none" else args.draft_head,
        suffix_corpus=None if args.suffix_corpus == "none" else args.suffix_corpus,
        num_speculative_tokens=args.num_speculative_tokens,
        enable_prefix_caching=args.prefix_caching, device=args.device,
        kernel_backend=args.kernel_backend, cuda_graphs=args.cuda_graphs,
        batch_invariant=args.batch_invariant, weights=args.weights,
        speed_guard=args.speed_guard)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="longest answer in tokens")
    g.add_argument("--temperature", type=float, default=0.7,
                   help="0: greedy, the same answer every time")
    g.add_argument("--top-p", type=float, default=0.9,
                   help="sample from the smallest set of tokens with this much probability")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k likeliest tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the likeliest one's probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already seen (1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logits of tokens already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times the count of each token already generated")
    g.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        stop=tuple(args.stop))


async def stream_answer(llm: AsyncLLM, prompt_ids: list[int], params: SamplingParams) -> str:
    """Print the answer as it streams; return its text. Cancelled by Ctrl-C (aborts it)."""
    pieces: list[str] = []
    start = time.perf_counter()
    n_tokens, first, spec = 0, None, ""
    async for delta in llm.generate(prompt_token_ids=prompt_ids, sampling_params=params):
        if delta.token_ids and first is None:
            first = time.perf_counter()
        n_tokens += len(delta.token_ids)
        pieces.append(delta.text)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        if delta.finished and delta.error:
            sys.stdout.write(f"\n[error: {delta.error}]")
        if delta.usage is not None and delta.usage.num_spec_steps:
            u = delta.usage
            spec = (f", speculation accepted {u.num_accepted_tokens}/{u.num_drafted_tokens}"
                    f" drafts, {u.mean_acceptance_length:.2f} tokens/step")
    elapsed = time.perf_counter() - (first or start)
    ttft = (first - start) if first else 0.0
    rate = (n_tokens - 1) / elapsed if n_tokens > 1 and elapsed > 0 else 0.0
    dim, plain = ("\x1b[2m", "\x1b[0m") if use_colour(sys.stderr) else ("", "")
    sys.stderr.write(f"\n{dim}[{n_tokens} tokens, TTFT {ttft * 1000:.0f} ms, "
                     f"{rate:.1f} tok/s{spec}]{plain}\n")
    return "".join(pieces)


def run_generate(args: argparse.Namespace) -> int:
    from quickdraft.engine.async_engine import AsyncLLM

    llm = AsyncLLM.from_config(engine_config(args), progress=not args.quiet)
    if args.raw:
        prompt_ids = llm.engine.tokenizer.encode(args.prompt, add_special_tokens=False)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt_ids = llm.engine.apply_chat_template(
            [*messages, {"role": "user", "content": args.prompt}])
    try:
        asyncio.run(stream_answer(llm, prompt_ids, sampling_params(args)))
    except KeyboardInterrupt:
        print("\n[stopped]", file=sys.stderr)
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="quickdraft", epilog=EXAMPLES,
        description="quickdraft: a speculative-decoding-first, low-latency LLM chat backend.")
    parser.add_argument("--version", action="version",
                        version=f"quickdraft {quickdraft.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    add_chat_parser(sub)
    gen = sub.add_parser("generate", help="answer one prompt, streaming")
    gen.add_argument("prompt", help="the user message (with --raw: the text to continue)")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--system", default=None, help="system prompt")
    gen.add_argument("--quiet", action="store_true", help="no progress output")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=run_generate)
    add_models_parser(sub)
    add_draft_head_parser(sub)
    add_serve_parser(sub)
    add_batch_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `quickdraft models list | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if not is_user_error(exc):
            raise
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 2


def is_user_error(exc: Exception) -> bool:
    """A bad flag or model: one line on stderr, exit status 2 (not a traceback)."""
    loader = sys.modules.get("quickdraft.engine.loader")  # imported only if a model loaded
    model_error = loader.ModelLoadError if loader is not None else ()
    return isinstance(exc, (ConfigError, InvalidParameterError, model_error))


if __name__ == "__main__":
    sys.exit(main())
