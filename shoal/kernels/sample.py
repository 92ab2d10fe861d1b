"""Fused sampling: top-p / top-k / temperature / exponential race (+ S2's RAS) in one launch.

Rules (`models/sampling.py` is the definition): sort descending; drop ranks whose cumulative
*untempered* probability exceeds top_p or whose rank is >= top_k, always keeping rank 0; divide by
max(temperature, 1e-5); softmax; draw `argmax(probs / -log U)` with U from
`models.sampling.counter_uniform` (reproduced here bit for bit: `counter_uniform`). Parameters
arrive already rounded as the family rounds them (`SamplingBatch`); the RAS parameters (T=1.0,
top_p=0.9) are rounded to bf16 here as the reference does.

One program per row holds the whole row (V <= `MAX_COLUMNS`): S2's restricted logits (the
semantic slice + `<|im_end|>`, with `token_ids` giving each column's vocabulary id so the draw
equals the full constrained row's), or a codebook row (1024 / 4096). Sorting packs (value, id)
into one 64-bit key, so ties break toward the lower vocabulary id as a stable sort does; with
`max_top_k` only the top-k keys are extracted, otherwise the whole row is sorted.

The top k keys of a row wider than k come from `_select_top_keys`, a radix select that finds
where the k-th largest key lies with a few 32-bin histograms instead of sorting the row,
compacts the fewer than 2k keys above that through a [rows, 2k] global scratch buffer and
extracts the top k of those 2k; its cost hardly depends on the tile width, where `tl.topk`'s
bitonic networks pay per stage over the whole power-of-two tile. A row of 2^n + 1 columns (S2's
main row: 4,096 semantic ids + `<|im_end|>`) extracts the top k of its first 2^n and inserts the
last column's key into that sorted list (`_insert_key`, `split_last_column`) instead of taking a
tile twice as wide.

Chunked rows (`chunks`, `_sample_chunked_kernel`): one program per row is one SM issuing a long
chain of block-wide steps, mostly the top-k extraction, while at small batches the other SMs
idle. With chunks, P programs per row each take the top k of their BLOCK_V / P columns
(`tl.topk`: over a few hundred keys cheaper than the radix select) and the last to arrive (a
per-row counter) merges the P sorted runs (`_merge_sorted_runs`), re-reads the row for its max
and normalizer (the one-program kernel's tile and reductions: the same bits) and draws: the same
draws. `DEFAULT_CHUNKS` at batch <= 64 on a GPU for rows wider than k (the one-program kernel
otherwise); `Tuning.sample_chunks` overrides. The candidate count (`max_top_k`) is most of the
chunked kernel's cost.

RAS (S2 main token): both draws come from the same sorted row; if the normal draw is semantic,
the row's frame index is >= 1 and it occurs among the window's main tokens `window[b, :, 0]`,
the high-temperature draw (slot `RAS_SLOT`) is taken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.pdl import pdl_launch, wait_for_inputs

MAX_COLUMNS = 16384
RAS_TEMPERATURE = 1.0  # exactly representable in bf16
RAS_TOP_P = float(torch.tensor(0.9).to(torch.bfloat16).float())  # 0.8984375, the reference's bf16
# The radix select's digit: 5 bits, 32 bins: a 32-bin histogram costs less than a 256-bin one by
# more than the extra passes cost.
RADIX_BITS = tl.constexpr(5)
RADIX_BINS = tl.constexpr(32)  # 2 ** RADIX_BITS
# Chunked rows (`chunks`): the default for the radix path with `max_top_k` at small batches, and
# the rows the per-device counters serve (a fixed buffer, never reallocated: graphs point at it).
DEFAULT_CHUNKS = 8
# Warps per program when the caller does not say (read at each call: `shoal bench ab`'s
# `kernel:sample_warps`).
NUM_WARPS = 8
DEFAULT_CHUNKS_MAX_ROWS = 64
CHUNKED_MAX_ROWS = 1024
_CHUNK_COUNTERS: dict[torch.device, Tensor] = {}


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _row_hash(seed, frame, slot):
    """The per-(seed, frame, slot) state of `models.sampling.counter_uniform_columns`."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _fmix32(seed_lo ^ 0x243F6A88)
    h = _fmix32(h ^ seed_hi)
    h = _fmix32(h ^ (frame & 0xFFFFFFFF).to(tl.uint32))
    return _fmix32(h ^ tl.cast(slot, tl.uint32))  # tl.cast: `slot` may be specialized to constexpr 1


@triton.jit
def _uniform(h, column_ids):
    """float32 U in (0, 1] for uint32 column ids."""
    bits = _fmix32(h ^ (column_ids * 0x9E3779B9))
    return ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08


@triton.jit
def _race(values, ids, ranks, top, total, temperature, top_p, top_k, h):
    """The reference draw over a descending-sorted row prefix; returns the winner's id."""
    cumulative = tl.cumsum(tl.exp(values - top) / total, 0)
    keep = ((cumulative <= top_p) & (ranks < top_k)) | (ranks == 0)
    scaled = values / tl.maximum(temperature, 1e-5)
    weights = tl.where(keep, tl.exp(scaled - top / tl.maximum(temperature, 1e-5)), 0.0)
    probs = weights / tl.sum(weights, 0)
    u = _uniform(h, ids.to(tl.uint32))
    score = tl.where((probs > 0) & (u < 1.0), probs / -tl.log(u), -1.0)
    best = tl.max(score, 0)
    return tl.min(tl.where(score == best, ids, 0x7FFFFFFF), 0)


@triton.jit
def _sort_keys(x, ids):
    """Order-preserving unsigned image of the float, then the id's complement: descending keys
    give descending values, ties by ascending id."""
    bits = x.to(tl.uint32, bitcast=True)
    ordered = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return (ordered.to(tl.uint64) << 32) | (0xFFFFFFFF - ids.to(tl.uint32)).to(tl.uint64)


@triton.jit
def _insert_key(keys, key, K: tl.constexpr):
    """The K largest of descending `keys` [K] and one more `key`, descending (keys are unique)."""
    above = tl.sum((keys > key).to(tl.int32), 0)  # the new key's rank
    i = tl.arange(0, K)
    # keys[i - 1] for every i, as a [K, K] select (a register shift by one)
    previous = tl.sum(tl.where(tl.arange(0, K)[None, :] == (i - 1)[:, None], keys[None, :], 0), 1)
    return tl.where(i < above, keys, tl.where(i == above, key, previous))


@triton.jit
def _minmax(lo_a, hi_a, lo_b, hi_b):
    return tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)


@triton.jit
def _crossing(digit_a, above_a, within_a, digit_b, above_b, within_b):
    return tl.maximum(digit_a, digit_b), tl.maximum(above_a, above_b), tl.minimum(within_a, within_b)


@triton.jit
def _select_top_keys(keys, scratch_ptr, BLOCK_V: tl.constexpr, K: tl.constexpr, W: tl.constexpr):
    """The K largest of `keys` uint64 [BLOCK_V], descending: what `tl.topk(keys, K)` returns,
    without a sort network over the tile (whose stages each cost over all BLOCK_V keys).

    Radix select: `member` holds the keys that can still be the K-th largest (their bits above
    the current digit equal its bits), `need` how many of the K still lie among them, all keys
    above the members being taken. Each pass takes the RADIX_BITS bits just below the highest bit
    in which the members' min and max differ (so no pass is spent on bits they share, e.g. the
    zero low half of a bf16 logit or the common high bits of the ids), histograms that digit over
    the members and keeps the digit where the count of members at or above it crosses `need`.
    Per pass: a histogram, a scan over its bins and two reductions, all block-wide. It stops once
    at most W - K members are left (random rows: after 2 to 4 passes; no row needs more than 14),
    every member is needed, or all members are equal.
    The keys above the members' minimum (fewer than W) go to this row's `scratch_ptr` [W] at their
    exclusive-cumsum positions (Triton cannot scatter in registers), are read back, the rest
    filled with copies of that minimum, and `tl.topk` extracts the K largest of these W."""
    lo, hi = tl.reduce((keys, keys), 0, _minmax)
    member = keys == keys
    need = tl.full([], K, tl.int32)
    count = tl.full([], BLOCK_V, tl.int32)  # members
    bins = tl.arange(0, RADIX_BINS)
    passes = tl.full([], 0, tl.int32)  # at most 14 (see above); the bound only rules out a hang
    while (need < count) & (count > W - K) & (lo != hi) & (passes < 64):
        passes += 1
        # highest differing bit, from the float64 exponent (rounding up by one bit is harmless)
        high = ((lo ^ hi).to(tl.float64).to(tl.uint64, bitcast=True) >> 52).to(tl.int32) - 1023
        shift = tl.maximum(high - (RADIX_BITS - 1), 0).to(tl.uint64)
        digit = ((keys >> shift) & (RADIX_BINS - 1)).to(tl.int32)
        at_or_above = tl.cumsum(tl.histogram(digit, RADIX_BINS, mask=member), 0, reverse=True)
        crossing = at_or_above >= need  # the bins up to the K-th largest member's
        chosen, above, within = tl.reduce(
            (tl.where(crossing, bins, -1), tl.where(crossing, 0, at_or_above),
             tl.where(crossing, at_or_above, 0x7FFFFFFF)),
            0, _crossing,
        )  # fmt: skip
        need -= above
        count = within - above
        member = member & (digit == chosen)
        lo, hi = tl.reduce(
            (tl.where(member, keys, 0xFFFFFFFFFFFFFFFF), tl.where(member, keys, 0)), 0, _minmax
        )
    # lo <= the K-th largest key, and fewer than W keys exceed lo (K - need + count - 1 when the
    # loop ends on the count, K - 1 when every member is needed, K - need when all are equal):
    # the K largest of those keys and copies of lo are the K largest keys.
    above = keys > lo
    taken = above.to(tl.int32)
    slot = tl.cumsum(taken, 0) - taken
    # slot < W always holds; the mask keeps any bug inside this row's scratch
    tl.store(scratch_ptr + slot, keys.to(tl.int64, bitcast=True), mask=above & (slot < W))
    tl.debug_barrier()
    i = tl.arange(0, W)
    filled = i < tl.sum(taken, 0)
    top = tl.where(filled, tl.load(scratch_ptr + i, mask=filled, other=0).to(tl.uint64, bitcast=True), lo)
    return tl.topk(top, K)


@triton.jit
def _top_keys(keys, scratch_ptr, WIDTH: tl.constexpr, K: tl.constexpr, RADIX: tl.constexpr):
    """The K largest of `keys` [WIDTH], descending: the whole tile sorted when K == WIDTH, else
    the radix select (through `scratch_ptr` [2K]) or `tl.topk`."""
    if K == WIDTH:
        keys = tl.sort(keys, descending=True)
    elif RADIX:
        keys = _select_top_keys(keys, scratch_ptr, WIDTH, K, 2 * K)
    else:
        keys = tl.topk(keys, K)
    return keys


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def _exchange(keys, flip, BIT: tl.constexpr, DIMS: tl.constexpr):
    """One compare-and-swap stage of a bitonic network over `keys` [2] * DIMS (index bit BIT is
    axis DIMS - 1 - BIT): the two keys whose indices differ in bit BIT end ascending where `flip` is
    0, descending where 1 (`tl.topk`'s stage, on uint64 keys)."""
    bits = keys.to(tl.int64, bitcast=True)
    other = (bits ^ tl.xor_sum(bits, DIMS - 1 - BIT, keep_dims=True)).to(tl.uint64, bitcast=True)
    right = tl.reshape(tl.arange(0, 2), [1] * (DIMS - 1 - BIT) + [2] + [1] * BIT)
    return tl.where((keys > other) != (flip ^ right), other, keys)


@triton.jit
def _merge_sorted_runs(keys, RUNS: tl.constexpr, K: tl.constexpr):
    """The K largest of RUNS sorted runs of K keys (`keys` [RUNS * K]: even runs ascending, odd
    descending), descending. `tl.topk` after its runs are sorted: per round, the elementwise max of
    two neighbouring runs is a bitonic run of the K largest of both, which log2(K) stages sort
    (alternately, the last round descending); the runs arrive sorted, so its first log2(K) *
    (log2(K) + 1) / 2 stages over all RUNS * K keys are skipped."""
    LOG_K: tl.constexpr = _log2(K)
    LOG_RUNS: tl.constexpr = _log2(RUNS)
    h = tl.reshape(keys, [2] * (LOG_RUNS + LOG_K))
    for r in tl.static_range(LOG_RUNS):
        h = tl.max(h, LOG_RUNS - 1 - r)  # the bit above a run's index bits: pairs of runs
        if r < LOG_RUNS - 1:
            flip = tl.reshape(tl.arange(0, 2), [1] * (LOG_RUNS - 2 - r) + [2] + [1] * LOG_K)
        else:
            flip = 1
        for i in tl.static_range(LOG_K):
            h = _exchange(h, flip, LOG_K - 1 - i, LOG_RUNS - 1 - r + LOG_K)
    return tl.reshape(h, [K])


@triton.jit
def _column_ids(token_ids_ptr, cols, ok, HAS_TOKEN_IDS: tl.constexpr):
    """The vocabulary ids of columns `cols` (padding: 0x7FFFFFFF with `token_ids`)."""
    ids = cols
    if HAS_TOKEN_IDS:
        ids = tl.load(token_ids_ptr + cols, mask=ok, other=0x7FFFFFFF)
    return ids


@triton.jit
def _row_inputs(
    token_ids_ptr, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr, frame_ptr, window_ptr, row,
    stride_wb, stride_ww, window_width,
    BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr, EXTRA_LAST: tl.constexpr, HAS_TOKEN_IDS: tl.constexpr,
    RAS: tl.constexpr,
):  # fmt: skip
    """What a row reads before the PDL wait besides its column ids: the last column's id (with
    `EXTRA_LAST`), the parameters and the RAS window (-1s without RAS)."""
    id_last = tl.full([], BLOCK_V, tl.int32)
    if HAS_TOKEN_IDS and EXTRA_LAST:
        id_last = tl.load(token_ids_ptr + BLOCK_V)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    frame = tl.load(frame_ptr + row).to(tl.int64)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    previous = tl.full([BLOCK_W], -1, tl.int32)
    if RAS:
        previous = tl.load(window_ptr + row * stride_wb + w * stride_ww, mask=w < window_width, other=-1)
    return id_last, seed, frame, temperature, top_p, top_k, previous


@triton.jit
def _row_logits(row_ptr, cols, ok, BLOCK_V: tl.constexpr, EXTRA_LAST: tl.constexpr):
    """The row's tile, `cols` = arange(BLOCK_V) (-inf where not `ok`, past the row's columns), and
    with `EXTRA_LAST` its last column, outside the BLOCK_V = columns - 1 tile (else -inf, unused)."""
    x = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
    x_last = tl.full([], float("-inf"), tl.float32)
    if EXTRA_LAST:
        x_last = tl.load(row_ptr + BLOCK_V).to(tl.float32)
    return x, x_last


@triton.jit
def _max_and_total(x, x_last, EXTRA_LAST: tl.constexpr):
    """The row's max and sum of exp(x - max): the softmax's normalizer, over the whole tile."""
    top = tl.max(x, 0)
    if EXTRA_LAST:
        top = tl.maximum(top, x_last)
        total = tl.sum(tl.exp(x - top), 0) + tl.exp(x_last - top)
    else:
        total = tl.sum(tl.exp(x - top), 0)
    return top, total


@triton.jit
def _draw(
    keys, x_last, id_last, top, total, temperature, top_p, top_k, seed, frame, previous, slot,
    semantic_begin, semantic_end, ras_temperature, ras_top_p,
    K: tl.constexpr, EXTRA_LAST: tl.constexpr, RAS: tl.constexpr,
):  # fmt: skip
    """The token drawn from the row's K largest keys (descending; the last column's key inserted
    first with `EXTRA_LAST`): the race, and with RAS the high-temperature race's token instead
    when the normal one repeats a semantic token of the window."""
    if EXTRA_LAST:
        keys = _insert_key(keys, _sort_keys(x_last, id_last), K)
    ordered = (keys >> 32).to(tl.uint32)
    sorted_bits = tl.where((ordered >> 31) != 0, ordered ^ 0x80000000, ordered ^ 0xFFFFFFFF)
    values = sorted_bits.to(tl.float32, bitcast=True)
    sorted_ids = (0xFFFFFFFF - (keys & 0xFFFFFFFF).to(tl.uint32)).to(tl.int32)
    ranks = tl.arange(0, K)

    token = _race(
        values, sorted_ids, ranks, top, total, temperature, top_p, top_k, _row_hash(seed, frame, slot)
    )
    if RAS:
        high = _race(
            values, sorted_ids, ranks, top, total, ras_temperature, ras_top_p, top_k,
            _row_hash(seed, frame, slot + 1),
        )  # fmt: skip
        repeated = tl.sum((previous == token).to(tl.int32), 0) > 0
        semantic = (token >= semantic_begin) & (token <= semantic_end)
        token = tl.where(repeated & semantic & (frame >= 1), high, token)
    return token


@triton.jit
def _sample_kernel(
    logits_ptr, token_ids_ptr, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr, frame_ptr,
    window_ptr, scratch_ptr, out_ptr, slot, columns, semantic_begin, semantic_end, ras_temperature, ras_top_p,
    stride_logits, stride_wb, stride_ww, stride_out, window_width,
    BLOCK_V: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, EXTRA_LAST: tl.constexpr,
    RADIX: tl.constexpr, HAS_TOKEN_IDS: tl.constexpr, RAS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program per row. Every load is issued before the first reduction: before the PDL wait
    the column ids, the row's parameters and its RAS window (`sample_tokens`' contract), after it
    the logits; nothing is left for a round trip to memory at the end of the kernel."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    ok = cols < columns
    ids = _column_ids(token_ids_ptr, cols, ok, HAS_TOKEN_IDS)
    id_last, seed, frame, temperature, top_p, top_k, previous = _row_inputs(
        token_ids_ptr, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr, frame_ptr, window_ptr, row,
        stride_wb, stride_ww, window_width, BLOCK_V, BLOCK_W, EXTRA_LAST, HAS_TOKEN_IDS, RAS,
    )  # fmt: skip
    wait_for_inputs(USE_PDL)
    x, x_last = _row_logits(logits_ptr + row * stride_logits, cols, ok, BLOCK_V, EXTRA_LAST)
    top, total = _max_and_total(x, x_last, EXTRA_LAST)
    keys = _top_keys(_sort_keys(x, ids), scratch_ptr + row * (2 * K), BLOCK_V, K, RADIX)
    token = _draw(
        keys, x_last, id_last, top, total, temperature, top_p, top_k, seed, frame, previous, slot,
        semantic_begin, semantic_end, ras_temperature, ras_top_p, K, EXTRA_LAST, RAS,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_out, token.to(out_ptr.dtype.element_ty))


@triton.jit
def _sample_chunked_kernel(
    logits_ptr, token_ids_ptr, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr, frame_ptr,
    window_ptr, candidates_ptr, counter_ptr, out_ptr, slot, columns, semantic_begin, semantic_end,
    ras_temperature, ras_top_p, stride_logits, stride_wb, stride_ww, stride_out, window_width,
    BLOCK_V: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, EXTRA_LAST: tl.constexpr,
    HAS_TOKEN_IDS: tl.constexpr, RAS: tl.constexpr, USE_PDL: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """Program per (row, chunk of BLOCK_V // CHUNKS columns), drawing what `_sample_kernel`
    draws. Each extracts its chunk's K largest keys (`tl.topk`: over at most a few hundred keys
    cheaper than the radix select's barriers and scratch round trip) into its run of the row's
    candidates [CHUNKS, K], then counts itself in at `counter_ptr[row]` (acq_rel, after a barrier:
    every thread's stores precede the one thread's release). The last to arrive merges: the K
    largest of the runs (`_merge_sorted_runs`) are the row's K largest, each being among its
    chunk's; the row's max and normalizer come from the whole tile re-read and reduced exactly as
    `_sample_kernel` does (the same bits); then the draw, and the counter back to 0 for the next
    launch. Its loads (the candidates, written by other SMs, at L2; the row) go out together."""
    CHUNK: tl.constexpr = BLOCK_V // CHUNKS
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < columns
    ids = _column_ids(token_ids_ptr, cols, ok, HAS_TOKEN_IDS)
    id_last, seed, frame, temperature, top_p, top_k, previous = _row_inputs(
        token_ids_ptr, temperature_ptr, top_p_ptr, top_k_ptr, seed_ptr, frame_ptr, window_ptr, row,
        stride_wb, stride_ww, window_width, BLOCK_V, BLOCK_W, EXTRA_LAST, HAS_TOKEN_IDS, RAS,
    )  # fmt: skip
    wait_for_inputs(USE_PDL)
    row_logits = logits_ptr + row * stride_logits
    candidates = candidates_ptr + row * (CHUNKS * K)
    x = tl.load(row_logits + cols, mask=ok, other=float("-inf")).to(tl.float32)
    keys = _top_keys(_sort_keys(x, ids), candidates, CHUNK, K, False)
    i = tl.arange(0, K)
    # even chunks' keys ascending, odd ones' descending: the runs `_merge_sorted_runs` takes
    tl.store(candidates + chunk * K + tl.where(chunk % 2 == 0, K - 1 - i, i), keys.to(tl.int64, bitcast=True))
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
        merged = tl.load(candidates + tl.arange(0, CHUNKS * K), cache_modifier=".cg")
        row_cols = tl.arange(0, BLOCK_V)
        row_ok = row_cols < columns
        row_x, x_last = _row_logits(row_logits, row_cols, row_ok, BLOCK_V, EXTRA_LAST)
        if HAS_TOKEN_IDS:
            # `_sample_kernel` loads the row's ids beside its logits and the coalescing pass gives
            # both loads the wider one's elements per thread, which sets the order of the sums
            # below: the row's largest key (which the merge finds too) makes this load the same.
            first = tl.max(_sort_keys(row_x, _column_ids(token_ids_ptr, row_cols, row_ok, HAS_TOKEN_IDS)), 0)
        top, total = _max_and_total(row_x, x_last, EXTRA_LAST)
        merged = _merge_sorted_runs(merged.to(tl.uint64, bitcast=True), CHUNKS, K)
        if HAS_TOKEN_IDS:
            merged = tl.where(i == 0, first, merged)
        token = _draw(
            merged, x_last, id_last, top, total, temperature, top_p, top_k, seed, frame, previous, slot,
            semantic_begin, semantic_end, ras_temperature, ras_top_p, K, EXTRA_LAST, RAS,
        )  # fmt: skip
        tl.store(out_ptr + row * stride_out, token.to(out_ptr.dtype.element_ty))
        tl.store(counter_ptr + row, 0)


def sample_tokens(
    logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor, frame: Tensor, slot: int,
    token_ids: Tensor | None = None, window: Tensor | None = None,
    semantic_range: tuple[int, int] | None = None, max_top_k: int | None = None, out: Tensor | None = None,
    num_warps: int | None = None, split_last_column: bool = True, chunks: int | None = None,
    preferred_chunks: int | None = None,
) -> Tensor:  # fmt: skip
    """Draw one id per row of logits [B, V] (rows contiguous): int `out` [B] (any int dtype
    and stride, e.g. `frames[:, 0]`), default int64. `token_ids` int32 [V] maps columns to ids.
    RAS when `window` int32 [B, W, N+1] and `semantic_range` (inclusive) are given (slot 0).
    `max_top_k`: a bound on every row's top_k that lets the kernel extract only that many
    candidates; rows with a larger top_k are then treated as top_k = that bound.
    `split_last_column`: see the module docstring (same draws either way).
    Scratch (the radix select's [B, 2k], the chunked kernel's [B, chunks * k] candidates) comes
    from `torch.empty` per call: inside a capture it is the graph's private pool, reused in stream
    order, so nothing is allocated at replay and no cached workspace is regrown under a graph.
    `chunks`: programs per row (`_resolve_chunks`), the same draws as 1 at the same `num_warps`;
    their per-row counters are one buffer per device (`chunk_counters`).

    Under PDL (`kernels/pdl.py`) everything but the logits is read before the wait for the
    previous kernel: no kernel of the same graph or chain before this one may write `token_ids`,
    the parameters, `seed`, `frame` or `window` (the engine uploads them before the step, and
    shifts the window after the step's last draw)."""
    rows, columns = logits.shape
    if columns > MAX_COLUMNS or logits.stride(1) != 1:
        raise ValueError(f"need contiguous rows of at most {MAX_COLUMNS} columns (got {columns})")
    if (window is None) != (semantic_range is None) or (window is not None and slot != 0):
        raise ValueError("RAS needs both window and semantic_range, and the main slot 0")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device) if out is None else out
    if rows == 0:
        return out
    block_v = triton.next_power_of_2(columns)
    k = block_v if max_top_k is None else min(block_v, triton.next_power_of_2(max(2, max_top_k)))
    # A row one column past a power of two (S2's 4,096 semantic ids + `<|im_end|>`) would double
    # the tile, and the top-k network with it: the tile takes the first columns - 1 and the last
    # one is inserted into the extracted top k afterwards (the same keys, in the same order).
    # Only when the k extracted fit in the smaller tile (else the last of k > columns - 1 is lost).
    extra_last = (
        split_last_column and max_top_k is not None and block_v == 2 * (columns - 1) and 2 <= k <= columns - 1
    )
    if extra_last:
        block_v = columns - 1
    radix = k < block_v  # k == block_v sorts the whole tile
    chunks = _resolve_chunks(chunks, rows, block_v, k, radix and logits.is_cuda, preferred_chunks)
    begin, end = semantic_range if semantic_range is not None else (0, -1)
    args = (
        logits, token_ids if token_ids is not None else seed, temperature, top_p, top_k, seed, frame,
        window if window is not None else seed,
    )  # fmt: skip
    scalars = (
        out, slot, columns, begin, end, RAS_TEMPERATURE, RAS_TOP_P, logits.stride(0),
        window.stride(0) if window is not None else 0, window.stride(1) if window is not None else 0,
        out.stride(0), window.shape[1] if window is not None else 0,
    )  # fmt: skip
    meta = dict(
        BLOCK_V=block_v, K=k, BLOCK_W=triton.next_power_of_2(window.shape[1]) if window is not None else 1,
        EXTRA_LAST=extra_last, HAS_TOKEN_IDS=token_ids is not None, RAS=window is not None,
        num_warps=NUM_WARPS if num_warps is None else num_warps, **pdl_launch(),
    )  # fmt: skip
    if chunks == 1:
        scratch = torch.empty(rows, 2 * k, dtype=torch.int64, device=logits.device) if radix else seed
        _sample_kernel[(rows,)](*args, scratch, *scalars, RADIX=radix, **meta)
    else:
        candidates = torch.empty(rows, chunks * k, dtype=torch.int64, device=logits.device)
        counters = chunk_counters(logits.device)
        _sample_chunked_kernel[(rows, chunks)](*args, candidates, counters, *scalars, CHUNKS=chunks, **meta)
    return out


def chunk_counters(device: torch.device) -> Tensor:
    """The chunked kernel's per-row arrival counters on `device`: int32 [CHUNKED_MAX_ROWS], zero
    between launches (each launch's merging programs set their rows' back to 0). Allocated once per
    device and never cleared (a memset would be one more kernel in the step) nor reallocated
    (graphs point at it): chunked launches on a device must not overlap, and the first one may not
    happen inside a CUDA-graph capture."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _CHUNK_COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "sample_tokens' chunked kernel allocates its counters on its first call, which may not be"
                " inside a CUDA-graph capture: warm up first (or pass chunks=1)"
            )
        counters = _CHUNK_COUNTERS[device] = torch.zeros(CHUNKED_MAX_ROWS, dtype=torch.int32, device=device)
    return counters


def _resolve_chunks(
    chunks: int | None, rows: int, block_v: int, k: int, default: bool, preferred: int | None = None
) -> int:
    """How many programs share a row: `chunks` as given (a ValueError if the shape cannot take
    it), else `preferred_chunks`, else `DEFAULT_CHUNKS` where `default` (the radix path on a GPU)
    and rows <= `DEFAULT_CHUNKS_MAX_ROWS`; the last two fall back to 1 where the shape cannot."""
    fits = rows <= CHUNKED_MAX_ROWS
    if chunks is not None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or chunks & (chunks - 1):
            raise ValueError(f"chunks must be a power of two >= 1, got {chunks!r}")
        if chunks > 1 and not (fits and block_v // chunks >= k):
            raise ValueError(
                f"chunks={chunks} needs chunks of at least k={k} of the {block_v}-column tile (pass"
                f" max_top_k) and at most {CHUNKED_MAX_ROWS} rows (got {rows})"
            )
        return chunks
    if preferred is None:
        chunks = DEFAULT_CHUNKS if default and rows <= DEFAULT_CHUNKS_MAX_ROWS else 1
    else:
        chunks = preferred
    return chunks if fits and block_v // chunks >= k else 1


@triton.jit
def _uniform_kernel(seed_ptr, frame_ptr, out_ptr, slot, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _row_hash(tl.load(seed_ptr + row).to(tl.int64), tl.load(frame_ptr + row).to(tl.int64), slot)
    tl.store(out_ptr + row * n + cols, _uniform(h, cols.to(tl.uint32)), mask=cols < n)


def counter_uniform(seed: Tensor, frame: Tensor, slot: int, n: int, block: int = 1024) -> Tensor:
    """float32 [B, n]: the kernel's random stream, equal bit for bit to
    `models.sampling.counter_uniform` (exposed for tests and for callers needing raw draws)."""
    out = torch.empty(seed.shape[0], n, dtype=torch.float32, device=seed.device)
    if seed.shape[0] and n:
        _uniform_kernel[(seed.shape[0], triton.cdiv(n, block))](seed, frame, out, slot, n, BLOCK=block)
    return out
