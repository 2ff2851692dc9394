"""Chat with a trained model in the terminal.

    python -m scripts.chat_cli                      # interactive, the latest SFT model
    python -m scripts.chat_cli -i mid --model-tag d20 --step 800
    python -m scripts.chat_cli -p "Why is the sky blue?" --temperature 0   # one answer, then exit
    cat question.txt | python -m scripts.chat_cli -p -                      # the prompt from stdin

Interactive commands: /clear starts a new conversation, /quit or /exit (or Ctrl-D) exits, /help lists
them; a line starting with // sends the rest, from its second /, as a message. Ctrl-C stops the
answer being written (its partial answer stays in the conversation, as on the chat page; stopped
before any text, the message is left out); at the
prompt it exits, as /quit does (status 0; Ctrl-C in -p or while loading: status 130). Lines piped in
(stdin not a terminal) are echoed after "User: ", so the transcript shows them. Tokens are printed
as they are generated; calculator tool calls show as <<expr=result>>; on a terminal, control
characters the model writes show as U+FFFD (a carriage return as nothing). A reply cut off because
the conversation filled the model's context says so on stderr, as does a reply with no text; a
message that no longer fits is not sent (/clear starts over). -p prints the answer alone on stdout.
-i base (a pretrained model, which never saw the chat template) continues the text itself: the
prompt is <|bos|> + the text, the reply runs until --max-tokens or a <|bos|>, and each interactive
line is a prompt of its own (no history).
"""

from __future__ import annotations

import argparse
import re
import sys

from nanochat.flags import FlagParser   # torch-free: a bad flag is reported at once

SOURCES = ("sft", "rl", "mid", "base")
COMMANDS = ("/clear", "/quit", "/exit", "/help")
HELP = ("commands: /clear = new conversation, /quit or /exit = exit (or Ctrl-D, or Ctrl-C here), /help = this; "
        "//text sends /text; Ctrl-C stops an answer")
# C0 controls but tab, newline and carriage return; DEL; C1 controls. Written raw to a terminal, a
# generated ESC sequence would drive it (clear the screen, retitle the window, hide text).
CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def parse_args(argv=None) -> argparse.Namespace:
    # the docstring's examples and commands as --help's epilog: the first paragraph alone hid them
    first, rest = __doc__.split("\n\n", 1)
    p = FlagParser(prog="python -m scripts.chat_cli", description=first, epilog=rest,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--source", default="sft", help="checkpoint phase: sft|rl|mid|base (default sft)")
    p.add_argument("-g", "--model-tag", dest="model_tag", default=None,
                   help="model tag, e.g. d20 (default: the only / deepest one)")
    p.add_argument("-s", "--step", default="latest", help="checkpoint step (default: latest)")
    p.add_argument("-p", "--prompt", default=None, help="answer this one prompt and exit ('-': read it from stdin)")
    p.add_argument("-t", "--temperature", type=float, default=0.6, help="0 = greedy (default 0.6)")
    p.add_argument("-k", "--top-k", dest="top_k", type=int, default=50, help="0 = off (default 50)")
    p.add_argument("--top-p", dest="top_p", type=float, default=None, help="nucleus sampling mass in [0, 1] (0 = greedy, as in the API)")
    p.add_argument("-m", "--max-tokens", dest="max_tokens", type=int, default=512,
                   help="most tokens per reply (default 512; the model's context also ends a reply)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a new one per answer)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda|mps")
    p.add_argument("--dtype", default="auto", help="auto|bf16|fp32")
    p.add_argument("--decode", default="auto",
                   help="auto|eager|compile|static|graphs (auto: CUDA-graph decode on CUDA, eager elsewhere)")
    p.add_argument("--graph-step", dest="graph_step", default="auto",
                   help="auto|compiled|eager|persistent: what a graphed decode step runs (default auto: the "
                        "persistent Triton kernel where it was measured faster (H100/H200), else eager, the plain "
                        "model's kernels, with no torch.compile wait)")
    p.add_argument("--quantize", default="none",
                   help="none|int8: int8 weight-only matrices (nanochat/quantize.py): half the bytes a decode step "
                        "reads, for memory-bound GPUs such as the DGX Spark")
    args = p.parse_args(argv)
    if args.prompt == "-":   # the Unix convention; it answered the one-character prompt "-"
        # the other flags first (on a copy: validate rewrites some): at a terminal, `-p - -t -1` took
        # the typed prompt and then said -t was wrong, the prompt lost
        validate(argparse.Namespace(**vars(args)))
        args.prompt = read_stdin_prompt()
    validate(args)
    return args


def read_stdin_prompt() -> str:
    """The whole of stdin, as -p - gives it (blank lines around it dropped, as the chat strips a line).
    Bytes that are not UTF-8 arrive as lone surrogates, which validate() then refuses by name."""
    if sys.stdin is None:   # started with stdin closed
        raise ValueError("-p/--prompt: got '-' (read the prompt from stdin), but there is no stdin")
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    if getattr(sys.stdin, "isatty", lambda: False)():   # it waited on a terminal without a word
        print("(reading the prompt from the terminal: end it with Ctrl-D on a line of its own)", file=sys.stderr,
              flush=True)
    return sys.stdin.read().strip()


def validate(args: argparse.Namespace) -> None:
    from nanochat.engine import DECODE_MODES, GRAPH_STEPS, validate_sampling
    from nanochat.flags import check_model_tag
    from nanochat.quantize import check_quantize
    from nanochat.sampling import MAX_SEED, greedy_if_top_p_zero

    check_model_tag(args.model_tag)
    if args.step != "latest" and not re.fullmatch("[0-9]+", args.step):   # not isdigit(): "²" is a digit
        raise ValueError(f"-s/--step: got {args.step!r}; accepted: latest or an integer >= 0")
    if args.prompt is None and sys.stdin is None:   # `chat_cli <&-`: input() raised "lost sys.stdin" after loading
        raise ValueError("-p/--prompt: not given, and there is no stdin to chat on (it is closed); accepted: "
                         "-p PROMPT for one answer, or run the chat with a stdin")
    if args.prompt is not None and not args.prompt.strip():   # as the interactive loop skips empty lines
        raise ValueError("-p/--prompt: got an empty prompt; accepted: the text to answer")
    if args.prompt is not None and not _is_utf8(args.prompt):   # as the interactive loop refuses such a line
        # a non-UTF-8 argument arrives with lone surrogates, which the tokenizer turned into U+FFFD
        raise ValueError(f"-p/--prompt: got {args.prompt!r}; accepted: UTF-8 text")
    if args.decode not in DECODE_MODES:
        raise ValueError(f"--decode: got {args.decode!r}; accepted: {'|'.join(DECODE_MODES)}")
    if args.graph_step not in GRAPH_STEPS:
        raise ValueError(f"--graph-step: got {args.graph_step!r}; accepted: {'|'.join(GRAPH_STEPS)}")
    if args.source not in SOURCES:
        raise ValueError(f"-i/--source: got {args.source!r}; accepted: {'|'.join(SOURCES)}")
    check_quantize(args.quantize)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens: got {args.max_tokens}; accepted: an integer >= 1")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:   # the sampler's torch.Generator takes a uint64
        raise ValueError(f"--seed: got {args.seed}; accepted: an integer in 0..{MAX_SEED}")
    if args.top_p is not None and not 0.0 <= args.top_p <= 1.0:   # also nan
        raise ValueError(f"--top-p: got {args.top_p}; accepted: a number in [0, 1] (0 = greedy)")
    try:   # the flags as given: the greedy rewrite of --top-p 0 below would hide a bad --temperature
        validate_sampling(args.temperature, args.top_k, args.top_p or None)
    except ValueError as e:   # the engine's "None or ..." is its API's: a flag cannot be given None
        raise ValueError(f"--{str(e).replace('_', '-').replace('None or ', '')}") from None
    args.temperature, args.top_p = greedy_if_top_p_zero(args.temperature, args.top_p)


def check_decode_device(args: argparse.Namespace, device) -> None:
    """--decode graphs and --graph-step persistent need a CUDA device: said before the model loads
    (nanochat/model_choice.py, shared with chat_web)."""
    from nanochat.model_choice import check_decode_device as check

    check(args.decode, args.graph_step, device)


def check_checkpoint(args: argparse.Namespace) -> None:
    """The checkpoint -i, -g and -s name is on disk: if not, a RequestError naming the flag and what
    there is instead, before a runtime starts and the model loads (nanochat/model_choice.py, shared
    with chat_web)."""
    from nanochat.model_choice import check_checkpoint as check

    check(args.source, args.model_tag, args.step, SOURCES)


def render_prompt(tokenizer, messages: list[dict], plain: bool = False) -> list[int]:
    """The tokens the model continues: the chat template with <|assistant_start|> appended, or,
    `plain` (-i base), <|bos|> + the last message's text, as a base model was trained and as
    base_eval samples it: in the template its special tokens are ones that model never learned."""
    if plain:
        return tokenizer.encode(messages[-1]["content"], prepend="<|bos|>")
    return tokenizer.render_for_completion({"messages": messages})


def fit_prompt(engine, tokenizer, messages: list[dict], hint: str, plain: bool = False) -> list[int]:
    """The conversation's prompt tokens (render_prompt); RequestError (ending with `hint`) when it
    leaves the model's context no room for a reply."""
    from nanochat.errors import RequestError

    prompt = render_prompt(tokenizer, messages, plain)
    if len(prompt) >= engine.max_seq_len:
        what = "text" if plain else "conversation"
        raise RequestError(f"the {what} is {len(prompt)} tokens, the model's context is {engine.max_seq_len}: {hint}")
    return prompt


def fit_conversation(engine, tokenizer, messages: list[dict], plain: bool = False) -> list[int]:
    """fit_prompt for the chat, whose hint is what would help: /clear when the history is what
    does not fit, "shorten the message" when the newest message alone leaves no room (/clear
    cannot help that; it was told to type /clear, and after it to shorten the message)."""
    from nanochat.errors import RequestError

    try:
        return fit_prompt(engine, tokenizer, messages,
                          "type /clear to start over" if len(messages) > 1 else "shorten the message", plain)
    except RequestError:
        if len(messages) > 1:   # raises, with the message's own length, when it alone is too long
            fit_prompt(engine, tokenizer, messages[-1:], "shorten the message", plain)
        raise


def answer(engine, tokenizer, prompt: list[int], args, seed: int, out=None, full_hint: str = "",
           plain: bool = False) -> dict:
    """Stream one assistant reply to `prompt` to `out` (None: sys.stdout as it is now, not as it was
    at import, which a redirect since then would miss); return it as a message with tool calls kept
    as parts (`reply_content`: an unfinished one as the text it showed). A reply cut off because the context is full gets a note on stderr, ending with
    `full_hint` (what to do about it), one cut off at --max-tokens a note saying so, and one that
    ends with no text (nothing but whitespace, or special tokens shown as nothing) a note saying that.
    `plain` (-i base): a text continuation, which only <|bos|> (a new document) ends."""
    out = sys.stdout if out is None else out
    from nanochat.engine import TOOL_TEXT
    from nanochat.text_stream import TextStream

    terminal = bool(getattr(out, "isatty", lambda: False)())

    def show(text: str) -> str:   # a lone CR moved the cursor back and the rest overwrote the line;
        # dropped, as the terminal's own newline handling writes the CR of a CR LF anyway
        return CONTROL_CHARS.sub("\ufffd", text).replace("\r", "") if terminal else text

    room = engine.max_seq_len - len(prompt)
    stream = TextStream(tokenizer, special_text={tokenizer.encode_special(k): v for k, v in TOOL_TEXT.items()})
    # as the server (nanochat/server.py): a reply also ends where the model starts a user turn
    stops = {tokenizer.bos_token_id} if plain else \
        set(engine.default_stop_tokens) | {tokenizer.encode_special("<|user_start|>")}
    generated, stopped, shown = [], False, []
    try:
        for column, _ in engine.generate(prompt, max_tokens=min(args.max_tokens, room), temperature=args.temperature,
                                         top_k=args.top_k, top_p=args.top_p, seed=seed, stop_tokens=stops):
            token = column[0]
            if token in stops:
                stopped = True
                break
            generated.append(token)
            shown.append(stream.feed(token))
            out.write(show(shown[-1]))
            out.flush()
    except KeyboardInterrupt:   # end the cut-off line: what follows (the prompt, a message) starts on its own
        out.write("\n")
        out.flush()
        # a plain KeyboardInterrupt (a subclass uncaught exits 1, not 130: -p's status), carrying the
        # partial reply as a message (None: nothing readable yet), which the interactive loop keeps
        stop = KeyboardInterrupt()
        stop.message = ({"role": "assistant", "content": reply_content(tokenizer, generated)}
                        if "".join(shown).strip() else None)
        raise stop from None
    shown.append(stream.finish())
    out.write(show(shown[-1]) + "\n")
    if stopped and not "".join(shown).strip():   # a blank line alone (exit 0 for -p) read as a hang or a bug
        out.flush()
        print("[empty reply: the model ended its turn without writing any text]", file=sys.stderr, flush=True)
    elif not stopped and len(generated) >= room:   # mid-sentence, and the next turn has no room either
        out.flush()
        print(f"[cut off: the {'text' if plain else 'conversation'} filled the model's context of "
              f"{engine.max_seq_len} tokens{full_hint}]",
              file=sys.stderr, flush=True)
    elif not stopped and len(generated) >= args.max_tokens:   # as the web page says "length"
        out.flush()
        print(f"[cut off at --max-tokens {args.max_tokens}]", file=sys.stderr, flush=True)
    return {"role": "assistant", "content": reply_content(tokenizer, generated)}


def reply_content(tokenizer, ids: list[int]) -> list[dict]:
    """A reply's generated `ids` as the conversation keeps them: text and calculator calls as parts
    (assistant_parts), except a call left unfinished, which stays the text it showed ("<<2**200=16069"),
    as the chat API keeps a cut-off call (chat_api.tool_call_parts). Unfinished: Ctrl-C, --max-tokens or
    the context cut the reply before the call's forced output block closed, or the model started the
    call over (the engine evaluates only the second). As parts, the next turn's prompt held a closed
    output block of the first digits, a result the calculator never gave, or a call with no output."""
    from nanochat.engine import TOOL_TEXT, assistant_parts
    from nanochat.text_stream import TextStream

    sp = {name: tokenizer.encode_special(name) for name in TOOL_TEXT}
    start, end, out_end = sp["<|python_start|>"], sp["<|python_end|>"], sp["<|output_end|>"]

    def shown(call: list[int]) -> str:
        stream = TextStream(tokenizer, special_text={sp[k]: v for k, v in TOOL_TEXT.items()})
        return "".join(stream.feed(t) for t in call) + stream.finish()

    chunks, i, n = [], 0, len(ids)   # token runs, or an unfinished call's shown text
    while i < n:
        j = ids.index(start, i) if start in ids[i:] else n
        chunks.append(ids[i:j])
        if j == n:
            break
        k = j + 1
        while k < n and ids[k] not in (start, end):   # the expression (a python_start starts it over)
            k += 1
        if k < n and ids[k] == end and out_end in ids[k:]:   # the output block the engine forced, closed
            i = ids.index(out_end, k) + 1
            chunks.append(ids[j:i])
        else:   # cut off (or started over at k)
            i = k if k < n and ids[k] == start else n
            chunks.append(shown(ids[j:i]))
    parts: list[dict] = []
    for chunk in chunks:
        for part in [{"type": "text", "text": chunk}] if isinstance(chunk, str) else assistant_parts(tokenizer, chunk):
            if part["type"] == "text" and parts and parts[-1]["type"] == "text":   # one text, as the API has it
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
            elif part["type"] != "text" or part["text"]:
                parts.append(part)
    return parts


def main(argv=None) -> int:
    """Run the chat for command-line `argv`, or for flags parse_args has already read (a Namespace):
    the script's checked flags are reused, as `-p -` can read its stdin only once."""
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    # a terminal whose encoding lacks a character of the reply (LC_ALL=C, a Latin-1 locale) shows it
    # as '?': strict, the first one raised UnicodeEncodeError mid-answer (a traceback for -p; in the
    # chat a ValueError that replaced every reply by an error line)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    code = chat(args)
    sys.stdout.flush()    # here, where script_main stops quietly on a closed pipe (`-p ... | head`)
    return code


def chat(args: argparse.Namespace) -> int:
    """Load the model, then answer -p, or chat until /quit or Ctrl-D."""
    import secrets

    from nanochat.checkpoint import find_model_tag, load_model
    from nanochat.common import init_runtime
    from nanochat.engine import Engine
    from nanochat.quantize import quantize_model
    from nanochat.sampling import MAX_SEED

    check_checkpoint(args)
    rt = init_runtime(args.device, args.dtype)
    check_decode_device(args, rt.device)
    import torch

    # compute_dtype: --dtype is the dtype the model computes in, as chat_eval / base_eval score it
    # (without it the GPT's default, bf16 on CUDA / fp32 elsewhere, won: --dtype bf16 on a CPU
    # computed in fp32 and --dtype fp32 on CUDA in bf16, whatever the flag said)
    model, tokenizer, meta = load_model(args.source, rt.device, model_tag=args.model_tag, step=args.step,
                                        compute_dtype=rt.dtype)
    # from the float32 weights, before the cast (the int8 scales stay float32 through it): the int8
    # model chat_eval / base_eval --quantize int8 score, not one rounded through bf16 first
    quantize_model(model, args.quantize)
    if rt.dtype != torch.float32:  # inference keeps no fp32 master weights: half the bytes per step
        model = model.to(rt.dtype)
    # graphs replay a whole decode step per launch: an eager step is bound by launching its kernels
    # from Python. d20 on an H100 (CHANGELOG_GB10.md, sessions 25-26): 26 tok/s eager; graphs of the
    # plain kernels 349 tok/s after a 1.6-3.2 s warm-up; the persistent kernel ~1,500 tok/s after
    # 21 s the first time (Triton compiles it into its cache) and 1.4 s after that. Where auto does
    # not pick persistent it falls back to eager, not compiled: no torch.compile wait at start-up.
    engine = Engine(model, tokenizer, decode=args.decode, graph_step=args.graph_step, graph_fallback="eager")
    if args.prompt is not None:   # before the warm-up: a prompt too long to answer ends the run at once
        prompt = fit_prompt(engine, tokenizer, [{"role": "user", "content": args.prompt}], "shorten -p",
                            plain=args.source == "base")
    warm = 0.0
    if engine.decode_mode == "graphs":   # stderr: -p prints the answer alone on stdout
        print(f"warming up the decode step (graph step {engine.graph_step}; a machine's first start compiles "
              "its kernels, up to ~20 s on an H100)...", file=sys.stderr, flush=True)
        warm = engine.warmup(batch_sizes=(1,), all_buckets=False)
    # not the `random` module: init_runtime seeds it (42), so every session drew the same seeds and
    # a sampled -p gave the same answer run after run (the server draws its seeds so too)
    next_seed = (lambda: args.seed) if args.seed is not None else (lambda: secrets.randbelow(MAX_SEED + 1))

    if args.prompt is not None:
        if engine.graph_step_note and args.graph_step != "auto":   # an explicit --graph-step not run: said why
            print(f"[{engine.graph_step_note}]", file=sys.stderr, flush=True)
        answer(engine, tokenizer, prompt, args, next_seed(), plain=args.source == "base")
        return 0

    step = f", graph step {engine.graph_step}" if engine.decode_mode in ("static", "graphs") else ""
    tag = args.model_tag or find_model_tag(args.source)   # the one load_model took: with several, say which
    print(f"nanochat ({args.source}/{tag}, step {meta.get('step')}) on {rt.device}, decode={engine.decode_mode}{step}"
          f" (warm-up {warm:.1f} s). /clear = new chat, /quit = exit, /help = commands")
    if engine.graph_step_note:   # as chat_web's banner: why the graph step is what it is (--graph-step persistent
        print(f"  {engine.graph_step_note}")   # on a CPU ran eager, and nothing said so)
    if args.source == "base":
        print("a base model: each line is continued as plain text (no chat template, no history)")
    return converse(engine, tokenizer, args, next_seed)


def _is_utf8(text: str) -> bool:
    try:   # surrogateescape turned the bytes that were not UTF-8 into lone surrogates
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def command_mistake(word: str) -> str:
    """What to say for a line starting with `/` that is not a command alone."""
    if word in COMMANDS:   # "/clear all" said "unknown command /clear", then listed /clear
        return f"{word} takes nothing after it: type {word} alone; {HELP}"
    return f"unknown command {word}; {HELP}"


def converse(engine, tokenizer, args, next_seed) -> int:
    """The interactive loop: read a line, run a command or answer it with the conversation so far."""
    try:   # input() then edits the line (arrow keys, history) instead of typing their escape codes into it
        import readline  # noqa: F401
    except ImportError:   # a Python built without it
        pass
    if hasattr(sys.stdin, "reconfigure"):   # a line that is not UTF-8 (a Latin-1 file piped in) is said, not a traceback
        sys.stdin.reconfigure(errors="surrogateescape")
    messages: list[dict] = []
    plain = getattr(args, "source", "sft") == "base"   # each line its own text to continue
    # a line read from a pipe or a file is not echoed by a terminal: the transcript read "User: " alone
    echo = not getattr(sys.stdin, "isatty", lambda: False)()
    while True:
        try:
            print()
            text = input("User: ").strip()
            if echo:
                print(text)
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not _is_utf8(text):
            print("(that line is not UTF-8 text; send it as UTF-8)")
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/clear":
            messages = []
            print("(new conversation)")
            continue
        if text == "/help":
            print(HELP)
            continue
        if text.startswith("/") and not text.startswith("//"):   # a mistyped command is not a message
            print(command_mistake(text.split()[0]))
            continue
        if not text:
            continue
        if plain:   # a base model continues text: the previous line and its continuation are no context
            messages = []
        messages.append({"role": "user", "content": text[1:] if text.startswith("//") else text})
        try:
            print("\nAssistant: ", end="", flush=True)
            prompt = fit_conversation(engine, tokenizer, messages, plain)
            messages.append(answer(engine, tokenizer, prompt, args, next_seed(), plain=plain,
                                   full_hint="" if plain else "; type /clear to start over"))
        except KeyboardInterrupt as e:  # Ctrl-C stops the answer, not the program (answer ended its line)
            partial = getattr(e, "message", None)
            if partial is None or plain:   # nothing written yet (or no history): the message is not sent
                print("(stopped)")
                messages.pop()
            else:   # as the chat page and ChatGPT: "shorter, please" has the cut-off answer to refer to
                messages.append(partial)
                print("(stopped: the partial answer stays in the conversation; /clear starts over)")
        except ValueError as e:
            print(f"\n[{e}]")
            messages.pop()


if __name__ == "__main__":
    from nanochat.flags import script_main

    parsed = []   # parse_args once: with -p - it reads stdin
    script_main("chat_cli", lambda: parsed.append(parse_args(sys.argv[1:])), lambda: main(parsed[0]))
