"""The `ortpipe` command: run, chat, inspect, validate, serve, web."""

from __future__ import annotations

import os
import signal
import sys


def _quit(signum: int, frame: object) -> None:
    """Ctrl-C before the command's model is loaded (imports, argument parsing, the load), and in the
    commands that load none through `_load` (web, bench; serve once uvicorn has shut down and passes the
    interrupt on): the command ends at once with status 130 and no traceback. What was printed is flushed,
    and no exception is raised: one raised inside an import (a dataclass's generated methods, a C
    extension's init) can be caught or rewrapped there, or make Python end by SIGINT itself (status -2)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # the interrupted code was writing to it
            pass
    os._exit(130)


signal.signal(signal.SIGINT, _quit)

import argparse
import json
import warnings
from collections.abc import Sequence
from typing import Any

from . import variants
from .config.schema import POOLING_MODES
from .config.settings import SETTINGS
from .errors import ConfigError, GenerationError, OrtpipeError, did_you_mean
from .outputs import OutputRequest


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _place_extra(args, extra)
    if getattr(args, "text", None) is not None:
        args.prompt = args.text  # run's PROMPT is --prompt (argparse refuses both)
    warnings.showwarning = _show_warning
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"ortpipe: {args.model}: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:
        print(f"ortpipe: {e}", file=sys.stderr)
        return 2
    except OrtpipeError as e:
        print(f"ortpipe: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug in ortpipe: say so plainly, keep the traceback one variable away
        if _interrupted:
            return 130  # Ctrl-C inside a C extension's call can come out as that extension's own error
        if os.environ.get("ORTPIPE_DEBUG"):
            raise
        print(f"ortpipe: internal error: {type(e).__name__}: {e}\n"
              "This is a bug in ortpipe; run again with ORTPIPE_DEBUG=1 for the traceback and report it.",
              file=sys.stderr)
        return 3


_interrupted = False
_python_showwarning = warnings.showwarning


def _show_warning(message: Any, category: type[Warning], *where: Any, **kw: Any) -> None:
    """ortpipe's warnings (a provider passed over, a v1 key ignored) as one line each, no source line."""
    if issubclass(category, UserWarning):
        print(f"ortpipe: warning: {message}", file=sys.stderr)
    else:
        _python_showwarning(message, category, *where, **kw)


def _place_extra(args: argparse.Namespace, extra: list[str]) -> None:
    """What the command's parser did not place: `run`'s prompt written after an option (argparse places a
    second positional only next to the first), else an error from the command's own parser, with its
    usage, naming what was not understood and the closest option."""
    command: argparse.ArgumentParser = args.command_parser
    end = extra.index("--") if "--" in extra else len(extra)  # after "--": words, even with a "-"
    options = [s for s in extra[:end] if s.startswith("-") and len(s) > 1]
    extra = extra[:end] + extra[end + 1:]
    if options:
        name = options[0].split("=", 1)[0]
        known = [o for a in command._actions for o in a.option_strings]
        command.error(f"unrecognized option {name}.{did_you_mean(name, known)} "
                      f"(`{command.prog} --help` lists the options)")
    if getattr(args, "func", None) is _run:
        given = args.text is not None or args.prompt is not None or args.prompt_ids is not None
        if len(extra) == 1 and not given:
            args.text = extra[0]
            return
        words = " ".join(map(repr, extra))
        command.error(f"unexpected argument{'s' if len(extra) > 1 else ''} {words}: give the prompt once"
                      ", in quotes if it has spaces (ortpipe run MODEL_DIR \"def fib(n):\"), "
                      "or with --prompt or --prompt-ids")
    command.error(f"unrecognized arguments: {' '.join(extra)}")


def _interrupt(signum: int, frame: Any) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortpipe", description="Run generative ONNX models from a folder "
                                     "of ONNX files and one genai_config.json.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="generate from a prompt")
    run.add_argument("model", metavar="MODEL_DIR")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument("text", nargs="?", metavar="PROMPT", help="prompt text, as --prompt")
    prompt.add_argument("--prompt", help="prompt text (uses the folder's tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated: 1,2,3")
    _session_args(run)
    _plugin_arg(run)
    _generation_args(run)
    run.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for the pipeline's vision session (repeatable; one image_token each in the prompt), "
        "or the one image image-to-image starts from (a denoising folder with an image encoder; --strength)",
    )
    run.add_argument(
        "--mask",
        metavar="PATH",
        help="inpainting: an image of --image's size, white where it is repainted, black where it is kept "
        "(--strength defaults to 1 then, 0.9999 on a Stable Diffusion XL folder, 0.6 on a Stable Diffusion 3 "
        "folder, as diffusers' pipelines)",
    )
    run.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="PATH.wav",
        help="a .wav clip for the pipeline's audio encoder (repeatable)",
    )
    run.add_argument("--language", help="the language an encoder-decoder's decoder starts from (a code "
                     "the folder names, e.g. en: lang_to_id); else the model chooses")
    run.add_argument("--task", help="the task an encoder-decoder's decoder starts from (a name the folder "
                     "names: transcribe, translate)")
    run.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="feed a raw tensor to a named session input, bypassing preprocessing (repeatable)",
    )
    run.add_argument(
        "--out",
        action="append",
        default=[],
        metavar="[NAME=]FILE",
        help="write a named output (pipeline.output) to FILE by its type: .wav (audio, at the folder's "
        "sampling rate), .png (an image), .npy (any); NAME picks the output (repeatable)",
    )
    run.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (Perfetto, chrome://tracing)")
    run.add_argument("--verbose", action="store_true", help="a one-line summary per phase on stderr")
    run.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, timings")
    run.set_defaults(func=_run)

    chat = sub.add_parser("chat", help="interactive chat that keeps the KV cache across turns")
    chat.add_argument("model", metavar="MODEL_DIR")
    _session_args(chat)
    _plugin_arg(chat)
    _generation_args(chat, max_new_tokens=256)
    chat.set_defaults(func=_chat)

    inspect = sub.add_parser(
        "inspect", help="show where each session runs, what was detected and the expanded v2 config"
    )
    inspect.add_argument("model", metavar="MODEL_DIR")
    _provider_args(inspect)
    _plugin_arg(inspect)
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=_inspect)

    validate = sub.add_parser(
        "validate", help="check a model folder; exit 0, or print every problem and exit 2"
    )
    validate.add_argument("model", metavar="MODEL_DIR")
    _provider_args(validate)
    _plugin_arg(validate)

    validate.set_defaults(func=_validate)

    embed = sub.add_parser("embed", help="sentence embeddings of texts (a sentence-transformers folder)")
    embed.add_argument("model", metavar="MODEL_DIR")
    embed.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed")
    embed.add_argument("--file", metavar="FILE", help="more texts, one a line")
    embed.add_argument("--batch-size", type=int, default=32, help="texts run together, padded (default 32)")
    embed.add_argument("--pooling", choices=POOLING_MODES,
                       help="pool the token states so instead of as the folder says")
    embed.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                       help="L2-normalise the embeddings, or not (--no-normalize), instead of as the "
                       "folder says")
    embed.add_argument("--out", metavar="FILE.npy", help="write the embeddings, float32 [texts, dim]")
    embed.add_argument("--json", action="store_true", help="print {dim, embeddings: [[...], ...]}")
    _session_args(embed)
    embed.set_defaults(func=_embed)

    from . import static_server  # standard library only

    web = sub.add_parser("web", help="serve the browser bundle (dist/web; build it with python -m build.web)")
    static_server.add_arguments(web)
    web.set_defaults(func=static_server.run)

    from . import serve as serve_command  # standard library only until it runs

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (the serve extra)")
    serve_command.add_arguments(serve)
    _provider_args(serve)
    serve.set_defaults(func=serve_command.run)

    bench = sub.add_parser(
        "bench", help="--serve: the aggregate tokens/s of ortpipe serve at 1, 2, 4 and 8 concurrent streams"
    )
    bench.add_argument("--serve", action="store_true", required=True,
                       help="measure the server (starts `ortpipe serve MODEL_DIR`, or measures --url)")
    from .serve import load as serve_load  # standard library only

    serve_load.add_arguments(bench)
    bench.set_defaults(func=lambda args: serve_load.checked(bench, args))
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)  # its errors come with its own usage
    return parser


def _session_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, help="intra-op threads per session (default: onnxruntime's)")
    _provider_args(p)


def _provider_args(p: argparse.ArgumentParser) -> None:
    """Where the sessions run (README, "On edge devices")."""
    p.add_argument(
        "--ep", "--provider", action="append", default=[], metavar="[SESSION=]EP[,EP...]",
        help="execution providers tried in order, for every session (--ep openvino) or one (--ep "
        "vision=openvino,cpu): cpu, openvino, qnn, dml, cuda, tensorrt, coreml (repeatable)",
    )
    p.add_argument(
        "--profile", metavar="NAME|FILE.json",
        help="a device profile layered over the config: raspberry-pi, intel-cpu, intel-gpu, intel-npu, "
        "snapdragon-npu, windows-gpu, or a profile file",
    )
    p.add_argument("--dtype", choices=variants.SUFFIXES, help="the model variant to run when the folder has "
                   "several (model_q4.onnx, model_quantized.onnx, ...; default: the provider's fastest)")


def _load(args: argparse.Namespace, progress: bool = True) -> Any:
    """The pipeline of args.model with the command's providers, profile and threads."""
    from .targets.cpython import load, providers

    pipe = load(args.model, provider=providers.parse_overrides(args.ep), profile=args.profile,
                threads=getattr(args, "threads", None), on_progress=_progress() if progress else None,
                allow_plugins=getattr(args, "allow_plugins", False), dtype=getattr(args, "dtype", None))
    # Loaded, with every module imported: from here on Ctrl-C is a KeyboardInterrupt, so that the command's
    # loop stops where it is and its cleanup runs (the terminal's status line; a chat drops the turn).
    signal.signal(signal.SIGINT, _interrupt)
    return pipe



def _plugin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-plugins", action="store_true",
                   help="run the plugin the config names (pipeline.plugin): its code runs, so only "
                   "if you trust it")


def _generation_args(p: argparse.ArgumentParser, max_new_tokens: int | None = None) -> None:
    """A flag per generation setting of the settings table (config/settings.py)."""
    g = p.add_argument_group("generation (defaults from genai_config.json)")
    for s in SETTINGS:
        if not s.cli:
            continue
        default = max_new_tokens if s.name == "max_new_tokens" else None
        help_text = s.help + (f" (default {default})" if default else "")
        if s.kind == "bool":
            g.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif s.kind == "strings":
            g.add_argument(s.flag, action="append", help=help_text + " (repeatable)")
        elif s.kind == "ids":
            g.add_argument(s.flag, type=_ids, help=help_text + ": comma-separated ids")
        elif s.kind == "string":
            g.add_argument(s.flag, help=help_text)
        elif s.kind == "path":
            g.add_argument(s.flag, metavar="DIR", help=help_text)
        elif s.kind == "bias":
            g.add_argument(s.flag, type=_biases, metavar="ID=BIAS,...", help=help_text)
        else:
            g.add_argument(s.flag, type=int if s.kind == "int" else float, default=default, help=help_text)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,2,3, found {text!r}"
        ) from None


def _biases(text: str) -> dict[int, float]:
    """--logit-bias 50256=-100,42=2.5: {id: bias} (the setting's check then checks the ids and ranges)."""
    biases: dict[int, float] = {}
    try:
        for pair in text.replace(" ", "").split(","):
            if pair:
                token, _, bias = pair.partition("=")
                biases[int(token)] = float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ID=BIAS pairs like 50256=-100,42=2.5, found {text!r}"
        ) from None
    return biases


def _run(args: argparse.Namespace) -> int:
    from .targets.cpython import read_inputs
    from .trace import Trace

    pipe = _load(args)
    request = pipe.request(
        args.prompt,
        prompt_ids=args.prompt_ids,
        inputs=read_inputs(args.input) or None,
        images=args.image,
        audios=args.audio,
        mask=args.mask,
        **({"language": args.language} if args.language is not None else {}),
        **({"task": args.task} if args.task is not None else {}),
        **_settings(args),
    )
    trace = Trace() if args.trace or args.verbose else None
    if args.trace:
        from .targets.cpython.media import check_writable

        check_writable(args.trace, "--trace")  # before any model runs
    files = None
    staged = bool(pipe.config.pipeline.stages)  # _staged writes a pipeline of stages' outputs
    if not isinstance(request, OutputRequest) and not staged and (args.out or pipe.plan.final_phase):
        from .targets.cpython.media import plan_files

        files = plan_files(pipe.plan, args.out)  # a token loop's final steps: refused before any model runs
    if isinstance(request, OutputRequest):  # a loop that makes no tokens: named outputs
        _outputs(pipe, request, trace, args)
    elif staged:
        _staged(pipe, request, trace, args)
    elif args.json:
        chunks = []
        try:
            chunks.extend(pipe.drive(request, trace))
        except OrtpipeError as e:  # what was generated before the failure still comes out
            if e.partial is not None:
                print(json.dumps(_with_logprobs(e.partial.as_dict(), request, chunks)))
            raise
        print(json.dumps(_with_logprobs(request.result().as_dict(), request, chunks)))
    else:
        _stream(pipe, request, trace, args.prompt)
    if files is not None:
        _write(request.result(), files, sys.stderr)
    if trace and args.trace:
        from .targets.cpython.media import writing

        with writing(args.trace, "--trace"):
            trace.write(args.trace)
    if trace and args.verbose:
        for line in trace.summary():
            print(f"[{line}]", file=sys.stderr)
    return 0


def _stream(pipe: Any, request: Any, trace: Any, prompt: str | None) -> None:
    status = LiveStatus() if sys.stdout.isatty() else None
    if prompt is not None and pipe.plan.text_encoder is None:  # an encoder's text is no start of the answer
        print(prompt, end="", flush=True)
    chunks = []
    try:
        for chunk in pipe.drive(request, trace):
            chunks.append(chunk)
            print(chunk.text if pipe.tokenizer else f"{chunk.token} ", end="", flush=True)
            if status:
                status.show(request.timings)
    finally:
        if status:
            status.close()
    t = request.timings
    language = f"language {request.language}; " if getattr(request, "language", None) else ""
    print(
        f"\n\n[{language}{t.prompt_tokens} prompt tokens, {t.new_tokens} new ({request.finish_reason}); "
        f"prefill {t.prefill_ms:.1f} ms, decode {t.decode_tokens_per_s:.1f} tokens/s]",
        file=sys.stderr,
    )
    if request.settings.logprobs is not None:  # a table after the text, on stderr like the summary
        for i, c in enumerate(chunks):
            top = ", ".join(f"{token} {lp:.3f}" for token, lp in c.top_logprobs)
            print(f"[{i:4d}] {c.token:6d} {c.text!r:14} {c.logprob:9.4f}" + (f"   top: {top}" if top else ""),
                  file=sys.stderr)


def _with_logprobs(out: dict[str, Any], request: Any, chunks: list[Any]) -> dict[str, Any]:
    """`--json` with `--logprobs N`: each generated token's log-probability and the N most likely tokens."""
    if request.settings.logprobs is not None:
        out["logprobs"] = [
            {"token": c.token, "logprob": c.logprob, "top_logprobs": [list(t) for t in c.top_logprobs]}
            for c in chunks
        ]
    return out


def _outputs(pipe: Any, request: Any, trace: Any, args: argparse.Namespace) -> None:
    """Drive a single_pass or denoising request (a bar on a terminal), write its outputs, report them."""
    from .targets.cpython.media import plan_files, write_outputs

    files = plan_files(pipe.plan, args.out)  # refused before any model runs
    bar = ProgressBar() if sys.stderr.isatty() else None
    try:
        for progress in pipe.drive(request, trace):
            if bar:
                bar.show(progress, request.timings)
    finally:
        if bar:
            bar.close()
    result = request.result()
    if args.json:
        written = write_outputs(result, files)
        print(json.dumps(result.as_dict(lambda name, value: _described(value, written.get(name)))))
        return
    _write(result, files, sys.stdout)
    t = result.timings
    steps = f", {t.steps} steps of {t.step_ms:.1f} ms, final {t.final_ms:.1f} ms" if t.steps else ""
    print(f"[init {t.prefill_ms:.1f} ms{steps}; {result.finish_reason}]", file=sys.stderr)


def _write(result: Any, files: dict[str, list[str]], stream: Any) -> None:
    """Write the named outputs to their files and say where each went."""
    from .targets.cpython.media import write_outputs

    written = write_outputs(result, files)
    for name, value in result.outputs.items():
        where = f" -> {', '.join(written[name])}" if name in written else " (not written: give --out)"
        print(f"{name}: {result.kinds[name]['kind']} {value.dtype} {list(value.shape)}{where}", file=stream)


def _staged(pipe: Any, request: Any, trace: Any, args: argparse.Namespace) -> None:
    """Drive a pipeline of stages: the first stage's text as it comes, then each stage's ids and the named
    outputs (written by --out)."""
    from .targets.cpython.media import plan_files, write_outputs

    files = plan_files(pipe, args.out)  # pipe.config names every stage's outputs
    first = pipe.config.pipeline.stages[0].name
    for chunk in pipe.drive(request, trace):
        if chunk.stage == first and not args.json:
            print(chunk.text if pipe.tokenizer else f"{chunk.token} ", end="", flush=True)
    result = request.result()
    written = write_outputs(result, files)
    if args.json:
        print(json.dumps(result.as_dict(lambda name, value: _described(value, written.get(name)))))
        return
    print()
    for name, stage in list(result.stages.items())[1:]:
        made = f"{len(stage.tokens)} ids {stage.tokens}" if stage.tokens else "no ids"
        print(f"[{name}: {made} ({stage.finish_reason})]", file=sys.stderr)
    for name, value in result.outputs.items():
        where = f" -> {', '.join(written[name])}" if name in written else " (not written: give --out)"
        print(f"{name}: {result.kinds[name]['kind']} {value.dtype} {list(value.shape)}{where}")


def _described(value: Any, files: list[str] | None) -> dict[str, Any]:
    out = {"dtype": str(value.dtype), "shape": list(value.shape)}
    if files:
        out["files"] = files
    return out


class ProgressBar:
    """A line on stderr redrawn per denoising step (or batch of texts)."""

    WIDTH = 30

    def show(self, progress: Any, timings: Any) -> None:
        done = self.WIDTH * progress.step // max(progress.steps, 1)
        speed = f" {timings.step_ms / 1000:.2f} s/step" if timings.steps else ""
        sys.stderr.write(f"\r{progress.what} {progress.step}/{progress.steps} [{'=' * done}"
                         f"{' ' * (self.WIDTH - done)}]{speed}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _embed(args: argparse.Namespace) -> int:
    texts = list(args.texts)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerationError(f"--file {args.file}: {e}") from None
    if not texts:
        raise GenerationError("give texts to embed (arguments, or --file with one a line)")
    if args.out:
        from .targets.cpython.media import check_writable

        check_writable(args.out)  # before any model runs
    embeddings = _load(args).embed(texts, batch_size=args.batch_size, pooling=args.pooling,
                                   normalize=args.normalize)
    if args.out:
        from .targets.cpython.media import write_npy

        write_npy(args.out, embeddings)
    if args.json:
        print(json.dumps({"dim": int(embeddings.shape[1]), "embeddings": embeddings.tolist()}))
    elif not args.out:
        for text, row in zip(texts, embeddings, strict=True):
            values = " ".join(f"{v:+.4f}" for v in row[:4])
            print(f"[{values} ...] (dim {row.shape[0]}) {text[:60]}")
    return 0


def _progress() -> Any:
    """Model-load progress lines on stderr, when a person is watching it."""
    if not sys.stderr.isatty():
        return None
    return lambda line: print(f"[{line}]", file=sys.stderr, flush=True)


class LiveStatus:
    """A tokens/s line pinned to the terminal's last row while text streams above it.

    A scroll region keeps the streamed text in the rows above; the status is redrawn in the last
    row with the cursor saved and restored around it.
    """

    def __init__(self) -> None:
        import shutil

        self.rows = shutil.get_terminal_size().lines
        self.last = 0.0
        sys.stdout.write(f"\n\x1b[1;{self.rows - 1}r\x1b[{self.rows - 1};1H")

    def show(self, t: Any) -> None:
        import time

        now = time.monotonic()
        if now - self.last < 0.1:
            return
        self.last = now
        line = f"{t.new_tokens} tokens · {t.decode_tokens_per_s:.1f} tokens/s · prefill {t.prefill_ms:.0f} ms"
        sys.stdout.write(f"\x1b7\x1b[{self.rows};1H\x1b[2K\x1b[7m {line} \x1b[0m\x1b8")
        sys.stdout.flush()

    def close(self) -> None:
        # resetting the scroll region homes the cursor: put it back after the text, on the freed row
        sys.stdout.write(f"\x1b[{self.rows};1H\x1b[2K\x1b[r\x1b[{self.rows - 1};1H\x1b[999C")
        sys.stdout.flush()


def _settings(args: argparse.Namespace, *leave_out: str) -> dict[str, Any]:
    """The generation settings given on the command line (the table's flags)."""
    return {
        s.name: getattr(args, s.name)
        for s in SETTINGS
        if s.cli and s.name not in leave_out and getattr(args, s.name, None) is not None
    }


def _chat(args: argparse.Namespace) -> int:
    pipe = _load(args)
    chat = pipe.chat(**_settings(args, "max_new_tokens"))
    print(
        "ortpipe chat: type a message; /rewind drops the last turn, /quit (or end of input) leaves.",
        file=sys.stderr,
    )
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # a line with bytes that are not UTF-8 is said so, not fatal
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        command = line.strip()
        if command in ("/quit", "/exit"):
            return 0
        if command in ("/rewind", "rewind"):
            try:
                chat.rewind()
                print(f"[rewound: {len(chat.tokens)} tokens in the conversation]", file=sys.stderr)
            except GenerationError as e:
                print(f"[{e}]", file=sys.stderr)
            continue
        if not command:
            continue
        if "\ufffd" in line:
            print("[the line had bytes that are not UTF-8; they were replaced with \ufffd]", file=sys.stderr)
        _reply(chat, line, args.max_new_tokens)


def _reply(chat: Any, line: str, max_new_tokens: int) -> None:
    """One turn. Ctrl-C stops the reply and a failed turn is dropped (the chat goes on from the turn
    before); the session goes on either way."""
    try:
        for chunk in chat.say(line, max_new_tokens):
            print(chunk.text, end="", flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted: the turn is dropped]", file=sys.stderr)
        return
    except OrtpipeError as e:
        print(f"\n[{e}]", file=sys.stderr)
        return
    t = chat.last.timings
    print(
        f"\n[prefill {t.prompt_tokens} tokens in {t.prefill_ms:.1f} ms, {t.new_tokens} new, "
        f"{t.decode_tokens_per_s:.1f} tokens/s, {chat.last.finish_reason}]",
        file=sys.stderr,
    )


def _inspect(args: argparse.Namespace) -> int:
    from .config.expand import as_v2
    from .targets.cpython import providers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", providers.ProviderWarning)  # the report says them
        pipe = _load(args, progress=False)
    placed = pipe.assignments
    staged = getattr(pipe.model, "models", None)  # pipeline.stages: a plan per stage
    plans = {name: m.plan for name, m in staged.items()} if staged else {"": pipe.plan}
    report: dict[str, Any] = {
        "config_source": pipe.config.source,
        "sessions": {
            name: {
                "file": plan.config.pipeline.sessions[name].file,
                "provider": placed[name].provider,
                "placement": placed[name].as_dict(),
                "inputs": [f"{t.name} {t.dtype} {list(t.shape)}" for t in plan.signatures[name].inputs],
                "outputs": [f"{t.name} {t.dtype} {list(t.shape)}" for t in plan.signatures[name].outputs],
            }
            for plan in plans.values()
            for name in plan.signatures
        },
        "steps": [_step_report(s) | ({"stage": stage} if stage else {})
                  for stage, plan in plans.items() for s in plan.all_steps],
        "config": as_v2(pipe.config),
    }
    if staged:
        report["stages"] = {
            name: {"loop": plan.config.generation.loop, "sessions": list(plan.signatures),
                   "reads": [f"{w}{' (streamed)' if w.stream else ''}"
                             for w in plan.config.pipeline.stage_inputs]}
            for name, plan in plans.items()
        }
    placement = providers.report(placed.values())
    print(json.dumps(report, indent=2) if args.json else _format_report(report, placement))
    return 0


def _step_report(s: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "session": s.session,
        "when": s.step.when,
        "feeds": {
            f.input: f.kind + (f" <- {f.source}" if f.source else "") for f in s.feeds if f.kind != "past"
        },
    }
    if s.kv:
        e0 = s.kv.entries[0]
        report["kv_cache"] = {
            "format": s.kv.format,
            "share_buffer": s.kv.share_buffer,
            "layers": s.kv.layers,
            "entries": len(s.kv.entries),
            "dtype": e0.dtype,
            "shapes": sorted({str(list(e.shape)) for e in s.kv.entries}),
            "sliding_window_layers": sorted({e.layer for e in s.kv.entries if e.window}),
        }
    if s.logits:
        report["logits"] = s.logits
    return report


def _format_report(report: dict[str, Any], placement: str) -> str:
    lines = [f"config: {report['config_source']}", "providers:"]
    lines += [f"  {line}" for line in placement.splitlines()]
    for name, stage in report.get("stages", {}).items():
        lines.append(f"stage {name} ({stage['loop']}): {', '.join(stage['sessions'])}")
        lines += [f"  reads {wire}" for wire in stage["reads"]]
    for name, s in report["sessions"].items():
        lines.append(f"session {name}: {s['file']} on {s['provider']}")
        lines += [f"  in  {t}" for t in s["inputs"]] + [f"  out {t}" for t in s["outputs"]]
    for step in report["steps"]:
        where = f"{step['stage']} stage, " if "stage" in step else ""
        lines.append(f"step {step['session']} ({where}{step['when']}):")
        lines += [f"  {k}: {v}" for k, v in step["feeds"].items()]
        if "kv_cache" in step:
            lines.append(f"  kv cache: {json.dumps(step['kv_cache'])}")
    lines.append("expanded config:")
    lines.append(json.dumps(report["config"], indent=2))
    return "\n".join(lines)


def _validate(args: argparse.Namespace) -> int:
    pipe = _load(args, progress=False)
    stages = pipe.config.pipeline.stages
    steps = sum(len(s.config.pipeline.flow) for s in stages) or len(pipe.config.pipeline.flow)
    sessions = len(pipe.assignments)
    print(
        f"{args.model}: ok ({pipe.config.source} config, {sessions} session(s), "
        f"{steps} flow step(s){f', {len(stages)} stages' if stages else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
