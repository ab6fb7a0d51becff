"""The `higgs-rt` command line: speak, voice, serve, ray-serve, wyoming, client, export, make-random-checkpoint.

Errors a user can cause (bad arguments, empty text, a missing model, no audio device) end with one line on
stderr and a non-zero exit: 2 for usage, 1 for what the environment lacks, 130 for Ctrl-C. Never a traceback.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from . import timing
from .client import add_parser as add_client_parser, printable_line, run as run_client
from .cli_options import (file_arg, load_tts, location_arg, model_args, model_id, out_file_arg, path_arg,
                          ray_serve_args, server_args)
from .params import BY_NAME, add_cli_options, cli_params

EXIT_USAGE, EXIT_ENV, EXIT_INTERRUPT = 2, 1, 130


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_ENV):
        super().__init__(message)
        self.code = code


def _speak_parser(sub) -> None:
    p = sub.add_parser("speak", help="speak text on the speakers (and/or write a WAV), streaming as it is generated",
                       description="Speak TEXT ('-' reads stdin). Plays on the default output device unless "
                                   "--out is given; with --out and --play it does both.")
    p.add_argument("text", nargs="?", help="text to speak, or - for stdin")
    model_args(p)
    p.add_argument("--device", help="audio output device: index or part of its name (see --list-devices)")
    p.add_argument("--list-devices", action="store_true", help="list audio output devices and exit")
    p.add_argument("--out", type=out_file_arg, help="write the speech here instead of playing, in the format the "
                                                "suffix names: .wav (16-bit), .flac, .ogg (Vorbis), .mp3; 24 kHz mono")
    p.add_argument("--play", action="store_true", help="with --out: also play")
    p.add_argument("--stream-text", action="store_true",
                   help="with -: speak stdin as it arrives, each clause as soon as it is complete "
                        "(llm ... | higgs-rt speak - --stream-text)")
    add_cli_options(p.add_argument_group("synthesis", "per-call settings (the same as the Python API's)"))
    p.add_argument("--voice", help="speak in a stored voice (see `higgs-rt voice add`)")
    p.add_argument("--ref-audio", type=file_arg, help="clone the voice of this recording (WAV/FLAC, 0.5 to 30 s); "
                                                  "needs --ref-text")
    p.add_argument("--ref-text", help="the transcript of --ref-audio")


def _voice_parser(sub) -> None:
    p = sub.add_parser("voice", help="manage cloned voices: add, list, rm",
                       description="Cloned voices are encoded once and kept under $HIGGS_RT_HOME/voices "
                                   "(default ~/.cache/higgs-rt/voices); use one with `speak --voice NAME`.")
    actions = p.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="encode a reference recording and its transcript; keep it as NAME")
    add.add_argument("name", help="1 to 64 letters, digits, '_' or '-'")
    add.add_argument("--audio", type=file_arg, help="the reference recording: WAV/FLAC, 0.5 to 30 s, any rate")
    add.add_argument("--text", help="the transcript of the reference recording")
    add.add_argument("--model", type=location_arg,
                     help="take the codec bundled with this model directory (MODEL/audio_tokenizer)")
    add.add_argument("--codec", type=location_arg, help="codec directory (default: as `speak` finds it)")
    add.add_argument("--compute", choices=("auto", "cpu", "cuda"), default="auto", help="where the encoder runs")
    actions.add_parser("list", help="list the stored voices")
    rm = actions.add_parser("rm", help="remove a stored voice")
    rm.add_argument("name")


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="compile the Talker and codec ahead of time, for fast starts (AOTInductor)",
                       description="Export the prompt prefill, the decode step (one per --batch size) and the codec "
                                   "decode as AOTInductor packages with a manifest, for this device and dtype. "
                                   "`speak` uses them from MODEL/compiled or --compiled DIR. Needs a source "
                                   "checkout (tools/export).")
    model_args(p, compiled=False, verbose=False)
    p.add_argument("--out", type=path_arg, help="where to write them (default: MODEL/compiled)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="decode step batch sizes (default: 1)")
    p.add_argument("--kernels", choices=("higgs-rt", "torch"), default="higgs-rt",
                   help="higgs-rt: the packages call higgs-rt's kernels (C++ operators of libhiggs_rt_ops.so); "
                        "torch: Inductor's and cuBLAS kernels only")
    p.add_argument("--no-host-weights", action="store_true",
                   help="skip weights.pt (a copy of the weights for hosts without Python, examples/host)")
    p.add_argument("--cxx", help="C++ compiler for the packages' libraries; it must link the shared libstdc++ "
                                 "(default: $CXX, g++ or c++, the first that does)")
    p.add_argument("--jobs", type=int, default=None,
                   help="packages compiled at once, each in a process of its own (default: one per 8 cores)")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible speech server (POST /v1/audio/speech), batched",
                       description="Serve the OpenAI audio API over HTTP; concurrent requests share the decode "
                                   "loop through --slots batch slots, with at most --queue requests waiting. Exit "
                                   "codes: 0 stopped cleanly, 1 could not start, 2 bad arguments, 3 requests cut "
                                   "at --shutdown-timeout, 130 forced by a second signal.")
    server_args(p, port=8094)
    # serve's own: ray-serve's connections are Serve's proxy's
    p.add_argument("--head-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request head, from its opening or its last response "
                        "(default 10); then 408 and the close")
    p.add_argument("--max-connections", type=int, default=None,
                   help="connections open at once, WebSockets included; more are answered 503 and closed (default: "
                        "4 x (slots + queue + max-ws-connections), at least 256, within the file descriptor limit)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _ray_serve_parser(sub) -> None:
    p = sub.add_parser("ray-serve", help="the speech server as a Ray Serve deployment: --replicas engines behind "
                                         "Serve's HTTP proxy (needs the ray extra)",
                       description="Run `serve`'s API in --replicas Ray Serve replicas, each with its own batch "
                                   "engine (one GPU each with --compute cuda), behind Serve's HTTP proxy on "
                                   "--host/--port. A replica takes --slots requests at once; up to --queue more "
                                   "wait in Serve's queue (beyond: 429). deploy/ray/serve.yaml is the same "
                                   "application for `serve run`. Ctrl-C or SIGTERM stops it.")
    ray_serve_args(p)


def _wyoming_parser(sub) -> None:
    p = sub.add_parser("wyoming", help="Wyoming text-to-speech server (Home Assistant and other local assistants; "
                                       "needs the wyoming extra)",
                       description="Answer Wyoming describe, synthesize and streaming synthesis events on --uri. "
                                   "Wyoming has no authentication: loopback only unless --no-auth.")
    p.add_argument("--uri", default="tcp://127.0.0.1:10200", help="tcp://HOST:PORT (default tcp://127.0.0.1:10200)")
    p.add_argument("--no-auth", action="store_true", help="serve on a non-loopback address (no authentication)")
    model_args(p)
    add_cli_options(p.add_argument_group("synthesis", "settings for every request"))
    p.add_argument("--max-connections", type=int, default=8, help="connections at once (default 8); they take "
                                                                  "turns at the engine")
    p.add_argument("--max-input-chars", type=int, default=4096, help="longest text of a request (default 4096)")
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="seconds a connection may send nothing while nothing is spoken to it (or read nothing while "
                        "audio waits for it) before it is closed (default 300)")


def _random_parser(sub) -> None:
    p = sub.add_parser("make-random-checkpoint",
                       help="write a random model + codec for offline smoke runs (noise, not speech)",
                       description="Write a Talker with random weights and a random codec under DIR/audio_tokenizer. "
                                   "Random weights make noise, not speech: for smoke runs and benchmarks.")
    p.add_argument("dir", type=path_arg, help="a new or empty directory (one holding a checkpoint needs --force)")
    p.add_argument("--size", choices=("tiny", "small", "full"), default="tiny",
                   help="small: 512-wide, head size 128 and 1024 codes (the GPU kernels' shapes); full: 3B")
    p.add_argument("--layout", choices=("transformers", "boson"), default="transformers")
    p.add_argument("--seed", type=int, default=0,
                   help=f"seed of the random weights (default 0; {BY_NAME['seed'].bounds()})")
    p.add_argument("--force", action="store_true", help="replace the checkpoint DIR already holds")


class _Parser(argparse.ArgumentParser):
    """argparse's error line without its usage block: `higgs-rt speak: error: ... (see higgs-rt speak --help)`,
    exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _SubParser(_Parser):
    """A subcommand's parser (and its subcommands'): its unrecognized arguments are its own error, like its other
    errors. argparse leaves them to the top-level parser, whose error sent to `higgs-rt --help`."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Building and parsing it imports no torch: `higgs-rt --help` is instant."""
    from . import __version__

    ap = _Parser(prog="higgs-rt", description="Fast, streaming Higgs-Audio v2 text-to-speech.")
    ap.add_argument("--version", action="version", version=f"higgs-rt {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_SubParser)
    _speak_parser(sub)
    _voice_parser(sub)
    _serve_parser(sub)
    _ray_serve_parser(sub)
    _wyoming_parser(sub)
    add_client_parser(sub)
    _export_parser(sub)
    _random_parser(sub)
    return ap


def _read_text(arg: str | None) -> str:
    if arg is None:
        raise CliError("speak needs TEXT (or - to read stdin)", EXIT_USAGE)
    return _not_empty(sys.stdin.read() if arg == "-" else arg)


def _not_empty(text: str) -> str:
    if not text.strip():
        raise CliError("the text to speak is empty", EXIT_USAGE)
    try:  # bytes that are not UTF-8 reach argv and stdin as lone surrogates
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CliError(f"the text to speak is not valid UTF-8 (character {e.start})", EXIT_USAGE) from None
    return text


def cmd_speak(args) -> int:
    if args.list_devices:
        from .audio_out import list_devices

        print(list_devices())
        return 0
    if args.stream_text and args.text != "-":
        raise CliError("--stream-text speaks stdin as it arrives: give - as TEXT", EXIT_USAGE)
    text = None if args.stream_text else _read_text(args.text)
    with timing.stage("checks", "arguments, text, voice, output"):
        _check_compute(args)
        from .params import SynthesisParams
        from .prompt import check_text

        params = cli_params(args)
        SynthesisParams.create(**params)  # bad values fail before the model loads
        if text is not None:
            check_text(text)
        _check_voice_args(args)
        if args.out is not None:
            from .audio_file import check_output

            check_output(args.out)  # a directory, a bad suffix or an unwritable place: said before loading
    play = args.out is None or args.play
    device = int(args.device) if args.device and args.device.isdigit() else args.device
    if play:
        from .audio_out import check_device

        with timing.stage("audio device check", "sounddevice, PortAudio"):
            check_device(device)  # no audio device: say so before loading gigabytes
    # No warm-up utterance: this process speaks once, and what a warm-up pre-pays (CUDA graph captures, kernel
    # loading) the first utterance pays on first use anyway, before its first audio; the warm-up's own utterance
    # would only delay it (README "Cold start").
    tts = load_tts(args, warmup=False)
    voice = tts.clone_voice(args.ref_audio, args.ref_text) if args.ref_audio else tts.resolve_voice(args.voice)
    if text is None:
        # --stream-text reads stdin once the model is loaded; blank to its end, it is refused as `speak ""` is,
        # before --out is touched or a device opened
        pieces = _stdin_pieces()
        pieces = itertools.chain([_first_text(pieces)], pieces)
    writer, finished = None, False
    if args.out is not None:
        from .audio_file import open_output

        writer = open_output(args.out, tts.sample_rate)  # opened at the first chunk
    try:
        if text is None:
            stats = _speak_stdin(tts, voice, params, device if play else False, writer, pieces)
        elif play:
            stats = tts.speak(text, voice=voice, device=device, on_chunk=writer.write if writer else None, **params)
        else:
            stream = tts.stream(text, voice=voice, **params)
            for chunk in stream:
                writer.write(chunk)
            stats = stream.stats
        finished = True
    finally:
        if writer is not None:  # a Ctrl-C leaves a valid file of what was generated; a failure before any audio
            writer.close(keep_empty=finished)  # (a transcript too long for the context) leaves --out as it was
    if stats.truncated:
        print(f"higgs-rt: warning: {stats.truncated} utterance(s) reached --max-frames {args.max_frames} without "
              "ending: raise --max-frames or shorten the text", file=sys.stderr)
    if args.out is not None:
        print(f"wrote {args.out} ({stats.audio_s:.2f} s)", file=sys.stderr)
    timing.report()  # --verbose: where the cold start's time went
    print(stats.summary(), file=sys.stderr)
    return 0


STDIN_READ = 4096  # bytes at most per read of stdin: what has arrived, never waiting for a whole line


def _stdin_pieces():
    """stdin decoded as it arrives: what each read got (never waiting for a whole line), then the decoder's rest."""
    import codecs
    import os

    decoder, read = codecs.getincrementaldecoder("utf-8")(), 0

    def decode(data: bytes, final: bool = False) -> str:
        nonlocal read
        start = read - len(decoder.getstate()[0])  # where this input begins: a read's undecided end comes first
        read += len(data)
        try:
            return decoder.decode(data, final)
        except UnicodeDecodeError as e:
            raise CliError(f"stdin is not valid UTF-8 (byte {start + e.start})", EXIT_USAGE) from None

    while data := os.read(sys.stdin.fileno(), STDIN_READ):
        yield decode(data)
    yield decode(b"", final=True)


def _first_text(pieces) -> str:
    """The pieces up to the first that is not blank, joined; stdin blank to its end is empty text."""
    head = ""
    for piece in pieces:
        head += piece
        if head.strip():
            break
    return _not_empty(head)


def _speak_stdin(tts, voice, params: dict, device, writer, pieces):
    """`speak - --stream-text`: stdin's `pieces` fed to a text session as they arrive (`higgs_rt.session`); each
    clause is played (device False: not) and/or written as soon as it is complete. A pipe faster than speech
    waits: the session holds a bounded amount of unspoken text. Returns the session's stats."""
    from contextlib import nullcontext

    from .audio_out import AudioPlayer
    from .session import SessionClosed

    def check(event) -> None:
        if event is not None and event.kind == "error":
            raise CliError(event.error)

    with AudioPlayer(device=device, samplerate=tts.sample_rate) if device is not False else nullcontext() as player:
        def on_audio(chunk) -> None:
            if player is not None:
                player.write(chunk)
            if writer is not None:
                writer.write(chunk)

        session = tts.session(voice, on_audio=on_audio, **params)
        try:
            try:
                for piece in pieces:
                    session.feed(piece, wait=True)  # an utterance starting makes room
            except SessionClosed:  # it failed: its error event says why
                pass
            session.close()
            for event in session:
                check(event)
        except BaseException:  # Ctrl-C or an error: silence now, then let it propagate
            session.cancel()
            if player is not None:
                player.stop()
            raise
        if player is not None:
            player.finish()
            session.stats.underruns = player.underruns
    return session.stats


def _check_voice_args(args) -> None:
    """A bad voice name, an unknown voice or an unusable reference recording: usage errors, before loading."""
    if args.voice is not None and (args.ref_audio or args.ref_text is not None):
        raise CliError("--voice and --ref-audio/--ref-text are alternatives: give one", EXIT_USAGE)
    if (args.ref_audio is None) != (args.ref_text is None):
        raise CliError("--ref-audio and --ref-text go together: the recording and its transcript", EXIT_USAGE)
    if args.voice is not None:
        from .voices import VoiceStore

        VoiceStore().get(args.voice)
    if args.ref_audio is not None:
        from .audio_in import check_transcript, load_reference

        check_transcript(args.ref_text)
        load_reference(args.ref_audio)


def cmd_voice(args) -> int:
    from .voices import VoiceError, VoiceStore, check_name

    store = VoiceStore()
    if args.action == "list":  # the readable voices on stdout; one that cannot be read is a warning, not a failure
        names = store.names()
        for name in names:
            try:
                voice = store.get(name)
            except VoiceError as e:
                print(f"higgs-rt: warning: {e}, or remove it: higgs-rt voice rm {name}", file=sys.stderr)
                continue
            print(f"{name}\t{voice.codes.shape[0]} frames\t{printable_line(voice.text, None)}")  # one line each
        if not names:
            print(f"no voices in {store.dir}", file=sys.stderr)
        return 0
    check_name(args.name)
    if args.action == "rm":
        store.remove(args.name)
        print(f"removed voice {args.name}", file=sys.stderr)
        return 0
    if args.audio is None or args.text is None:
        raise CliError("voice add needs --audio REF.wav and --text TRANSCRIPT", EXIT_USAGE)
    from .audio_in import check_transcript, load_reference

    check_transcript(args.text)
    load_reference(args.audio)  # an unusable recording fails before the codec is looked for
    from .codec import resolve_codec_dir
    from .model import default_device
    from .hub import resolve_model_dir
    from .voices import VoiceLibrary

    _check_compute(args)
    model_dir = resolve_model_dir(args.model) if args.model and args.codec is None else None
    device = default_device() if args.compute == "auto" else args.compute
    library = VoiceLibrary(resolve_codec_dir(args.codec, model_dir), device, store)
    voice = library.add(args.name, args.audio, args.text)
    print(f"added voice {args.name}: {voice.codes.shape[0]} frames from {args.audio} -> {store.path(args.name)}",
          file=sys.stderr)
    return 0


def _check_compute(args) -> None:
    if args.compute != "auto":
        from .model import resolve_device

        try:
            resolve_device(args.compute)
        except ValueError as e:
            raise CliError(f"--compute {args.compute}: {str(e).split(': ', 1)[-1]}") from None


def cmd_export(args) -> int:
    try:
        from tools.export import ExportProbeError, ToolchainError, export_artifacts
    except ModuleNotFoundError as e:
        if e.name not in ("tools", "tools.export"):
            raise
        raise CliError("export needs a source checkout of higgs-rt (tools/export): pip install -e .") from None
    from .torch_compat import UnsupportedTorch

    _check_compute(args)
    try:
        out = export_artifacts(args.model, args.out, codec=args.codec,
                               device=None if args.compute == "auto" else args.compute, dtype=args.dtype,
                               batch_sizes=tuple(args.batch), context=args.context, kernels=args.kernels,
                               cxx=args.cxx, host_weights=not args.no_host_weights, jobs=args.jobs,
                               progress=sys.stderr.isatty())
    except (ExportProbeError, ToolchainError, UnsupportedTorch) as e:
        raise CliError(str(e)) from None
    print(f"exported to {out}; `higgs-rt speak --compiled {out}` uses them", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    try:
        from .server_process import ServeError, serve_command
    except ImportError as e:
        raise CliError(f"serve needs the server extra ({e.name} is missing): pip install 'higgs-rt[server]'")

    def load():
        _check_compute(args)
        return load_tts(args, slot=False)  # the batch engine has the decoder: none for TTS's own slot

    try:
        return serve_command(args, model_id(args), load)  # usage, then the port, then the model (server_process)
    except ServeError as e:
        raise CliError(str(e), e.code) from None


def cmd_ray_serve(args) -> int:
    try:
        from .deploy.ray import run_command
        from .server_process import ServeError
    except ImportError as e:
        raise CliError(f"ray-serve needs the ray extra ({e.name} is missing): pip install 'higgs-rt[ray]'") from None
    try:
        return run_command(args)
    except ServeError as e:
        raise CliError(str(e), e.code) from None


def cmd_wyoming(args) -> int:
    try:
        from .wyoming_server import WyomingError, run_command
    except ImportError as e:
        raise CliError(f"wyoming needs the wyoming extra ({e.name} is missing): pip install 'higgs-rt[wyoming]'") \
            from None

    def load():
        _check_compute(args)
        tts = load_tts(args)
        timing.mark("ready", final=True)
        timing.report()  # --verbose: where the start-up's time went
        return tts

    args.model_name = model_id(args)
    try:
        return run_command(args, load)
    except WyomingError as e:
        raise CliError(str(e)) from None


def cmd_random(args) -> int:
    from .fixtures.checkpoint import write_random_checkpoint

    BY_NAME["seed"].check(args.seed, "--seed")  # speak's range: torch's generators take it (and the codec's seed + 1)
    try:
        write_random_checkpoint(args.dir, args.size, layout=args.layout, seed=args.seed, force=args.force)
    except ImportError as e:  # transformers (codec layout) and llama-models (tokenizer) come with the test extra
        raise CliError(f"make-random-checkpoint needs {e.name or 'a package'}: pip install -e '.[test]'") from None
    print(f"random {args.size} model ({args.layout} layout) with its codec in {args.dir}: noise, not speech")
    return 0


def _environment_errors() -> tuple[type[BaseException], ...]:
    """What the machine or the files lack (OSError: no such file, no permission, a full disk): exit 1. (Other
    ValueErrors are bad arguments: exit 2.)"""
    from .audio_file import OutputUnwritable
    from .audio_out import AudioDeviceError
    from .codec import CodecCheckpointError, CodecNotFoundError
    from .config import ConfigError
    from .hub import ModelNotFoundError
    from .talker import KVCacheTooLarge
    from .text_encoder import TokenizerError
    from .weights import WeightsError

    return (AudioDeviceError, CodecCheckpointError, CodecNotFoundError, ConfigError, ModelNotFoundError,
            WeightsError, OutputUnwritable, KVCacheTooLarge, TokenizerError, OSError)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """The CLI's warnings as its errors are: one line, no source location. (A format, not a `showwarning`: code
    that records warnings, `warnings.catch_warnings(record=True)`, still gets them.)"""
    return f"higgs-rt: warning: {' '.join(str(message).split()).removeprefix('higgs-rt: ')}\n"


def main(argv: list[str] | None = None) -> int:
    import warnings

    formatted, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return _main(argv)
    finally:
        warnings.formatwarning = formatted


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):  # time the cold start from the process's start (higgs_rt.timing)
        timing.start()
        with timing.stage("import torch"):
            import torch  # noqa: F401
    run = {"speak": cmd_speak, "voice": cmd_voice, "serve": cmd_serve, "ray-serve": cmd_ray_serve,
           "wyoming": cmd_wyoming, "client": run_client, "export": cmd_export, "make-random-checkpoint": cmd_random}[args.command]
    try:
        return run(args)
    except KeyboardInterrupt:
        print("higgs-rt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPT
    except Exception as e:
        if isinstance(e, CliError):
            code = e.code
        elif isinstance(e, _environment_errors()):
            code = EXIT_ENV
        elif isinstance(e, (ValueError, TypeError)):
            code = EXIT_USAGE
        else:
            raise
        message = " ".join(line.strip() for line in str(e).splitlines()) or type(e).__name__
        print(f"higgs-rt: error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
