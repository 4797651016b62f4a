"""braid-client: stream a generation from a braid server to the terminal, or query the server."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage

from braid.client.client import Client
from braid.client.errors import BraidError, from_rpc_error
from braid.client.generation import finish_reason_name
from braid.client.request import PARAMS, Chat, choice, function_choice, grammar, json_object, json_schema, regex
from braid.v1 import generate_pb2 as pb

EXIT_FAILED = 1  # a call failed
EXIT_CANCELLED = 130  # the shell's code for a process ended by SIGINT
PROG = "braid-client"
DISTRIBUTION = "braid-llm-client"  # the client's name on PyPI (braid.client's import name is another)


def _bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKEN_ID=BIAS, e.g. 42=-100") from None


def _version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Stream text from a braid server.")
    parser.add_argument("--version", action="version", version=f"braid-client {_version()}")
    parser.add_argument("prompt", nargs="?", help="the prompt; '-' or absent (with piped stdin) reads stdin")
    parser.add_argument(
        "--target",
        default=os.environ.get("BRAID_TARGET", "localhost:50051"),
        help="host:port of the server (env BRAID_TARGET; default %(default)s)",
    )
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user message of a chat")
    parser.add_argument(
        "--ids",
        action="store_true",
        help="the prompt is token ids ('1 2 3' or '1,2,3', as --tokenize prints them): sent as prompt_token_ids",
    )
    parser.add_argument("--system", metavar="TEXT", help="a system message first (implies --chat)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="deadline of the call")
    parser.add_argument("--stats", action="store_true", help="print finish reason, usage, timings to stderr")

    sampling = parser.add_argument_group("generation (GenerateRequest fields; unset: the server's default)")
    sampling.add_argument("--max-new-tokens", type=int)
    sampling.add_argument("--min-new-tokens", type=int)
    sampling.add_argument("--temperature", type=float, help="0 is greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--typical-p", type=float, help="locally typical sampling, in (0, 1]")
    sampling.add_argument("--repetition-penalty", type=float)
    sampling.add_argument("--presence-penalty", type=float, help="OpenAI's, over generated tokens: -2 to 2")
    sampling.add_argument("--frequency-penalty", type=float, help="OpenAI's, over generated tokens: -2 to 2")
    sampling.add_argument(
        "--logit-bias",
        type=_bias,
        action="append",
        metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit (repeatable)",
    )
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeatable)")
    sampling.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=int,
        action="append",
        metavar="ID",
        help="a stop token id (repeatable)",
    )
    sampling.add_argument(
        "--include-stop-sequence",
        action="store_true",
        default=None,
        help="send the stop string that ended the generation as text",
    )
    sampling.add_argument(
        "--logprobs", action="store_true", default=None, help="ask for each token's log probability (shown by --stats)"
    )
    sampling.add_argument("--top-logprobs", type=int, metavar="K", help="and the K (0-20) most likely tokens")
    sampling.add_argument(
        "--prompt-logprobs",
        action="store_true",
        default=None,
        help="ask for the prompt tokens' log probabilities (shown by --stats)",
    )
    sampling.add_argument(
        "--truncate-input-tokens",
        type=int,
        metavar="N",
        help="keep at most the last N prompt tokens (a chat: drop its oldest turns first)",
    )
    sampling.add_argument(
        "--bad-word", dest="bad_words", action="append", metavar="TEXT", help="a word never to generate (repeatable)"
    )
    sampling.add_argument(
        "--report-queue", action="store_true", default=None, help="show the queue position while waiting (to stderr)"
    )
    sampling.add_argument("-n", type=int, metavar="N", help="N samples of the prompt (1-16), seeded seed + i")
    sampling.add_argument(
        "--resume-token-id",
        dest="resume_token_ids",
        type=int,
        action="append",
        metavar="ID",
        help="a token id a broken stream had delivered, to go on from (repeatable, in order; "
        "with that stream's --seed)",
    )
    sampling.add_argument(
        "--disable-speculation",
        action="store_true",
        default=None,
        help="no speculative decoding for this request (the same tokens; --stats shows proposals)",
    )
    sampling.add_argument(
        "--skip-detokenize",
        action="store_true",
        default=None,
        help="receive token ids only, no text: prints the ids (stop strings are refused with it)",
    )
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument(
        "--enable-thinking",
        type=lambda v: {"true": True, "false": False}[v.lower()],
        metavar="true|false",
        help="the chat template's switch: false turns a reasoning model's thinking off",
    )
    sampling.add_argument(
        "--max-reasoning-tokens",
        type=int,
        metavar="N",
        help="a reasoning model's budget: braid closes its reasoning there",
    )
    sampling.add_argument("--request-id")
    sampling.add_argument(
        "--priority",
        type=lambda v: pb.Priority.Value("PRIORITY_" + v.upper()),
        metavar="interactive|batch",
        help="queue priority under load",
    )
    sampling.add_argument(
        "--timeout-ms", type=int, metavar="MS", help="end the generation with finish reason DEADLINE after this long"
    )
    sampling.add_argument(
        "--cache-salt", metavar="TEXT", help="share cached prompt prefixes only with requests of the same salt"
    )
    sampling.add_argument("--adapter", metavar="NAME", help="run with this loaded LoRA adapter (ModelInfo lists them)")
    # GenerateRequest.constraint: one of these (the parsed constraint is set in _generate)
    constraint = parser.add_argument_group("output constraint (GenerateRequest.constraint; one of)")
    constraint = constraint.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this schema file")
    constraint.add_argument("--json-object", action="store_true", help="the output is any JSON object")
    constraint.add_argument("--regex", metavar="PATTERN", help="the whole output matches this regular expression")
    constraint.add_argument(
        "--choice", metavar="A,B,C", help="the output is exactly one of these comma-separated strings"
    )
    constraint.add_argument(
        "--grammar", metavar="FILE", help="the output is a sentence of this grammar (--grammar-syntax)"
    )
    parser.add_argument("--grammar-syntax", choices=("lark", "gbnf"), default="lark", help="--grammar's dialect")
    parser.set_defaults(constraint=None, prompt_token_ids=None)  # the ids: --ids's prompt, set in _run
    # GenerateRequest.tools and tool_choice (parsed in _generate)
    tools = parser.add_argument_group("tool calls (GenerateRequest.tools; the calls are printed as JSON lines)")
    tools.add_argument(
        "--tools",
        metavar="FILE",
        help="a JSON file of a list of tools: OpenAI's function definitions, or {name, description, parameters}"
        " (with --tokenize and --chat, rendered as a generation's)",
    )
    tools.add_argument(
        "--tool-choice", metavar="auto|none|required|NAME", help="whether the model must call a tool, or which one"
    )

    security = parser.add_argument_group("security")
    security.add_argument("--tls", action="store_true", help="connect with TLS (system CAs unless --ca-cert)")
    security.add_argument("--ca-cert", metavar="PATH", help="PEM CA certificates (implies --tls)")
    security.add_argument("--client-cert", metavar="PATH", help="PEM client certificate for mTLS")
    security.add_argument("--client-key", metavar="PATH", help="PEM client key for mTLS")
    security.add_argument("--api-key", default=os.environ.get("BRAID_API_KEY"), help="bearer token (env BRAID_API_KEY)")

    actions = parser.add_argument_group("instead of generating").add_mutually_exclusive_group()
    actions.add_argument("--info", action="store_true", help="print ModelInfo as JSON")
    actions.add_argument("--status", action="store_true", help="print ServerStatus as JSON")
    actions.add_argument("--tokenize", action="store_true", help="print the prompt's tokens as JSON")
    actions.add_argument("--offsets", action="store_true", help="as --tokenize, with each token's character offsets")
    actions.add_argument(
        "--detokenize", action="store_true", help="print the text of the prompt's token ids (as --ids) as JSON"
    )
    actions.add_argument("--health", action="store_true", help="print the health status; exit 1 unless SERVING")
    actions.add_argument(
        "--embed",
        action="append",
        metavar="TEXT",
        help="print the embedding of TEXT (repeatable: one input each; with --ids, token ids) as JSON",
    )
    actions.add_argument(
        "--kv-events",
        action="store_true",
        help="print the prefix cache's events (SubscribeKvEvents: pages stored and evicted) as JSON lines as "
        "they come, until interrupted or --max-events",
    )

    embed = parser.add_argument_group("embeddings (EmbedRequest fields, with --embed)")
    embed.add_argument("--pooling", choices=("last", "mean"), help="unset: the model's (ModelInfo's embedding_pooling)")
    embed.add_argument("--dimensions", type=int, default=0, help="keep the leading N components (Matryoshka)")
    embed.add_argument("--no-normalize", action="store_true", help="the pooled vector as it is, not unit length")

    kv_events = parser.add_argument_group("KV-cache events (with --kv-events)")
    kv_events.add_argument(
        "--after-sequence", type=int, default=0, help="the last sequence seen: events after it (0: all held)"
    )
    kv_events.add_argument("--max-events", type=int, default=0, help="stop after N events (0: no limit)")
    return parser


def _read_prompt(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    if args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if args.prompt is None:
        parser.error("a prompt is needed (as an argument, or on stdin)")
    return str(args.prompt)


Input = tuple[str | None, list[tuple[str, str]] | None]  # (prompt, messages): one of them is None


def _input(args: argparse.Namespace, text: str) -> Input:
    """Returns (prompt, None), or (None, messages) for --chat and --system."""
    if not (args.chat or args.system):
        return text, None
    system = [("system", args.system)] if args.system else []
    return None, [*system, ("user", text)]


def _token_ids(text: str, parser: argparse.ArgumentParser) -> list[int]:
    """The ids in '1 2 3', '1,2,3' or '[1, 2, 3]'."""
    try:
        return [int(t) for t in text.replace(",", " ").strip("[] \n").split()]
    except ValueError:
        parser.error(f"--ids: expected token ids separated by spaces or commas, got {text[:40]!r}")


def _print_json(message: ProtoMessage) -> None:
    print(
        json_format.MessageToJson(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    )


def _logprobs_line(logprobs: list[float]) -> str:
    return f"logprobs: {len(logprobs)} tokens, mean {sum(logprobs) / len(logprobs):.3f}, lowest {min(logprobs):.3f}"


def _end_line() -> None:
    """Ends the streamed text's line and sends it out, before anything goes to stderr."""
    print()
    sys.stdout.flush()


def _print_stats(final: pb.GenerateResponse, logprobs: list[float], label: str) -> None:
    sys.stdout.flush()  # the text first, where stdout and stderr are one pipe
    if logprobs:
        print(f"{label}{_logprobs_line(logprobs)}", file=sys.stderr)
    usage, timings = final.usage, final.timings
    print(
        f"{label}finish_reason: {finish_reason_name(final.finish_reason)}  "
        f"request_id: {final.request_id}  seed: {final.seed}\n"
        f"{label}usage: {usage.prompt_tokens} prompt tokens ({usage.cached_tokens} from the cache, "
        f"{usage.truncated_tokens} cut), "
        f"{usage.generated_tokens} generated tokens"
        + (
            f" ({usage.accepted_tokens} of {usage.proposed_tokens} speculative proposals accepted)"
            if usage.proposed_tokens
            else ""
        )
        + "\n"
        f"{label}timings: queue {timings.queue_ms:.1f} ms, first token {timings.time_to_first_token_ms:.1f} ms, "
        f"total {timings.total_ms:.1f} ms, {timings.tokens_per_second:.1f} tokens/s",
        file=sys.stderr,
    )


def _constraint(args: argparse.Namespace) -> pb.Constraint | None:
    """The constraint the flags ask for, or None."""
    if args.json_schema:
        return json_schema(Path(args.json_schema).read_text())
    if args.json_object:
        return json_object()
    if args.regex is not None:
        return regex(args.regex)
    if args.choice is not None:
        return choice(args.choice.split(","))
    if args.grammar:
        return grammar(Path(args.grammar).read_text(), args.grammar_syntax)
    return None


def _tools(args: argparse.Namespace) -> list[dict[str, object]] | None:
    """The --tools file's tools (OpenAI's definitions), or None."""
    return json.loads(Path(args.tools).read_text()) if args.tools else None


def _generate(client: Client, args: argparse.Namespace, prompt: str | None, messages: Chat | None) -> int:
    params = {name: getattr(args, name) for name in PARAMS}  # None: left to the server
    params["logit_bias"] = dict(args.logit_bias) if args.logit_bias else None
    params["constraint"] = _constraint(args)
    params["tools"] = _tools(args)
    if args.tool_choice is not None:
        modes = ("auto", "none", "required")
        params["tool_choice"] = args.tool_choice if args.tool_choice in modes else function_choice(args.tool_choice)
    logprobs: defaultdict[int, list[float]] = defaultdict(list)  # by sample index
    prompt_logprobs: list[float] = []
    with client.stream(prompt, messages=messages, timeout=args.timeout, **params) as generation:
        try:
            for message in generation:
                if message.reasoning:  # a reasoning model's reasoning: to stderr, apart from the answer
                    sys.stderr.write(message.reasoning)
                    sys.stderr.flush()
                if generation.n == 1:  # n > 1: each sample is printed whole once all have ended
                    sys.stdout.write(
                        "".join(f"{t} " for t in message.token_ids) if args.skip_detokenize else message.text
                    )
                    sys.stdout.flush()
                logprobs[message.index] += [lp.logprob for lp in message.logprobs]
                prompt_logprobs += [lp.logprob for lp in message.prompt_logprobs]
                if message.queue_position:
                    print(f"[queue position {message.queue_position}]", file=sys.stderr)
        except BraidError:
            if generation.n == 1 and generation.text:
                _end_line()  # the error goes on a line of its own
            raise
    if generation.n == 1:
        _end_line()
    if args.stats and prompt_logprobs:
        print(f"prompt {_logprobs_line(prompt_logprobs)}", file=sys.stderr)
    for completion in generation.completions() if generation.final is not None else ():
        index = completion.final.index
        if generation.n > 1:
            print(f"--- sample {index} ---\n{completion.text}")
        for call in completion.tool_calls:
            print(json.dumps({"id": call.id, "name": call.name, "arguments": call.arguments}))
        if args.stats:
            _print_stats(completion.final, logprobs[index], f"[sample {index}] " if generation.n > 1 else "")
    return 0


def _run(client: Client, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.info:
        _print_json(client.model_info(timeout=args.timeout))
    elif args.status:
        _print_json(client.server_status(timeout=args.timeout))
    elif args.health:
        status = client.health(timeout=args.timeout)
        print(status)
        return 0 if status == "SERVING" else 1
    elif args.kv_events:
        events = client.kv_events(args.after_sequence, timeout=args.timeout)
        for count, event in enumerate(events, 1):
            print(json_format.MessageToJson(event, preserving_proto_field_name=True, indent=None), flush=True)
            if count == args.max_events:
                events.close()
                break
    elif args.embed:
        inputs: list[str] | list[list[int]] = [_token_ids(t, parser) for t in args.embed] if args.ids else args.embed
        response = client.embed(
            inputs,
            pooling=args.pooling,
            normalize=False if args.no_normalize else None,
            dimensions=args.dimensions,
            truncate_input_tokens=args.truncate_input_tokens or 0,
            timeout=args.timeout,
        )
        _print_json(response)
    elif args.ids or args.detokenize:
        if args.chat or args.system or args.tokenize or args.offsets:
            parser.error("token ids (--ids, --detokenize) go with none of --chat, --system, --tokenize, --offsets")
        ids = _token_ids(_read_prompt(args, parser), parser)
        if args.detokenize:
            _print_json(client.detokenize(ids, timeout=args.timeout))
            return 0
        args.prompt_token_ids = ids
        return _generate(client, args, None, None)
    else:
        prompt, messages = _input(args, _read_prompt(args, parser))
        if not (args.tokenize or args.offsets):
            return _generate(client, args, prompt, messages)
        tokenized = client.tokenize(
            prompt,
            messages=messages,
            return_offsets=args.offsets,
            tools=_tools(args),
            enable_thinking=args.enable_thinking,
            timeout=args.timeout,
        )
        _print_json(tokenized)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs braid-client with argv (default: sys.argv[1:]) and returns its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.client_cert is None) != (args.client_key is None):
        parser.error("--client-cert and --client-key go together")
    try:
        client = Client(
            args.target,
            tls=args.tls,
            root_certificates=args.ca_cert,
            client_cert=args.client_cert,
            client_key=args.client_key,
            api_key=args.api_key,
        )
    except OSError as error:  # an unreadable certificate
        parser.error(str(error))
    try:
        with client:  # leaving it closes the channel, which cancels a running stream
            return _run(client, args, parser)
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        return EXIT_CANCELLED
    except grpc.RpcError as error:  # a BraidError: "braid-client: invalid argument: temperature: ..."
        print(f"{PROG}: {from_rpc_error(error)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
