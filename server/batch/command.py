"""``radixserve-batch`` (``main(argv)``): run an OpenAI batch-format JSONL file through a model offline.

  radixserve-batch -i requests.jsonl -o results.jsonl --model Qwen/Qwen3-Reranker-0.6B
  cat requests.jsonl | radixserve-batch -i - -o - --model DIR > results.jsonl

vLLM's ``run-batch`` flags where they apply (``-i/--input-file``, ``-o/--output-file``,
``--model``, ``--served-model-name``); the model and batching flags are the server's own
(server/config.py), spelled the same. Exit status: 0 when every line succeeded, 1 when any line
is an error line (this run's or an earlier run's in the same output file), 2 when the job could
not run or could not go on (bad flags, a model that does not load, an output that is not a
regular file or not a batch job's, a read or write that failed), with one line on stderr saying
why, as the server does. A job that never started leaves no output file behind.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import fields
from typing import IO, Any

import orjson

from server.batch.job import Job, Options, Totals
from server.batch.lines import count_lines
from server.batch.output import ChunkWriter, Resume, Unrunnable, check_output, scan
from server.batch.progress import Progress, fmt_duration
from server.config import ServerConfig, convert, flag_name

log = logging.getLogger("radixserve.batch")

# The server's flags a batch job takes (what loads the model and forms its batches).
MODEL_FLAGS = (
    "revision", "served_model_name", "device", "dtype", "max_batch_tokens", "max_batch_requests",
    "max_client_batch_size", "max_input_length", "auto_truncate", "max_rerank_pair_tokens", "max_embed_all_floats",
    "tokenization_workers", "radix_mlp_threshold", "radix_attention", "tree_attention", "batching_policy",
    "pooling", "default_prompt_name", "default_prompt", "prefix_cache_size", "cpu_packed_weights", "payload_limit",
    "allow_token_ids",
)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"want an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixserve-batch",
        description="Run an OpenAI batch-format JSONL file (custom_id, method, url, body per line) through "
                    "the server's routes in-process; one answer line per request line, in input order.")
    p.add_argument("-i", "--input-file", required=True, help="input .jsonl, or - for stdin")
    p.add_argument("-o", "--output-file", required=True,
                   help="output .jsonl, or - for stdout; an existing file is resumed (its custom_ids are skipped)")
    p.add_argument("--model", "--model-id", dest="model", required=True,
                   help="hub id or local checkpoint directory (as radixserve's --model-id)")
    p.add_argument("--window", type=_positive, default=Options.window,
                   help="lines sorted by token prefix and written together (memory bound; a kill loses at most one)")
    p.add_argument("--no-grouping", action="store_true", help="run each window in input order (to compare)")
    p.add_argument("--in-flight", type=_positive, default=Options.in_flight, help="lines dispatched at once")
    p.add_argument("--no-progress", action="store_true", help="no progress reports (the summary is still written)")
    p.add_argument("--report", default=None, help="also write the run's summary as JSON to this file")
    p.add_argument("--ray-actors", type=_positive, default=None,
                   help="run as a Ray Data pipeline with this many actors, one engine each (needs ray; no resume)")
    g = p.add_argument_group("model and batching (the server's flags)")
    for f in fields(ServerConfig):
        if f.name in MODEL_FLAGS:
            meta = f.metadata
            g.add_argument(flag_name(f.name), dest=f.name, default=None, metavar=f.name.upper(),
                           help=meta["help"] + (f" ({', '.join(meta['choices'])})" if meta["choices"] else ""))
    return p


def config_from(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(model_id=args.model, **config_values(args))


def config_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields the flags set (model and batching), permits sized for --in-flight."""
    values: dict[str, Any] = {}
    for name in MODEL_FLAGS:
        text = getattr(args, name)
        if text is not None:
            values[name] = convert(name, text)
    client = values.get("max_client_batch_size", ServerConfig.max_client_batch_size)
    # Permits never refuse a line: the job bounds what is in flight itself (--in-flight lines).
    values["max_concurrent_requests"] = max(ServerConfig.max_concurrent_requests, args.in_flight * client)
    return values


def summary(totals: Totals, *, grouping: bool, earlier: Resume) -> dict:
    elapsed = totals.seconds
    return {
        "lines": totals.lines, "failed": totals.failed, "skipped": totals.skipped,
        "failed_earlier": earlier.failed, "seconds": round(elapsed, 3),
        "cpu_seconds": round(totals.cpu_seconds, 3),
        "lines_per_s": round(totals.lines / elapsed, 3) if elapsed > 0 else None,
        "grouping": grouping, "tokens": int(totals.original), "compact_tokens": int(totals.compact),
        "ratio": round(totals.ratio(), 4), "computed_tokens": totals.computed,
        "prefix_cache_hit_tokens": int(totals.cache_hit), "shared_key_tokens": totals.shared_key_tokens,
    }


def summary_line(s: dict) -> str:
    return (f"batch: done: {s['lines']} lines ({s['failed']} failed, {s['skipped']} skipped as already written) "
            f"in {fmt_duration(s['seconds'])}, {s['lines_per_s']} lines/s; grouping {'on' if s['grouping'] else 'off'}; "
            f"tokens N {s['tokens']}, rows computed N' {s['compact_tokens']} (N'/N {s['ratio']:.3f}; prefix-cache hits "
            f"{s['prefix_cache_hit_tokens']}); x-compute-tokens summed {s['computed_tokens']}")


async def run(args: argparse.Namespace, config: ServerConfig, source: IO[bytes], resume: Resume,
              progress: Progress | None, runner: Any = None) -> Totals:
    """Start the engine, then open the output (only now: a job that never started leaves no file)."""
    from server.batch.inprocess import Engine, StartFailed

    options = options_of(args, config)
    try:
        engine = Engine.build(config, runner)  # loads the model (unless ``runner``)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is one line and exit 2, as the server's
        raise Unrunnable(f"could not start: {type(exc).__name__}: {exc}") from None
    try:
        async with engine:
            writer = ChunkWriter(sys.stdout.buffer, sync=False) if args.output_file == "-" \
                else ChunkWriter.open(args.output_file)
            try:
                return await Job(engine, writer, options=options, resume=resume, progress=progress).run(source)
            finally:
                if writer.stream is not sys.stdout.buffer:
                    writer.close()
    except StartFailed as exc:
        raise Unrunnable(f"could not start: {exc}") from None


def options_of(args: argparse.Namespace, config: ServerConfig) -> Options:
    return Options(window=args.window, grouping=not args.no_grouping, in_flight=args.in_flight,
                   max_line_bytes=config.payload_limit)


def run_on_ray(args: argparse.Namespace, config: ServerConfig) -> int:
    """--ray-actors: the Ray Data pipeline (server/batch/ray_data.py) on local files."""
    from server.batch.ray_data import run_ray

    if "-" in (args.input_file, args.output_file):
        raise Unrunnable("--ray-actors reads and writes files, not stdin/stdout")
    done = run_ray(args.input_file, args.output_file, model=args.model, flags=config_values(args),
                   actors=args.ray_actors, options=options_of(args, config))
    split = ", ".join(f"{name}: {n}" for name, n in sorted(done["actors"].items()))
    print(f"batch: done on Ray: {done['lines']} lines ({done['failed']} failed) over {len(done['actors'])} "
          f"actors in blocks of {done['block']} lines; lines per actor: {split}", file=sys.stderr)
    return 0 if done["failed"] == 0 else 1


def main(argv: list[str] | None = None, *, runner: Any = None) -> int:
    """Run the job; ``runner``: an already loaded model runner (tests), else loaded from the flags."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return job(args, runner)
    except Unrunnable as exc:
        print(f"radixserve-batch: {exc}", file=sys.stderr)
        return 2


def job(args: argparse.Namespace, runner: Any) -> int:
    """The whole job; raises Unrunnable for what stops it (main prints the one line, exit 2)."""
    try:
        config = config_from(args)
    except ValueError as exc:
        raise Unrunnable(str(exc)) from None
    if args.input_file != "-" and not os.path.isfile(args.input_file):
        raise Unrunnable(f"no such input file: {args.input_file}")
    if args.ray_actors is not None:
        return run_on_ray(args, config)
    resume = Resume()
    if args.output_file != "-":
        check_output(args.output_file)  # before the model loads: a bad output costs nothing
        resume = scan(args.output_file)
        if resume.written:
            log.info("resuming %s: %d lines already written (%d failed)%s", args.output_file, resume.written,
                     resume.failed, f"; cut a torn last line of {resume.torn_bytes} bytes" if resume.torn_bytes else "")
    total = None
    if args.input_file != "-":
        total = max(0, count_lines(args.input_file) - resume.written)
    progress = None if args.no_progress else Progress(total)
    try:
        source = sys.stdin.buffer if args.input_file == "-" else open(args.input_file, "rb")
    except OSError as exc:
        raise Unrunnable(f"{args.input_file}: cannot read the input: {exc.strerror}") from None
    try:
        totals = asyncio.run(run(args, config, source, resume, progress, runner))
    finally:
        if source is not sys.stdin.buffer:
            source.close()
    s = summary(totals, grouping=not args.no_grouping, earlier=resume)
    print(summary_line(s), file=sys.stderr)
    if args.report:
        try:
            with open(args.report, "wb") as f:
                f.write(orjson.dumps(s, option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as exc:
            raise Unrunnable(f"{args.report}: cannot write the report: {exc.strerror}") from None
    return 0 if totals.failed == 0 and resume.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
