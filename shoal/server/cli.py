"""`shoal serve`: load a checkpoint, start the engine and serve the Fish Audio API on one port
(REST and WebSocket). Every option can also be set by an environment variable (the epilog).

`--api-workers N` (N >= 1) runs the engine in a process of its own and N API processes
(`shoal.server.workers`); 0 runs everything in this one process. By default: the split when the
engine runs on a GPU, with half the cores as API processes (at least min(4, cores), at most 8 per
engine): mp3 and opus encoding is their heaviest work, and a GPU's streams need several cores of
it (docs/deployment.md sizes them with `shoal bench formats`). On the CPU (the demo) one
process, where a second copy of the interpreter and the web stack per core buys nothing: the
engine's torch threads use the same few cores as the encoders."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from shoal.config import (
    KV_CACHE_DTYPES,
    ROUTING_MODES,
    EngineConfig,
    RealtimePolicy,
    RoutingPolicy,
    default_overlap_steps,
)
from shoal.server.keys_cli import add_storage_arguments
from shoal.server.settings import ServerSettings
from shoal.tuning import ENV_PREFIX, environment

DEFAULTS = ServerSettings()  # the options default to the server's own defaults (server/settings.py)
MIB = 1024 * 1024
MAX_DEFAULT_API_WORKERS_PER_ENGINE = 8

log = logging.getLogger("shoal.server")


def env(name: str, default: str | None = None) -> str | None:
    return environment(name, default)


def env_flag(name: str) -> bool:
    return (env(name) or "").strip().lower() in ("1", "true", "yes", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Every option can also be set by the environment variable {ENV_PREFIX}<OPTION>: its name in upper"
        f" case with '-' as '_' (e.g. {ENV_PREFIX}PORT, {ENV_PREFIX}MAX_RUNNING_REQUESTS)."
    )
    parser.add_argument(
        "--checkpoint",
        default=env("CHECKPOINT"),
        required=env("CHECKPOINT") is None,
        help="checkpoint directory or Hugging Face repo id",
    )
    parser.add_argument("--codec", default=env("CODEC"), help="codec weights, if not in the checkpoint")
    parser.add_argument("--host", default=env("HOST", "127.0.0.1"), help="bind address")
    parser.add_argument("--port", type=int, default=int(env("PORT", "8080") or 8080), help="port")
    parser.add_argument(
        "--api-workers",
        type=api_worker_count,
        default=api_worker_count(env("API_WORKERS", "auto") or "auto"),
        metavar="N|auto",
        help="API processes (HTTP, WebSocket, audio encoding) beside one engine process; 0: the engine "
        "and the API in this one process. auto (default): on a GPU half the cores, at least min(4, cores), "
        f"at most {MAX_DEFAULT_API_WORKERS_PER_ENGINE} per engine; 0 on the CPU",
    )
    parser.add_argument(
        "--gpus",
        type=gpu_list,
        default=gpu_list(env("GPUS") or "") or None,
        metavar="0,1,...",
        help="one engine process per listed GPU (CUDA device indices) behind the same API processes; "
        "requests are routed by voice and capacity (--routing). default: one engine",
    )
    parser.add_argument(
        "--data-parallel",
        type=int,
        default=int(env("DATA_PARALLEL") or 0) or None,
        metavar="N",
        help="N engine processes: on GPUs 0..N-1 (or those of --gpus), or N CPU engines without a GPU",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default=env("ROUTING", RoutingPolicy.mode),
        help="with several engines: voice (default: a voice's requests stay on one engine while it has "
        "headroom, else the engine with the most capacity), capacity (always the most capacity), "
        "random (the A/B baseline)",
    )
    add_storage_arguments(parser)
    parser.add_argument(
        "--blob-url",
        type=blob_url,
        default=env("BLOB_URL") or None,
        metavar="URL",
        help="where voice audio and job outputs live: a directory (default: DATA_DIR/blobs), or "
        "s3://bucket[/prefix] for pods that share nothing but the database and the bucket "
        "(credentials, region and endpoint from the standard AWS_* variables; a disk cache in "
        "DATA_DIR/blob-cache, bounded by ?cache_mb=N, default 2048)",
    )
    parser.add_argument(
        "--no-auth", action="store_true", default=env_flag("NO_AUTH"), help="accept requests without a key"
    )
    parser.add_argument("--device", default=env("DEVICE"), help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtype", default=env("DTYPE"), help="model dtype (default: bfloat16 on GPU, float32 on CPU)"
    )
    parser.add_argument(
        "--max-new-frames",
        type=int,
        default=int(env("MAX_NEW_FRAMES") or DEFAULTS.max_new_frames),
        help="cap on frames generated per text chunk",
    )
    parser.add_argument(
        "--max-streams-per-key",
        type=int,
        default=int(env("MAX_STREAMS_PER_KEY") or DEFAULTS.max_streams_per_key),
        help="concurrent streams per API key before 429",
    )
    parser.add_argument(
        "--max-text-length",
        type=int,
        default=int(env("MAX_TEXT_LENGTH") or DEFAULTS.max_text_length),
        help="characters per request",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=float(env("MAX_BODY_MB") or DEFAULTS.max_body_bytes / MIB),
        help="largest request body or WebSocket message, MiB",
    )
    parser.add_argument(
        "--max-upload-mb",
        type=float,
        default=float(env("MAX_UPLOAD_MB") or DEFAULTS.max_upload_bytes / MIB),
        help="largest audio upload (voice sample or inline reference), MiB",
    )
    parser.add_argument(
        "--max-upload-seconds",
        type=float,
        default=float(env("MAX_UPLOAD_SECONDS") or DEFAULTS.max_upload_seconds),
        help="longest audio upload, seconds",
    )
    parser.add_argument(
        "--live-start-timeout",
        type=float,
        default=float(env("LIVE_START_TIMEOUT") or DEFAULTS.live_start_timeout),
        help="seconds a /v1/tts/live connection may wait before its 'start' event",
    )
    parser.add_argument(
        "--live-idle-timeout",
        type=float,
        default=float(env("LIVE_IDLE_TIMEOUT") or DEFAULTS.live_idle_timeout),
        help="seconds of client silence, with nothing left to synthesize, before a live session ends",
    )
    parser.add_argument(
        "--job-lease-seconds",
        type=float,
        default=float(env("JOB_LEASE_SECONDS") or DEFAULTS.job_lease_seconds),
        help="servers sharing a database (--database-url) each run the bulk jobs they hold a lease on; "
        "a dead server's jobs resume on another after this long",
    )
    parser.add_argument(
        "--queue-limit",
        action="append",
        type=queue_limit,
        default=[queue_limit(item) for item in (env("QUEUE_LIMITS") or "").split(",") if item.strip()],
        metavar="PRIORITY=N",
        help="most requests waiting per priority (realtime, standard, batch) before 503; repeatable "
        "; defaults in shoal.config.EngineConfig",
    )
    parser.add_argument(
        "--weight-format",
        choices=("auto", "bf16", "fp8"),
        default=env("WEIGHT_FORMAT", "auto"),
        help="transformer weights: bf16, or fp8 (block-scaled; a bf16 checkpoint is quantized at load). "
        "auto (default): fp8 for a `shoal quantize` checkpoint; on a Hopper GPU a bf16 checkpoint is "
        "quantized at load and served FP8 if its greedy frames equal bf16's on a fixed input, else bf16 "
        "(the reason is logged); bf16 elsewhere",
    )
    parser.add_argument(
        "--realtime-admission",
        choices=("auto", "on", "off"),
        default=env("REALTIME_ADMISSION", "auto"),
        help="admit a new stream only while the admitted ones stay ahead of playback (measured "
        "generation speed and listeners' buffered audio), else queue it, then 503; auto: on a GPU. "
        "off: admit by memory alone",
    )
    parser.add_argument(
        "--max-queue-wait",
        type=float,
        default=float(env("MAX_QUEUE_WAIT", str(RealtimePolicy.max_queue_wait_seconds))),
        metavar="SECONDS",
        help="with realtime admission: how long a realtime or standard request waits for capacity "
        "before a 503 with Retry-After (batch jobs wait as long as it takes)",
    )
    parser.add_argument(
        "--realtime-min-speed",
        type=float,
        default=float(env("REALTIME_MIN_SPEED", str(RealtimePolicy.min_speed))),
        metavar="X",
        help="with realtime admission: stop admitting below this generation speed per stream "
        "(times real time)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=env("KV_CACHE_DTYPE") or "auto",
        help="KV cache storage: auto (the model dtype) or fp8 (e4m3, one scale per token and kv head: "
        "about twice the tokens per GiB, lossy; docs/quantization.md)",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=int(env("MAX_RUNNING_REQUESTS", "256") or 256),
        help="requests decoded together at most; CUDA graphs are captured up to min(this, 256) ",
    )
    parser.add_argument(
        "--overlap-steps",
        action=argparse.BooleanOptionalAction,
        default=default_overlap_steps(),  # read as EngineConfig reads it
        help="launch decode step n+1 before reading step n (5-11%% more frames/s; a request arriving "
        "meanwhile joins one step later; on by default)",
    )
    parser.add_argument(
        "--prefill-graph-segments",
        type=int,
        default=int(env("PREFILL_GRAPH_SEGMENTS") or EngineConfig.prefill_graph_segments),
        help="prompts admitted in one step whose prefill replays as one CUDA graph (default 8: "
        "bursts of arrivals replay too; 1: a single prompt)",
    )
    parser.add_argument(
        "--vocoder-max-chunk-frames",
        type=int,
        default=int(env("VOCODER_MAX_CHUNK_FRAMES") or 0) or None,
        help="let each stream's codec chunks grow 4, 8, 16, .. up to this many frames (default: "
        "no growth, 8). 32: 7%% more frames/s at concurrency 64 and half the codec's GPU time, "
        "same first audio, but the extra codec graphs make startup minutes longer (see "
        "docs/deployment.md)",
    )
    parser.add_argument(
        "--aligner",
        type=aligner_directory,
        default=env("ALIGNER"),
        metavar="DIR",
        help="a local wav2vec2-style CTC model directory (config.json, vocab.json, weights; e.g. "
        "facebook/wav2vec2-base-960h's files; needs `transformers`) for word timings on "
        "/v1/tts/stream/with-timestamp; without it the stream times text chunks only",
    )
    parser.add_argument("--log-level", default=env("LOG_LEVEL", "info"), help="debug, info, warning")


PRIORITY_NAMES = ("realtime", "standard", "batch")


def gpu_list(text: str) -> list[str]:
    """`--gpus 0,1` -> ["0", "1"]: distinct CUDA device indices."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not all(item.isdigit() for item in items) or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"expected distinct GPU indices like 0,1: {text!r}")
    return items


def engine_gpus(args: argparse.Namespace) -> list[str | None]:
    """One entry per engine process: the GPU it sees alone, or None (one engine as this process
    sees the devices, or a CPU engine)."""
    count = args.data_parallel
    if count is not None and count < 1:
        raise SystemExit("--data-parallel must be at least 1")
    if args.gpus:
        if count is not None and count != len(args.gpus):
            raise SystemExit(f"--data-parallel {count} does not match --gpus {','.join(args.gpus)}")
        if args.device is not None and not args.device.startswith("cuda"):
            raise SystemExit(f"--gpus needs a GPU engine, not --device {args.device}")
        return list(args.gpus)
    if count is None or count == 1:
        return [None]
    if engine_on_gpu(args.device):
        return [str(index) for index in range(count)]
    return [None] * count


def api_worker_count(text: str) -> int | None:
    """`--api-workers`: a count >= 0, or None for "auto"."""
    if text.strip().lower() == "auto":
        return None
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of processes or 'auto': {text!r}")
    return int(text)


def blob_url(text: str) -> str:
    """`--blob-url`: its form is checked here, before anything starts (the bucket itself by
    `blob_storage_usable`)."""
    from shoal.server.blobs import BlobStoreError, parse_blob_url

    try:
        parse_blob_url(text)
    except BlobStoreError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text.strip()


def blob_storage_usable(args: argparse.Namespace) -> bool:
    """Open the blob storage once before the engine loads: a bucket that is missing or refused
    stops `shoal serve` at once, with the reason, instead of after the warm-up."""
    from shoal.server.blobs import BlobStoreError, blob_store_for

    try:
        blob_store_for(args.blob_url, args.data_dir).close()
    except BlobStoreError as error:
        log.error("blob storage: %s", error)
        return False
    return True


def aligner_directory(text: str) -> str:
    """`--aligner`: a directory that looks like a local CTC model (checked before anything starts)."""
    from shoal.server.alignment import AlignerError, check_aligner_directory

    try:
        check_aligner_directory(text)
    except AlignerError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def queue_limit(text: str) -> tuple[str, int]:
    """`standard=256` -> ("standard", 256), for --queue-limit."""
    name, _, count = text.strip().partition("=")
    name = name.strip().lower()
    if name not in PRIORITY_NAMES or not count.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected PRIORITY=N with PRIORITY in {PRIORITY_NAMES}: {text!r}")
    return name, int(count)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from the serve options."""
    config = EngineConfig(
        max_running_requests=args.max_running_requests,
        overlap_steps=args.overlap_steps,
        prefill_graph_segments=args.prefill_graph_segments,
        vocoder_max_chunk_frames=args.vocoder_max_chunk_frames,
        kv_cache_dtype=args.kv_cache_dtype,
        realtime=RealtimePolicy(
            enabled={"auto": None, "on": True, "off": False}[args.realtime_admission],
            min_speed=args.realtime_min_speed,
            max_queue_wait_seconds=args.max_queue_wait,
        ),
    )
    config.queue_limits = {**config.queue_limits, **dict(args.queue_limit)}
    return config


def build_engine(args: argparse.Namespace):
    """The real engine for the checkpoint, in this process (imported here so `--help` stays
    fast): `shoal.engine.load_engine(checkpoint, *, codec, device, dtype, config, weight_format)`."""
    from shoal.engine import load_engine

    return load_engine(
        args.checkpoint,
        codec=args.codec,
        device=args.device,
        dtype=args.dtype,
        config=engine_config(args),
        weight_format=args.weight_format,
    )


# The serve options that reach the engine process through EngineSpec.config.
SPEC_CONFIG_FIELDS = (
    "max_running_requests",
    "overlap_steps",
    "prefill_graph_segments",
    "vocoder_max_chunk_frames",
    "kv_cache_dtype",
    "queue_limits",
    "realtime",
)


def engine_spec(args: argparse.Namespace):
    """The engine process's spec: the same engine `build_engine` loads, in another process."""
    from shoal.engine.process import EngineSpec

    config = engine_config(args)
    return EngineSpec(
        checkpoint=str(args.checkpoint),
        codec=args.codec,
        device=args.device,
        dtype=args.dtype,
        weight_format=args.weight_format,
        config={name: getattr(config, name) for name in SPEC_CONFIG_FIELDS},
        log_level=args.log_level,
    )


def engine_on_gpu(device: str | None) -> bool:
    """Whether the engine will run on a GPU: `--device`, else where load_engine puts it."""
    if device is not None:
        return device.startswith("cuda")
    import torch  # only to decide the default; the engine process imports it anyway

    return torch.cuda.is_available()


def api_workers(args: argparse.Namespace, engines: int = 1) -> int:
    """`--api-workers`, or its default (see the module's docstring); at least one beside
    several engines (they live in processes of their own)."""
    if args.api_workers is not None:
        workers = args.api_workers
    elif engine_on_gpu(args.device):
        workers = default_api_workers(usable_cores(), engines)
    else:
        workers = 0
    if engines > 1 and workers == 0:
        if args.api_workers == 0:
            log.warning("--api-workers 0 cannot hold %d engines: running one API process", engines)
        return 1
    return workers


def usable_cores() -> int:
    """The cores this process may run on (a container's cpuset, not the whole host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_api_workers(cores: int, engines: int = 1) -> int:
    """Half the cores (the other half for the engine processes and the encoders' threads), at
    least min(4, cores), at most `MAX_DEFAULT_API_WORKERS_PER_ENGINE` per engine."""
    return max(min(4, cores), min(cores // 2, MAX_DEFAULT_API_WORKERS_PER_ENGINE * engines))


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        auth=not args.no_auth,
        max_text_length=args.max_text_length,
        max_body_bytes=int(args.max_body_mb * MIB),
        max_upload_bytes=int(args.max_upload_mb * MIB),
        max_upload_seconds=args.max_upload_seconds,
        max_streams_per_key=args.max_streams_per_key,
        max_new_frames=args.max_new_frames,
        live_start_timeout=args.live_start_timeout,
        live_idle_timeout=args.live_idle_timeout,
        job_lease_seconds=args.job_lease_seconds,
        aligner=args.aligner,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
    )
    settings = server_settings(args)
    log.info("data directory: %s", args.data_dir)
    if not blob_storage_usable(args):
        return 1
    gpus = engine_gpus(args)
    workers = api_workers(args, len(gpus))
    if workers > 0:
        from shoal.server.workers import serve_split

        spec = engine_spec(args)
        if gpus[0] is not None:
            spec = dataclasses.replace(spec, device="cuda")
        elif len(gpus) > 1:  # CPU engines share the cores
            spec = dataclasses.replace(spec, torch_threads=max(1, (os.cpu_count() or 1) // len(gpus)))
        return serve_split(
            spec,
            engine_gpus=gpus,
            routing={"mode": args.routing},
            api_workers=workers,
            data_dir=args.data_dir,
            database_url=args.database_url,
            blob_url=args.blob_url,
            settings=dataclasses.asdict(settings),
            host=args.host,
            port=args.port,
            ws_max_size=settings.websocket_transport_max_bytes,
            log_level=args.log_level,
        )
    return serve_in_process(args, settings)


def serve_in_process(args: argparse.Namespace, settings: ServerSettings) -> int:
    """`--api-workers 0`: the engine, the routes and the jobs in this one process."""
    import uvicorn

    from shoal.engine.compile_cache import compile_cache_environment
    from shoal.engine.gc_pauses import freeze_startup_heap
    from shoal.server.app import create_app
    from shoal.server.store import Store
    from shoal.server.workers import jobs_lock_path

    store = Store.in_directory(args.data_dir, args.database_url, args.blob_url)
    os.environ.update(compile_cache_environment(args.data_dir))  # before torch loads
    engine = build_engine(args)
    app = create_app(engine, store, settings, jobs_lock=jobs_lock_path(args.data_dir))
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        ws_max_size=settings.websocket_transport_max_bytes,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    return 0
