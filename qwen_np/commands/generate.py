"""`python -m qwen_np generate` and `chat`: prompts in, streamed text out, with the inspections
(--trace-layers, --lens, --attention) and the stats line.

Generated text goes to stdout, token by token; everything else (notes, the memory plan, traces,
the stats line) goes to stderr. Ctrl-C stops a reply cleanly and still prints its stats line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..errors import QwenNPError
from . import EXIT_INTERRUPTED, common, error_line

if TYPE_CHECKING:       # the rest is imported where it runs: --help needs none of it (nor NumPy)
    from ..core.adapters import Adapter
    from ..core.config import Qwen3Config
    from ..core.model import Qwen3Model, Trace
    from ..core.sampling import SamplingParams
    from ..files.model_files import GenerationDefaults, ModelFiles
    from ..files.tokenizer import Tokenizer
    from ..generation.constraints import Grammar
    from ..generation.generate import ChatSession, GenerationStats, TokenEvent
    from ..generation.speculative import Speculation, SpeculationCounts
    from ..training.rollouts import Reward

BUNDLED_NOTICE = ("note: using the bundled model, a tiny Qwen3 that qwen_np trained on Shakespeare's plays: it continues "
                  "text in their style and knows nothing else; for real answers pass --model with a hub id "
                  "(e.g. Qwen/Qwen3-0.6B) or a checkpoint folder")
NO_CHAT_TEMPLATE_NOTICE = "note: this model has no chat template, so the prompt is continued as plain text (as --no-chat)"
DEFAULT_MAX_NEW_TOKENS = 1024
# With thinking on, Qwen3 reasons before it answers: most replies to everyday questions, thinking
# included, fit in 4096 tokens (the model card suggests up to 32768 for hard problems: pass -n).
THINKING_MAX_NEW_TOKENS = 4096
UNTIL_CONTEXT_IS_FULL = -1        # -n -1, llama.cpp's spelling
CHAT_COMMANDS = {"/clear": "forget the conversation (the system prompt stays)",
                 "/system TEXT": "set the system prompt (/system alone removes it)",
                 "/think on|off": "let Qwen3 think before answering, or not",
                 "/exit": "end the chat (so does Ctrl-D)", "/help": "this list"}
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "seed")


def generate_parser(gen: argparse.ArgumentParser) -> None:
    gen.description = ("Generate a reply to PROMPT (a user message rendered with the checkpoint's chat template; plain "
                       "text to continue with --no-chat or when the checkpoint has no template). Several prompts run "
                       "together as one batch; their replies print in order.")
    gen.add_argument("prompt", nargs="*", help="the user message (with --no-chat: the text to continue); - reads it "
                                               "from stdin")
    gen.add_argument("-p", "--prompt", dest="prompts", action="append", default=[], metavar="TEXT",
                     help="a prompt (repeatable), as the positional PROMPT")
    gen.add_argument("-f", "--file", action="append", default=[], metavar="FILE",
                     help="read prompts from FILE, one per line (repeatable; - is stdin)")
    gen.add_argument("--stop", action="append", default=[], metavar="STR",
                     help="end the reply before the text STR (repeatable; found even when it spans tokens)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt instead of the text: text, token ids, finish reason, "
                          "usage, timings, seed")
    _add_model_flags(gen)
    _add_generation_flags(gen)
    _add_grammar_flags(gen)
    common.add_context(gen, "KV cache positions, prompt and reply together (with several prompts, the longest's)")
    gen.add_argument("--no-chat", action="store_true",
                     help="plain completion: feed PROMPT as is, without the chat template")
    _add_inspection_flags(gen)
    _add_scaling_flags(gen)
    gen.set_defaults(run=run_generate)


def chat_parser(chat: argparse.ArgumentParser) -> None:
    chat.description = ("Chat turn by turn; the KV cache is kept between turns, so each turn only runs its new tokens. "
                        "Commands: " + ", ".join(CHAT_COMMANDS) + ". Ctrl-C stops a reply, Ctrl-D ends the chat. "
                        "When the context fills, the oldest turns are dropped (with a notice).")
    _add_model_flags(chat)
    _add_generation_flags(chat)
    common.add_context(chat, "KV cache positions for the whole conversation")
    chat.set_defaults(run=run_chat)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    common.add_model(parser)
    common.add_lora(parser)
    common.add_memory(parser)
    common.add_kv_dtype(parser)
    common.add_speculation(parser)
    common.add_threads(parser)
    parser.add_argument("--verbose", action="store_true",
                        help="print the memory plan and token-level details (prompt and generated ids, cache "
                             "use) on stderr, and chat's stats line after every turn")
    common.add_quiet(parser, "leave out the notes (the bundled model's, a missing chat template)")


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--max-new-tokens", type=common.at_least(-1), metavar="N",
                        help=f"stop after N new tokens, -1: when the context is full, as llama.cpp's -n -1 (default: "
                             f"{THINKING_MAX_NEW_TOKENS} when Qwen3 thinks, {DEFAULT_MAX_NEW_TOKENS} with --no-think or "
                             "--no-chat); generation also stops at an end-of-sequence token or when the context is full")
    parser.add_argument("--temperature", "--temp", type=float, metavar="T",
                        help="divide the logits by T before sampling: lower is more predictable, 0 is greedy "
                             "(always the most likely token) (default: generation_config.json; Qwen3: 0.6, "
                             "0.7 with --no-think)")
    parser.add_argument("--top-k", type=int, metavar="K",
                        help="sample only among the K most likely tokens; 0 turns it off "
                             "(default: generation_config.json; Qwen3: 20)")
    parser.add_argument("--top-p", type=float, metavar="P",
                        help="sample only among the fewest most likely tokens whose probabilities add up to P, "
                             "in (0, 1]; 1 turns it off (default: generation_config.json; Qwen3: 0.95, "
                             "0.8 with --no-think)")
    parser.add_argument("--min-p", type=float, metavar="P",
                        help="drop tokens less likely than P times the most likely one, in [0, 1]; 0 turns it off "
                             "(default: generation_config.json, else 0)")
    parser.add_argument("--repetition-penalty", "--repeat-penalty", type=float, metavar="R",
                        help="divide the positive logits (multiply the negative ones) of every token already in "
                             "the prompt or the output by R, as transformers does; 1 turns it off "
                             "(default: generation_config.json, else 1)")
    parser.add_argument("--presence-penalty", type=float, metavar="P",
                        help="subtract P from the logit of every token already generated (the prompt does not "
                             "count), as OpenAI and vLLM do; 0 turns it off (default: 0)")
    parser.add_argument("-s", "--seed", type=int, metavar="N",
                        help="seed of the sampler: the same seed and flags give the same text (default: drawn at "
                             "random and shown in the stats line; with several prompts, prompt i uses N + i)")
    parser.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                        help="let Qwen3 reason in a <think> block before answering, or not (--no-think renders "
                             "the chat template with enable_thinking=false and switches the sampling defaults to "
                             "the model card's non-thinking ones: temperature 0.7, top-p 0.8, top-k 20) "
                             "(default: the template's, which thinks)")
    parser.add_argument("--thinking-budget", type=common.at_least(0), metavar="N",
                        help="end Qwen3's thinking within N tokens: at N, Qwen's own closing text and </think> are "
                             "written and the model answers after them, as Qwen3's report describes (default: no "
                             "budget)")
    parser.add_argument("--system", metavar="TEXT", help="a system prompt placed before the first user message")
    parser.add_argument("--hide-think", action="store_true",
                        help="Qwen3 still thinks, but stdout shows only the answer after </think> (for scripts)")


def _add_grammar_flags(parser: argparse.ArgumentParser) -> None:
    constrained = parser.add_mutually_exclusive_group()
    constrained.add_argument("--json-schema", metavar="FILE",
                             help="constrain the reply to JSON valid against the JSON Schema in FILE (tokens that would "
                                  "break it are never sampled); stdout shows only the answer, not Qwen3's thinking "
                                  "(needs llguidance: pip install 'qwen_np[constraints]')")
    constrained.add_argument("--grammar", metavar="FILE",
                             help="constrain the reply to the grammar in FILE: Lark (start: ...) or GBNF, llama.cpp's "
                                  "(root ::= ...); stdout shows only the answer, as --json-schema")


def _add_inspection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", action="store_true",
                        help="print every intermediate tensor of the prompt's forward pass and the first decode "
                             "step on stderr (name, shape, statistics)")
    parser.add_argument("--trace-layers", metavar="LIST",
                        help="trace only these decoder layers, comma-separated, e.g. 0,35 (implies --trace)")
    parser.add_argument("--lens", action="store_true",
                        help="logit lens: before generating, print on stderr the tokens each layer's output would "
                             "predict at the prompt's positions")
    parser.add_argument("--attention", metavar="LAYER:HEAD",
                        help="before generating, print on stderr how one attention head attends over the prompt")
    parser.add_argument("--attention-png", metavar="FILE",
                        help="also save the --attention pattern as a PNG image")


def _add_scaling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=common.at_least(1), metavar="K",        # K, as eval's --samples
                        help="sample K replies to each prompt, decoded together as one batch (the prompt read once, "
                             "its KV blocks shared); sample j is seeded --seed + j (with several prompts, prompt i's "
                             "from --seed + i*K); without --vote or --best-of all K print")
    chooser = parser.add_mutually_exclusive_group()
    chooser.add_argument("--vote", action="store_true",
                         help="self-consistency: print the answer most of the --samples replies give (a tie: the one "
                              "seen first), the vote counts on stderr (--json: answer, votes, each sample's answer); "
                              "a reply's answer is --extract's")
    chooser.add_argument("--best-of", metavar="FILE.py:FUNCTION",
                         help="print the one of the --samples replies of highest reward, FUNCTION(prompt, completion) "
                              "-> float of FILE.py (a tie: the first), its reward on stderr (--json: text, reward, "
                              "best, each sample's reward); completion is the reply as generated, think block included")
    parser.add_argument("--extract", metavar="FILE.py:FUNCTION",
                        help="with --vote: a reply's answer, FUNCTION(completion) -> str, or None for no vote, of "
                             "FILE.py (default: the last number in the reply's answer after any think block, e.g. -3 "
                             "or 2.5, else that whole answer stripped)")


PARSERS = {"generate": generate_parser, "chat": chat_parser}      # cli.py builds each command's parser with these


# --- Checking flags before anything is loaded ---------------------------------------------------

def _explicit_sampling(args: argparse.Namespace) -> dict[str, float | int | None]:
    """The sampling flags given on the command line (None = not given), validated now, before loading."""
    from ..core.sampling import SamplingParams
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    SamplingParams(**{name: value for name, value in given.items() if value is not None})
    return given


def _max_new_tokens(args: argparse.Namespace, chat: bool = True) -> int:
    """-n, or the default: room for Qwen3's thinking when it thinks (a chat turn, --think not off)."""
    if args.max_new_tokens == UNTIL_CONTEXT_IS_FULL:
        return sys.maxsize                       # context_budget caps it at the context
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    return THINKING_MAX_NEW_TOKENS if chat and args.think is not False else DEFAULT_MAX_NEW_TOKENS


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts: positional ones (- is all of stdin), -p ones, then every line of each --file."""
    prompts = [_read_stdin() if text == "-" else text for text in [*args.prompt, *args.prompts]]
    for name in args.file:
        try:
            text = _read_stdin() if name == "-" else Path(name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise QwenNPError(f"--file {name}: not UTF-8 text") from None
        except OSError as error:
            raise QwenNPError(f"--file {name}: {error.strerror}") from None
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise QwenNPError(f"--file {name}: no prompts in it (one per line)")
        prompts += lines
    if not prompts:
        raise QwenNPError("prompt: none given (pass PROMPT, - to read it from stdin, or --file FILE)")
    return prompts


def _read_stdin() -> str:
    """All of stdin, decoded as UTF-8 whatever the locale (the text wrapper of a C locale would let
    bad bytes through as surrogates, which the tokenizer cannot encode)."""
    if sys.stdin.isatty():
        print("reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr)
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as bad:
        raise QwenNPError(f"stdin: not UTF-8 text (byte {raw[bad.start]:#04x} at offset {bad.start})") from None


def _choosers(args: argparse.Namespace) -> tuple[Reward, Reward | None]:
    """--vote's answer extractor and --best-of's reward function (None without it), loaded before any weight is,
    so that a bad FILE.py:FUNCTION is the only line printed."""
    from ..training import rollouts
    chooser = "--vote" if args.vote else "--best-of" if args.best_of else None
    if chooser and args.samples is None:
        raise QwenNPError(f"{chooser}: chooses among several replies: give --samples K")
    if args.extract and not args.vote:
        raise QwenNPError("--extract: takes each reply's answer for --vote: give --vote too")
    extract = rollouts.load_function(args.extract, "extract") if args.extract else rollouts.last_number
    return extract, rollouts.load_function(args.best_of, "best_of") if args.best_of else None


def _parse_attention(spec: str, config: Qwen3Config) -> tuple[int, int]:
    """`LAYER:HEAD` -> (layer, head), both checked against the model's shape."""
    try:
        layer, head = (int(part) for part in spec.split(":"))
    except ValueError:
        raise QwenNPError(f"--attention: expected LAYER:HEAD, e.g. 0:3, got {spec!r}") from None
    if not (0 <= layer < config.num_hidden_layers and 0 <= head < config.num_attention_heads):
        raise QwenNPError(f"--attention: the model has layers 0..{config.num_hidden_layers - 1} and heads "
                          f"0..{config.num_attention_heads - 1}, got {spec!r}")
    return layer, head


def _parse_layers(spec: str, config: Qwen3Config) -> set[int]:
    """`0,35` -> {0, 35}, each checked against the model's layer count."""
    try:
        layers = {int(part) for part in spec.split(",")}
    except ValueError:
        raise QwenNPError(f"--trace-layers: expected comma-separated layer numbers, e.g. 0,35, got {spec!r}") from None
    bad = sorted(n for n in layers if not 0 <= n < config.num_hidden_layers)
    if bad:
        raise QwenNPError(f"--trace-layers: the model has layers 0..{config.num_hidden_layers - 1}, got {bad[0]}")
    return layers


# --- Opening a checkpoint ----------------------------------------------------------------------

@dataclass
class Opened:
    """--model's files (read before any weight is: enough to check every input), the name the user knows it
    by, and whether it is the bundled Shakespeare model, which the user must be told about."""

    files: ModelFiles
    name: str
    bundled: bool

    @property
    def config(self) -> Qwen3Config:
        return self.files.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.files.tokenizer

    @property
    def defaults(self) -> GenerationDefaults:
        return self.files.generation_defaults


def _open_checkpoint(model: str | None) -> Opened:
    from ..files.model_files import open_model
    folder = common.model_folder(model)
    bundled = common.is_bundled(folder)
    return Opened(open_model(folder), common.BUNDLED_NAME if bundled else model or str(folder), bundled)


def _read_lora(args: argparse.Namespace, opened: Opened) -> Adapter | None:
    """The --lora adapter (None without it), read and checked against the model's config before any weight loads."""
    return common.read_lora(args.lora, opened.config) if args.lora is not None else None


def _load_weights(opened: Opened, args: argparse.Namespace, max_tokens: int, adapter: Adapter | None) -> Qwen3Model:
    """Load the weights, once every input has been checked (so a bad input is the only line printed), with
    the --lora adapter applied."""
    from ..engine.loading import attach_adapter, load_model
    if opened.bundled and not args.quiet:
        print(BUNDLED_NOTICE, file=sys.stderr)
    model = load_model(opened.files, memory=args.memory, max_tokens=max_tokens, kv_dtype=args.kv_dtype)
    if adapter is not None:
        attach_adapter(model, adapter)
    if args.verbose and model.plan is not None:
        print(model.plan.describe(), file=sys.stderr)
    return model


# --- Writing the reply -------------------------------------------------------------------------

class ReplyWriter:
    """Streams reply text to stdout as it arrives; on a terminal the <think> part is shown dimmed, and
    with hide_think it is not shown at all (nor the blank lines between it and the answer).

    <think> and </think> are single tokens, so a text delta never holds half a tag.
    """

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, stream: TextIO, hide_think: bool = False) -> None:
        self.stream = stream
        self.styled = stream.isatty() and "NO_COLOR" not in os.environ and not hide_think
        self.hide_think = hide_think
        self.thinking = False
        self.wrote = False

    def write(self, text: str) -> None:
        from ..files.tokenizer import THINK_CLOSE, THINK_OPEN
        if self.hide_think:
            text = self._answer_only(text)
        if self.styled:
            text = text.replace(THINK_OPEN, self.DIM + THINK_OPEN).replace(THINK_CLOSE, THINK_CLOSE + self.RESET)
            self.thinking = (self.thinking or THINK_OPEN in text) and THINK_CLOSE not in text
        self.stream.write(text)
        self.stream.flush()
        self.wrote = self.wrote or bool(text)

    def _answer_only(self, text: str) -> str:
        from ..files.tokenizer import THINK_CLOSE, THINK_OPEN
        shown = ""
        while text:
            if self.thinking:
                _, closed, text = text.partition(THINK_CLOSE)
                self.thinking = not closed
            else:
                before, opened, text = text.partition(THINK_OPEN)
                shown += before
                self.thinking = bool(opened)
        return shown if self.wrote else shown.lstrip("\n")      # the answer starts after the blank lines

    def end(self) -> None:
        """Finish the reply: undo the style of an unfinished think block and end the line."""
        if self.thinking and self.styled:
            self.stream.write(self.RESET)
        if self.wrote:
            self.stream.write("\n")
        self.stream.flush()
        self.thinking = self.wrote = False


# --- Commands ----------------------------------------------------------------------------------

def run_generate(args: argparse.Namespace) -> int:
    from ..engine.finite import check_weights_finite
    from ..generation.generate import GenerationStats, context_budget, generate, prompt_ids, resolve_sampling
    explicit = _explicit_sampling(args)
    if args.attention_png and not args.attention:
        raise QwenNPError("--attention-png: needs --attention LAYER:HEAD to say which head to draw")
    prompts = _read_prompts(args)
    inspecting = args.trace or args.trace_layers or args.lens or args.attention
    if len(prompts) > 1 and inspecting:
        raise QwenNPError(f"--trace/--lens/--attention: look at one prompt at a time (got {len(prompts)})")
    if (args.samples or 1) > 1 and inspecting:
        raise QwenNPError(f"--trace/--lens/--attention: look at one reply at a time (got --samples {args.samples})")
    extract, reward = _choosers(args)
    prompts = [text for text in prompts for _ in range(args.samples or 1)]      # each prompt's samples in a row
    stats, name = GenerationStats(), args.model or common.BUNDLED_NAME
    if explicit["seed"] is None:              # drawn here, so that the stats line can say which it was
        explicit["seed"] = stats.seed = secrets.randbelow(2 ** 31)
    hide_think = args.hide_think or bool(args.json_schema or args.grammar)    # stdout: the constrained answer
    writer = ReplyWriter(sys.stdout, hide_think=hide_think)
    replies: list[PromptReply] = []
    try:
        started = time.perf_counter()
        opened = _open_checkpoint(args.model)
        name = opened.name
        chat = _renders_chat(args, opened)
        max_new_tokens = _max_new_tokens(args, chat=chat)
        params = resolve_sampling(opened.defaults, args.think, **explicit)
        ids = [prompt_ids(opened.tokenizer, text, chat=chat, enable_thinking=args.think,
                          system=args.system) for text in prompts]
        if args.ctx_size is not None:       # prompt and reply together (several prompts: the longest one's)
            longest = max(len(one) for one in ids)
            if longest >= args.ctx_size:
                raise QwenNPError(f"--ctx-size: {args.ctx_size} positions leave no room after a {longest}-token prompt")
            max_new_tokens = min(max_new_tokens, args.ctx_size - longest)
        budget = max(context_budget(opened.config, len(one), max_new_tokens) for one in ids)
        trace = _tracer(args, opened.config)
        attention = _parse_attention(args.attention, opened.config) if args.attention else None
        draft = common.check_speculation(args, opened.config, opened.tokenizer)
        adapter = _read_lora(args, opened)
        grammar = _grammar(args, opened, thinking=chat and args.think is not False)
        if not (chat or args.no_chat):      # no template: said only now that every input has been checked
            if not args.quiet:
                print(NO_CHAT_TEMPLATE_NOTICE, file=sys.stderr)
        model = _load_weights(opened, args, budget, adapter)
        speculation = common.speculation(args, draft, budget)
        stats.load_seconds = time.perf_counter() - started
        if args.verbose:
            for one in ids:
                print(f"prompt ids: {one}", file=sys.stderr)
        if len(ids) == 1:
            _show_inspections(args, model, ids[0], opened.tokenizer, attention)
            replies.append(PromptReply(len(ids[0]), params.seed))
            for event in generate(model, opened.tokenizer, ids[0], params, max_new_tokens, stop=args.stop,
                                  eos_token_ids=opened.defaults.eos_token_ids, trace=trace, stats=stats,
                                  kv_dtype=args.kv_dtype, speculation=speculation, grammar=grammar,
                                  thinking_budget=args.thinking_budget):
                replies[0].add(event, writer if _streams(args) else None)
            replies[0].prefill_seconds, replies[0].decode_seconds = stats.prefill_seconds, stats.decode_seconds
            replies[0].count(stats.counts, speculation)
        else:
            check_weights_finite(model)      # generate() checks every step's logits; the batch does not
            replies = _generate_batch(model, opened, ids, params, max_new_tokens, args, writer, stats, speculation,
                                      grammar)
    except KeyboardInterrupt:
        stats.finish_reason = "interrupted"
    writer.end()
    if args.verbose:
        for reply in replies:
            print(f"generated ids: {reply.token_ids}", file=sys.stderr)
    if args.vote or args.best_of:
        for first in range(0, len(replies), args.samples):
            _print_chosen(prompts[first], replies[first:first + args.samples], first // args.samples, args,
                          extract, reward, stats.load_seconds, hide_think)
    elif args.json:
        for text, reply in zip(prompts, replies):
            print(json.dumps(reply.as_json(text, stats.load_seconds, hide_think), ensure_ascii=False))
    print(stats.summary(name), file=sys.stderr)
    return EXIT_INTERRUPTED if stats.finish_reason == "interrupted" else 0


def _streams(args: argparse.Namespace) -> bool:
    """Whether the replies stream to stdout as they are generated: not with --json, nor when --vote or --best-of
    prints one of them when all are in."""
    return not (args.json or args.vote or args.best_of)


def _print_chosen(prompt: str, samples: list[PromptReply], number: int, args: argparse.Namespace, extract: Reward,
                  reward: Reward | None, load_seconds: float, hide_think: bool) -> None:
    """One prompt's --vote answer or --best-of reply (the text) on stdout and how it was chosen (the note) on
    stderr; or, with --json, one line with both and every sample."""
    shown = [reply.as_json(prompt, load_seconds, hide_think) for reply in samples]
    where = f"prompt {number + 1}"
    chosen, text, note = (_vote(extract, samples, shown, where) if reward is None else
                          _best_of(reward, prompt, samples, shown, where))
    if args.json:
        print(json.dumps({"prompt": prompt, **chosen, "samples": shown}, ensure_ascii=False))
    else:
        print(text)
        print(note, file=sys.stderr)


def _vote(extract: Reward, samples: list[PromptReply], shown: list[dict[str, object]],
          where: str) -> tuple[dict[str, object], str, str]:
    """The majority of the answers `extract` takes out of the samples (each sample's put in `shown`)."""
    from ..training import rollouts
    answers = [rollouts.answer_of(extract, reply.text, f"{where}, sample {j + 1}") for j, reply in enumerate(samples)]
    answer, votes = rollouts.majority(answers)
    for sample, one in zip(shown, answers):
        sample["answer"] = one
    counts = ", ".join(f"{one!r}: {count}" for one, count in votes.items()) or "no sample gave an answer"
    note = f"vote: {votes.get(answer or '', 0)} of {len(samples)} samples answer {answer!r} ({counts})"
    return {"answer": answer, "votes": votes}, answer or "", note


def _best_of(reward: Reward, prompt: str, samples: list[PromptReply], shown: list[dict[str, object]],
             where: str) -> tuple[dict[str, object], str, str]:
    """The sample of highest reward(prompt, completion) (each sample's put in `shown`; a tie: the first)."""
    from ..training import rollouts
    rewards = [rollouts.reward_of(reward, rollouts.Prompt(where, prompt, {}), reply.text, "best_of")
               for reply in samples]
    best = rewards.index(max(rewards))
    for sample, value in zip(shown, rewards):
        sample["reward"] = value
    text = str(shown[best]["text"])
    note = (f"best of {len(samples)}: sample {best + 1} (seed {samples[best].seed}), reward {rewards[best]:g} "
            f"(rewards: {', '.join(f'{value:g}' for value in rewards)})")
    return {"text": text, "reward": rewards[best], "best": best}, text, note


def _grammar(args: argparse.Namespace, opened: Opened, thinking: bool) -> Grammar | None:
    """The grammar of --json-schema FILE or --grammar FILE (None without either); thinking: Qwen3 may think
    first (the chat template lets it), the grammar then holding the answer after its think block."""
    flag, name = ("--json-schema", args.json_schema) if args.json_schema else ("--grammar", args.grammar)
    if not name:
        return None
    from ..generation import constraints       # llguidance, an optional package, loads only when asked for
    try:
        text = Path(name).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise QwenNPError(f"{flag} {name}: not UTF-8 text") from None
    except OSError as error:
        raise QwenNPError(f"{flag} {name}: {error.strerror}") from None
    vocab = constraints.vocabulary(opened.tokenizer, opened.config.vocab_size, opened.defaults.eos_token_ids)
    if flag == "--json-schema":
        return constraints.json_schema_grammar(text, vocab, thinking=thinking, where=f"{flag} {name}")
    return constraints.text_grammar(text, vocab, thinking=thinking, where=f"{flag} {name}")


def _renders_chat(args: argparse.Namespace, opened: Opened) -> bool:
    """Whether generate renders the prompt with the chat template: unless --no-chat, or the model has none
    (a model trained only to continue text, like the bundled one: its prompt is the text to continue)."""
    if args.no_chat:
        return False
    if opened.tokenizer.has_chat_template:
        return True
    if args.system is not None:
        raise QwenNPError("--system: this model has no chat template, so it takes no system prompt")
    return False


@dataclass
class PromptReply:
    """One prompt's generated tokens and text, for the text output, --json and --verbose."""

    prompt_tokens: int
    seed: int | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    speculation: dict[str, object] = field(default_factory=dict)     # SpeculationCounts.usage, when speculating

    def count(self, counts: SpeculationCounts, speculation: Speculation | None) -> None:
        """Take the speculation counts of its generation (none without speculation)."""
        if speculation is not None:
            self.speculation = counts.usage(len(self.token_ids))

    def add(self, event: TokenEvent, writer: ReplyWriter | None) -> None:
        self.token_ids.append(event.token_id)
        self.text += event.text
        self.finish_reason = event.finish_reason
        if writer is not None:
            writer.write(event.text)

    def as_json(self, prompt: str, load_seconds: float, hide_think: bool) -> dict[str, object]:
        from ..files.tokenizer import split_thinking
        new = len(self.token_ids)
        return {"prompt": prompt, "text": split_thinking(self.text)[1] if hide_think else self.text,
                "token_ids": self.token_ids, "finish_reason": self.finish_reason or "interrupted",
                "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": new,
                          "total_tokens": self.prompt_tokens + new, **self.speculation},
                "timings": {"load_s": round(load_seconds, 4), "prefill_s": round(self.prefill_seconds, 4),
                            "decode_s": round(self.decode_seconds, 4),
                            "decode_tok_s": round(new / self.decode_seconds, 2) if self.decode_seconds else None},
                "seed": self.seed}


def _generate_batch(model: Qwen3Model, opened: Opened, ids: list[list[int]], params: SamplingParams,
                    max_new_tokens: int, args: argparse.Namespace, writer: ReplyWriter,
                    stats: GenerationStats, speculation: Speculation | None, grammar: Grammar | None) -> list[PromptReply]:
    """Several prompts as one batch (batching.BatchGenerator). Each reply prints when those before it
    have: the first streams live, the others show what they have so far when their turn comes."""
    from ..engine.budget import context_for, pool_blocks
    from ..engine.paged import BlockPool
    from ..generation.batching import BatchGenerator, Request
    from ..generation.speculative import SpeculationCounts
    positions = [context_for(model.config, len(one) + max_new_tokens, default=None) for one in ids]
    pool = BlockPool(model.config, pool_blocks(positions),
                     args.kv_dtype, prefix_caching=True)          # room for every row at once: none waits
    generator = BatchGenerator(model, opened.tokenizer, eos_token_ids=opened.defaults.eos_token_ids,
                               max_batch=len(ids), pool=pool, speculation=speculation)
    seeds = [None if params.seed is None else params.seed + i for i in range(len(ids))]
    rows = [generator.submit(Request(one, replace(params, seed=seed), max_new_tokens, args.stop, grammar,
                                     thinking_budget=args.thinking_budget))
            for one, seed in zip(ids, seeds)]
    replies = [PromptReply(len(one), seed) for one, seed in zip(ids, seeds)]
    started, shown = time.perf_counter(), 0
    stats.prompt_tokens = sum(len(one) for one in ids)

    def show_finished() -> None:
        nonlocal shown
        while _streams(args) and shown < len(rows) and rows[shown].done:
            writer.end()
            shown += 1
            if shown < len(rows):
                writer.stream.write("\n")              # a blank line between one prompt's reply and the next
                writer.write(replies[shown].text)

    try:
        while not generator.idle:
            for row, event in generator.step():
                if isinstance(event, BaseException):     # a row's sampling failed: the run's error, as alone
                    raise event
                replies[row.number].add(event, writer if row.number == shown and _streams(args) else None)
            show_finished()
            stats.new_tokens = sum(len(reply.token_ids) for reply in replies)
    finally:
        for row, reply in zip(rows, replies):
            first = row.first_token or time.perf_counter()
            reply.prefill_seconds = first - started
            reply.decode_seconds = (row.finished or time.perf_counter()) - first
            if row.continuation is not None:
                reply.count(row.continuation.counts, speculation)
        # As generate()'s: the prompt tokens computed, and those the prefix cache held (a prompt's --samples
        # after the first take its full blocks from it: the prompt is read once).
        stats.prompt_tokens = generator.prompt_tokens - generator.reused_tokens
        stats.cached_tokens = generator.reused_tokens
        firsts = [row.first_token for row in rows if row.first_token]
        stats.prefill_seconds = (max(firsts) - started) if firsts else 0.0
        stats.decode_seconds = time.perf_counter() - started - stats.prefill_seconds
        stats.finish_reason = ",".join(sorted({reply.finish_reason or "interrupted" for reply in replies}))
        if speculation is not None:           # every row's steps together: tokens per row and target step
            stats.speculation = speculation.describe
            counted = [row.continuation for row in rows if row.continuation is not None]
            stats.counts = sum((one.counts for one in counted), SpeculationCounts())
    return replies


def _tracer(args: argparse.Namespace, config: Qwen3Config) -> Trace | None:
    if not (args.trace or args.trace_layers):
        return None
    from ..inspection.trace import Tracer   # the debugging tools load only when asked for
    return Tracer(stream=sys.stderr, layers=_parse_layers(args.trace_layers, config) if args.trace_layers else None)


def _show_inspections(args: argparse.Namespace, model: Qwen3Model, ids: list[int], tokenizer: Tokenizer,
                      attention: tuple[int, int] | None) -> None:
    """The views of the prompt asked for with --lens / --attention, on stderr before generating."""
    if not (args.lens or attention):
        return
    from ..inspection.attention import attention_view
    from ..inspection.lens import logit_lens
    if args.lens:
        print(logit_lens(model, ids, tokenizer), file=sys.stderr)
    if attention:
        print(attention_view(model, ids, tokenizer, *attention, png_path=args.attention_png), file=sys.stderr)


def run_chat(args: argparse.Namespace) -> int:
    from ..engine.finite import check_weights_finite
    from ..engine.budget import context_for
    from ..generation.generate import ChatSession, GenerationStats, resolve_sampling
    explicit = _explicit_sampling(args)
    started = time.perf_counter()
    try:
        opened = _open_checkpoint(args.model)
        if not opened.tokenizer.has_chat_template:
            raise QwenNPError("chat: this model has no chat template: use generate, which continues text")
        context = context_for(opened.config, args.ctx_size)
        draft = common.check_speculation(args, opened.config, opened.tokenizer)
        model = _load_weights(opened, args, context, _read_lora(args, opened))
        check_weights_finite(model)        # else every turn would end in the same error, and the chat go on
        session = ChatSession(model, opened.tokenizer,
                              resolve_sampling(opened.defaults, args.think, **explicit),
                              eos_token_ids=opened.defaults.eos_token_ids, system=args.system,
                              enable_thinking=args.think, max_tokens=context, kv_dtype=args.kv_dtype,
                              speculation=common.speculation(args, draft, context),
                              thinking_budget=args.thinking_budget)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    load_seconds = time.perf_counter() - started
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (imported for its effect: line editing and history for input())
    print("chat: type a message and press Enter; /help lists the commands; Ctrl-C stops a reply, Ctrl-D ends "
          "the chat", file=sys.stderr)
    writer = ReplyWriter(sys.stdout, hide_think=args.hide_think)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)         # the shell's prompt then starts on a clean line
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return EXIT_INTERRUPTED
        if not line.strip():
            continue
        if line.startswith("/"):
            if _chat_command(line, session, opened, explicit):
                continue
            return 0
        max_new_tokens = _max_new_tokens(args, chat=session.enable_thinking is not False)
        dropped = session.make_room(line, max_new_tokens)
        if dropped:
            print(f"chat: the context ({context} tokens) is full: dropped the oldest {dropped} turn(s)", file=sys.stderr)
        stats = GenerationStats(load_seconds=load_seconds)
        load_seconds = 0.0          # reported once, with the first turn
        try:
            for event in session.send(line, max_new_tokens, stats):
                writer.write(event.text)
        except KeyboardInterrupt:
            stats.finish_reason = "interrupted"
        except QwenNPError as problem:      # e.g. one message longer than the context: say so, keep chatting
            writer.end()
            print(f"error: {error_line(problem)}", file=sys.stderr)
            continue
        writer.end()
        if args.verbose:          # as llama-cli and Ollama: the stats when asked for, not after every turn
            print(f"cache: {session.cache.length} positions after this turn", file=sys.stderr)
            print(stats.summary(opened.name), file=sys.stderr)


def _chat_command(line: str, session: ChatSession, opened: Opened, explicit: dict[str, float | int | None]) -> bool:
    """Run a /command; False means the chat ends."""
    from ..generation.generate import resolve_sampling
    command, _, rest = line.strip().partition(" ")
    rest = rest.strip()
    if command == "/exit":
        return False
    if command == "/clear":
        session.clear()
        print("chat: conversation cleared", file=sys.stderr)
    elif command == "/system":
        session.set_system(rest or None)
        print(f"chat: system prompt {'set' if rest else 'removed'}", file=sys.stderr)
    elif command == "/think" and rest in ("on", "off"):
        session.enable_thinking = rest == "on"
        session.params = replace(resolve_sampling(opened.defaults, session.enable_thinking, **explicit),
                                 seed=session.params.seed)
        print(f"chat: thinking {rest}", file=sys.stderr)
    else:
        known = command in ("/help", "/think")
        print(("" if known else f"chat: unknown command {command}\n") + "commands:\n" +
              "\n".join(f"  {name:<14} {what}" for name, what in CHAT_COMMANDS.items()), file=sys.stderr)
    return True
