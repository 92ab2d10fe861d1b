"""Settings dataclasses: the one place engine defaults live.

Plain data, no torch import, so the server and the CLI can build and validate settings
without loading the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shoal.tuning import TUNING

WEIGHT_FORMATS = ("bf16", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")


def default_overlap_steps() -> bool:
    """`Tuning.overlap_steps`: the price is that a request submitted while a
    step is launched ahead joins one step later."""
    return TUNING.overlap_steps


def default_overlap_prefill() -> bool:
    return TUNING.overlap_prefill


def default_advance_on_device() -> bool:
    return TUNING.advance_on_device


@dataclass(frozen=True)
class RealtimePolicy:
    """When realtime admission (`engine/admission.py`) stops taking new streams: the generation
    speed per stream (steps per second over the model's frame rate) falls under `min_speed`, or a
    stream playing for `grace_seconds` has under `min_headroom_seconds` of audio buffered.
    Realtime and standard requests then wait at most `max_queue_wait_seconds` before a 503 (batch
    requests wait as long as it takes); batch decodes pause while it is closed. `enabled=False`
    admits by memory alone; None: on a GPU only (a CPU demo is slower than real time with a few
    streams)."""

    enabled: bool | None = None
    # Past the GPU's capacity more streams add no frames per second, only longer steps: the floor
    # sets how slow every admitted stream's steps, and so a newcomer's first audio, may get. Lower
    # lets the steps run too close to real time (streams stutter); higher closes the gate while the
    # GPU could still take more, and the waiting outweighs the shorter steps.
    min_speed: float = 2.0
    min_headroom_seconds: float = 0.1
    grace_seconds: float = 0.5
    max_queue_wait_seconds: float = 2.0
    step_time_smoothing: float = 0.2  # weight of the newest step in the moving average
    # While a listened stream plays, a step's prefill tokens are capped so that the step keeps
    # `min_speed` (from the measured decode time and prefill cost per token), never below this.
    min_prefill_tokens: int = 256
    # Once the oldest waiting request has waited this long, the newest is admitted first: under
    # overload the admitted start fast and the excess expires (503), instead of every admitted
    # request having waited nearly `max_queue_wait_seconds`.
    newest_first_after_seconds: float = 0.25

    def __post_init__(self) -> None:
        if self.min_speed < 0 or self.min_headroom_seconds < 0 or self.grace_seconds < 0:
            raise ValueError("realtime policy thresholds must be >= 0")
        if self.max_queue_wait_seconds <= 0:
            raise ValueError("max_queue_wait_seconds must be > 0")
        if not 0 < self.step_time_smoothing <= 1:
            raise ValueError("step_time_smoothing must be in (0, 1]")
        if self.min_prefill_tokens < 1 or self.newest_first_after_seconds < 0:
            raise ValueError("min_prefill_tokens must be >= 1 and newest_first_after_seconds >= 0")


ROUTING_MODES = ("voice", "capacity", "random")


@dataclass(frozen=True)
class RoutingPolicy:
    """How `shoal serve --gpus` spreads requests over its engines (`engine/router.py`).

    `voice`: a request for a stored or inline voice goes to that voice's home engine (the same in
    every API process, so its cached prefix pages are hit) while the home engine's load is within
    `affinity_slack` requests, or `affinity_fraction` of the least loaded engine's load, of the
    least loaded one; else, and for requests without a voice, to the engine with the most
    capacity. `capacity`: always the engine with the most capacity. `random`: any answering
    engine (the baseline the other two are measured against)."""

    mode: str = "voice"
    affinity_slack: int = 2
    affinity_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"routing mode must be one of {ROUTING_MODES}, not {self.mode!r}")
        if self.affinity_slack < 0 or self.affinity_fraction < 0:
            raise ValueError("affinity slack and fraction must be >= 0")


def _default_queue_limits() -> dict[str, int]:
    # Keyed by Priority name (lower case). Realtime traffic should never queue deeply: if it
    # cannot start soon it is better rejected so the client can retry elsewhere.
    return {"realtime": 64, "standard": 1024, "batch": 16384}


@dataclass
class EngineConfig:
    """How the batching engine uses the GPU. Every field has a serving-ready default."""

    device: str = "cuda"
    dtype: str = "bfloat16"  # model and KV dtype: "bfloat16" | "float16" | "float32" | "float64"
    # Transformer-block projections: "bf16" (the model dtype, as loaded) or "fp8" (block-scaled
    # e4m3 weights, docs/quantization.md; a bf16 model is quantized in place when the engine starts).
    weight_format: str = "bf16"
    # FP8 only: quantize activations per token per 128 columns (W8A8) instead of W8A16.
    fp8_quantize_activations: bool = True
    # FP8 only: the fast transformer's output head rounded to e4m3 with power-of-two block scales
    # (`quant/fp8_head.py`), read as FP8 bytes at batch 1; False keeps the checkpoint's bf16 head.
    fp8_fast_head: bool = True

    # Batching
    max_running_requests: int = 256  # requests in the decode batch at once ("running slots")
    max_prefill_tokens: int = 8192  # prompt tokens per step after its decodes (sglang's H200 value)
    queue_limits: dict[str, int] = field(default_factory=_default_queue_limits)
    # A waiting request is treated as one class more urgent for every `aging_seconds` it waits,
    # so batch work is never starved by a steady stream of live traffic.
    aging_seconds: float = 30.0
    # Admit a stream only while the admitted ones stay ahead of playback (`engine/admission.py`).
    realtime: RealtimePolicy = field(default_factory=RealtimePolicy)

    # Paged KV cache
    page_size: int = 16  # tokens per page
    # "auto": keys and values in the model dtype; "fp8": e4m3 with one fp32 scale per (token, kv
    # head) (`engine.kv_cache.PagedKV`): almost twice the tokens per GiB, but a slower decode step
    # (widening e4m3 tiles costs more than the bytes saved), so a capacity option. Lossy: see
    # docs/quantization.md.
    kv_cache_dtype: str = "auto"
    num_pages: int | None = None  # None: size the pool from free GPU memory
    memory_fraction: float = 0.85  # of the memory free after loading the model (num_pages=None)
    cpu_num_pages: int = 4096  # pool size on a CPU device when num_pages is None
    max_seq_len: int | None = None  # None: the model's max_seq_len

    # CUDA graphs for the decode step
    use_cuda_graphs: bool = True
    graph_max_batch: int | None = None  # None: min(max_running_requests, 256)
    graph_buckets: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, 16, 24, 32, ... up to max
    # A request's first frame (sampled when its prefill completes) from static buffers replayed
    # as one CUDA graph per bucket instead of hundreds of eager launches (time to first frame).
    # None: wherever the decode graphs are captured (the fast step on CUDA); True: also without
    # graphs, eagerly on the same static buffers (the CPU tests); False: eager, fresh buffers.
    first_frame_graphs: bool | None = None
    # A step's prefill chunk (or up to `prefill_graph_segments` chunks) of at most
    # max(prefill_graph_buckets) tokens in all on static buffers, padded to the next bucket and
    # replayed as one CUDA graph (`prefill_batch.py`): the eager prefill is bound by the host's
    # launches. None: wherever the decode graphs are captured; True: also without graphs, eagerly
    # on the static buffers (needs the kernel step, which CPU engines do not build: the CPU tests
    # attach the batch themselves); False: eager.
    prefill_graphs: bool | None = None
    prefill_graph_buckets: tuple[int, ...] = (32, 64, 128, 192, 256, 384, 512, 768, 1024)
    # Chunks of distinct requests packed into one static prefill, so a step that admits a burst
    # of prompts replays too instead of prefilling eagerly (first audio of a burst sooner, the
    # same throughput). 1: a single chunk per replay.
    prefill_graph_segments: int = 8

    # The decode step: "fast" (graph-safe fused step, `engine/decode_step.py`) or "reference"
    # (`models/reference.decode_frame`, the oracle's code); None: fast on CUDA, else reference.
    decode_step: str | None = None
    # The sampling kernels extract this many candidates per row (rows whose top_k is larger run
    # an uncapped eager step); None: always sort the whole row. 32 holds the API's top_k (always
    # 30); the candidate count is most of the sampler's cost.
    sample_max_top_k: int | None = 32

    # Launch decode step n+1 before step n's frames are read back when the batch cannot change
    # between them (pure decode, nothing waiting): the host books step n while the GPU runs
    # n+1. A request that stopped at step n runs one discarded extra row (docs/engine.md).
    overlap_steps: bool = field(default_factory=default_overlap_steps)
    # CUDA: a step's prefill graph runs on a second stream while its decode graph runs, instead
    # of after it; the next step starts when both are done (`ModelRunner.begin_step`): staggered
    # arrivals gain throughput and earlier first frames. Steps without a decode, and prefill
    # outside the graphs (beyond their buckets), stay on the main stream.
    overlap_prefill: bool = field(default_factory=default_overlap_prefill)
    # CUDA kernel step: its last kernel makes the step's metadata (positions, KV lengths, slots,
    # frame indices) the next step's and writes the frames into a pinned host ring, so the host
    # uploads metadata only when the rows or a block table change and copies no frames back.
    advance_on_device: bool = field(default_factory=default_advance_on_device)

    # Benchmarks: keep generating past <|im_end|> until max_new_frames (fixed output length).
    ignore_eos: bool = False

    # Vocoder: a request's first chunk is decoded as soon as it has the frames its `latency`
    # asks for (`vocoder_low_latency_first_chunk_frames`, `vocoder_first_chunk_frames`, or a full
    # `vocoder_chunk_frames`), the next at `vocoder_chunk_frames`, and each later one is twice
    # the one before, up to `vocoder_max_chunk_frames` (None or `chunk_frames`: no growth). See
    # `engine.vocoder.ChunkPolicy`. Growth frees codec GPU time at high concurrency, but capturing
    # the larger codec graphs (each with a cuDNN algorithm search) makes a cold engine load much
    # longer: opt-in.
    vocoder_chunk_frames: int = 8
    vocoder_first_chunk_frames: int = 4  # latency "balanced"; "normal" starts with a full chunk
    vocoder_low_latency_first_chunk_frames: int = 2  # latency "low"
    vocoder_max_chunk_frames: int | None = None
    # A stream whose listener has less audio buffered than this is decoded with what it holds,
    # whatever its chunk schedule says (0: never): see `engine.vocoder.ChunkPolicy`.
    vocoder_refill_seconds: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.realtime, dict):  # from JSON (the engine process's spec)
            self.realtime = RealtimePolicy(**self.realtime)
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError("memory_fraction must be in (0, 1]")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not self.prefill_graph_buckets or min(self.prefill_graph_buckets) < 1:
            raise ValueError("prefill_graph_buckets must be positive token counts")
        if self.prefill_graph_segments < 1:
            raise ValueError("prefill_graph_segments must be at least 1")
        if self.decode_step not in (None, "fast", "reference"):
            raise ValueError("decode_step must be 'fast', 'reference' or None")
        largest_chunk = self.vocoder_max_chunk_frames
        if largest_chunk is not None and largest_chunk < self.vocoder_chunk_frames:
            raise ValueError("vocoder_max_chunk_frames must be at least vocoder_chunk_frames (or None)")

    def resolved_realtime(self) -> RealtimePolicy:
        """The policy with `enabled` decided (None: on a GPU only)."""
        if self.realtime.enabled is not None:
            return self.realtime
        return replace(self.realtime, enabled=self.device.startswith("cuda"))

    def resolved_decode_step(self, device_type: str) -> str:
        if self.decode_step is not None:
            return self.decode_step
        return "fast" if device_type == "cuda" else "reference"

    @property
    def resolved_graph_max_batch(self) -> int:
        if self.graph_max_batch is not None:
            return min(self.graph_max_batch, self.max_running_requests)
        return min(self.max_running_requests, 256)

    def resolved_graph_buckets(self) -> tuple[int, ...]:
        """Batch sizes captured as CUDA graphs; a batch pads up to the next one."""
        top = self.resolved_graph_max_batch
        if self.graph_buckets is not None:
            sizes = sorted({b for b in self.graph_buckets if 1 <= b <= top} | {top})
            return tuple(sizes)
        sizes = {1, 2, 4, 8} | set(range(16, top + 1, 8)) | {top}
        return tuple(sorted(s for s in sizes if s <= top))
