"""Streaming decode (higgs_rt.codec.stream, .stateful) against the offline decode, on the tiny random codec.

"Equal" as asserted here: a T-frame utterance streams exactly T * hop samples, at >= 100 dB SNR against
`Code2Wav.decode` of the whole utterance (the convolutions sum over other widths, so they round differently;
measured 105-120 dB), for every chunk size from one frame. Per-slot lanes: an utterance decoded among other
lanes that start and end at other frames gives exactly (bit for bit) the samples it gives alone in a one-lane
stream pushed the same way. The module runs torch on one thread: oneDNN then rounds a lane the same whatever the
batch holds (with more threads it may split some narrow transposed convolutions by batch size).
"""

from __future__ import annotations

import pytest
import torch

from higgs_rt.codec import StreamingCodec, StreamingDecoder, load_codec, receptive_field
from higgs_rt.fixtures.codec import delayed_frames, make_codec
from higgs_rt.codec import gemm
from higgs_rt.codec.stateful import StatefulDecoder
from higgs_rt.ops import rvq_lookup
from higgs_rt.codec.stream import chunk_size, chunk_target

K, Q, HOP = 16, 8, 960
MIN_SNR_DB = 100.0
LENGTHS = (*range(1, 17), 31, 64, 127, 200)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def codec(tiny_codec):
    return tiny_codec


def random_codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, K, (frames, Q), generator=torch.Generator().manual_seed(seed))


def snr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (test.double() - reference.double()).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(reference.double().pow(2).sum() / noise))


def run_stream(codec, delayed: torch.Tensor, seed: int, **kwargs) -> tuple[torch.Tensor, StreamingDecoder]:
    """Push delayed frames in random slices of 1..3 frames, then flush."""
    decoder = StreamingDecoder(codec, **kwargs)
    g = torch.Generator().manual_seed(seed)
    pieces, i = [], 0
    while i < len(delayed):
        n = int(torch.randint(1, 4, (1,), generator=g))
        pieces.append(decoder.push(delayed[i: i + n]))
        i += n
    pieces.append(decoder.flush())
    return torch.cat(pieces), decoder


# ----------------------------------------------------------------------------- one stream


@pytest.mark.parametrize("chunk", [1, 2, 4, 8])
def test_stream_equals_offline_for_every_length(codec, chunk):
    for frames in LENGTHS:
        codes = random_codes(frames, seed=frames)
        wav, decoder = run_stream(codec, delayed_frames(codes, K), seed=frames + chunk, first_chunk=1, chunk=chunk)
        assert wav.shape == (frames * HOP,) and decoder.num_samples == frames * HOP, frames
        assert snr_db(codec.decode(codes[None])[0], wav) >= MIN_SNR_DB, frames


@pytest.mark.parametrize("first_chunk,chunk", [(3, 2), (12, 5)])
def test_stream_equals_offline_with_larger_first_chunks(codec, first_chunk, chunk):
    for frames in (2, 13, 40):
        codes = random_codes(frames, seed=100 + frames)
        wav, _ = run_stream(codec, delayed_frames(codes, K), seed=frames, first_chunk=first_chunk, chunk=chunk)
        assert wav.shape == (frames * HOP,)
        assert snr_db(codec.decode(codes[None])[0], wav) >= MIN_SNR_DB


def test_lag_is_the_right_receptive_field(codec):
    right = receptive_field(codec.config)[1]
    assert right == 10 and StreamingCodec(codec, 1).lag == right and StreamingDecoder(codec).lookahead == right


@pytest.mark.parametrize("first_chunk,chunk,ramp", [(1, 1, [1]), (1, 8, [2, 4, 8]), (4, 8, [8]), (12, 5, [5]),
                                                    (3, 16, [6, 12, 16])])
def test_first_audio_and_chunk_sizes(codec, first_chunk, chunk, ramp):
    """Frame by frame as the Talker emits them: the first PCM comes with generated frame 1 (BOS) + (Q - 1) +
    first_chunk + lookahead and holds first_chunk frames; then chunks doubling up to chunk frames (ramp), then
    chunk frames every chunk frames."""
    decoder = StreamingDecoder(codec, first_chunk=first_chunk, chunk=chunk)
    frames = 60
    sizes = [decoder.push(frame[None]).shape[0] // HOP for frame in delayed_frames(random_codes(frames, 9), K)]
    first = 1 + (Q - 1) + first_chunk + decoder.lookahead
    assert sizes[: first - 1] == [0] * (first - 1) and sizes[first - 1] == first_chunk
    later = sizes[first: frames + Q]  # through the last data frame (the all-EOS one is frame frames + Q)
    want = []
    for size in ramp + [ramp[-1]] * frames:
        want += [0] * (size - 1) + [size]
    assert later == want[:len(later)]
    assert sizes[frames + Q] == 0  # the all-EOS frame completes nothing: the rest waits for flush
    assert sum(sizes) + decoder.flush().shape[0] // HOP == frames


def test_the_chunk_schedule_ramps_up_by_doubling():
    assert [chunk_size(start, 1, 8) for start in (0, 1, 3, 7, 15, 23)] == [1, 2, 4, 8, 8, 8]
    assert [chunk_size(start, 12, 5) for start in (0, 12, 17)] == [12, 5, 5]
    assert [chunk_target(ready, None, 1, 8) for ready in (0, 1, 2, 3, 6, 7, 14, 15, 22, 23, 40)] == \
        [0, 1, 1, 3, 3, 7, 7, 15, 15, 23, 39]
    assert [chunk_target(ready, 5, 1, 8) for ready in (2, 4, 5, 9)] == [1, 3, 5, 5]  # the end is a point too
    assert [chunk_target(ready, None, 12, 5) for ready in (11, 12, 16, 17, 23)] == [0, 12, 12, 17, 22]


def test_stream_without_eos_ends_at_flush_and_guards_misuse(codec):
    codes = random_codes(5, seed=12)
    delayed = delayed_frames(codes, K)[:-1]  # no closing all-EOS frame: flush ends the utterance
    decoder = StreamingDecoder(codec, first_chunk=1, chunk=1)
    assert decoder.push(delayed[:0]).shape == (0,)
    wav = torch.cat([decoder.push(delayed), decoder.flush()])
    # the ramp-out frames hold EOS in low codebooks, clipped to K - 1 like the offline path clips them
    expected = codec.decode(codec.postprocess(delayed)[None])[0]
    assert wav.shape == expected.shape == (5 * HOP,) and snr_db(expected, wav) >= MIN_SNR_DB
    assert decoder.flush().shape == (0,)
    with pytest.raises(RuntimeError, match="reset"):
        decoder.push(delayed[:1])
    decoder.reset()  # the same decoder streams the next utterance from scratch
    again = torch.cat([decoder.push(delayed), decoder.flush()])
    assert torch.equal(again, wav)
    with pytest.raises(ValueError, match=r"^chunk must be an integer number of frames in 1\.\.64, got 0$"):
        StreamingDecoder(codec, chunk=0)
    with pytest.raises(ValueError, match="host must be a CPU copy"):
        StreamingDecoder(codec).push(delayed[:2], host=delayed[:1])
    with pytest.raises(ValueError, match=r"frames must be \[n, 8\]"):
        StreamingDecoder(codec).push(delayed[None])


def test_frames_after_the_eos_are_ignored(codec):
    codes = random_codes(7, seed=13)
    delayed = delayed_frames(codes, K)
    junk = torch.randint(0, K + 2, (30, Q), generator=torch.Generator().manual_seed(0))
    wav, decoder = run_stream(codec, torch.cat([delayed, junk]), seed=3, first_chunk=2, chunk=3)
    assert torch.equal(wav, run_stream(codec, delayed, seed=4, first_chunk=2, chunk=3)[0])
    assert wav.shape == (7 * HOP,) and snr_db(codec.decode(codes[None])[0], wav) >= MIN_SNR_DB


def test_stream_of_only_bos_frames_is_empty(codec):
    decoder = StreamingDecoder(codec)
    assert decoder.push(torch.full((3, Q), K)).shape == (0,)
    assert decoder.flush().shape == (0,) and decoder.num_samples == 0


# ----------------------------------------------------------------------------- per-slot lanes


def run_lanes(codec, utterances: list[tuple[int, int, torch.Tensor]], slots: int, n: int, late: int = 0,
              flush: bool = False) -> list[torch.Tensor]:
    """Drive a StreamingCodec with n frames per push. Utterance (slot, start, codes) has its all-BOS frame at
    global frame `start` in its slot (free by then); other lanes' frames are random codes, BOS and EOS included.
    The host tells an utterance's end `late` frames after its all-EOS frame was pushed (the device finds the EOS
    itself before that). flush: once no utterance is left to start and every live one has ended, finish them
    all with `flush()`. Returns each utterance's audio, concatenated from its spans."""
    stream = StreamingCodec(codec, slots)
    delayed = [delayed_frames(codes, K) for _, _, codes in utterances]
    audio: list[list[torch.Tensor]] = [[] for _ in utterances]
    live: dict[int, int] = {}  # slot -> utterance
    ended: set[int] = set()
    last_start = max(start for _, start, _ in utterances)
    tick = 0

    def collect(pcm, spans):
        for slot, u in list(live.items()):
            a, b = spans[slot]
            audio[u].append(pcm[slot, a:b])
            if u in ended and stream.done(slot):
                stream.release(slot)
                del live[slot]

    while tick * n <= last_start or live:
        if flush and tick * n > last_start and live and all(u in ended for u in live.values()):
            collect(*stream.flush())
            assert not live
            break
        frames = torch.randint(0, K + 2, (slots, n, Q), generator=torch.Generator().manual_seed(tick))
        for u, (slot, start, _) in enumerate(utterances):
            if tick * n <= start < (tick + 1) * n:
                assert slot not in live, "the schedule reuses a slot too early"
                stream.start(slot, bos_at=start - tick * n)
                live[slot] = u
        for slot, u in live.items():
            for j in range(n):
                index = tick * n + j - utterances[u][1]  # the lane's frame index (its all-BOS frame is 0)
                if 0 <= index < len(delayed[u]):
                    frames[slot, j] = delayed[u][index]
        for slot, u in live.items():  # the host learns the end `late` frames after the all-EOS frame
            eos_at = len(delayed[u]) - 1
            if u not in ended and (tick + 1) * n - utterances[u][1] > eos_at + late:
                stream.end(slot, eos_at)
                ended.add(u)
        collect(*stream.push(frames))
        tick += 1
    return [torch.cat(parts) for parts in audio]


UTTERANCES = ((0, 0, 23), (1, 2, 5), (2, 7, 1), (1, 40, 12), (2, 41, 30), (0, 60, 0))  # (slot, start, frames)


@pytest.mark.parametrize("n,late,flush", [(1, 0, False), (1, 9, True), (3, 2, False), (8, 0, True)])
def test_lanes_starting_and_ending_apart_equal_their_single_streams(codec, n, late, flush):
    utterances = [(slot, start, random_codes(frames, 20 + i)) for i, (slot, start, frames) in enumerate(UTTERANCES)]
    outs = run_lanes(codec, utterances, slots=3, n=n, late=late, flush=flush)
    for (_, start, codes), wav in zip(utterances, outs):
        alone = run_lanes(codec, [(0, start, codes)], slots=1, n=n, late=late, flush=flush)[0]
        assert wav.shape == (codes.shape[0] * HOP,) and torch.equal(wav, alone)
        if len(codes):
            assert snr_db(codec.decode(codes[None])[0], wav) >= MIN_SNR_DB


@pytest.mark.parametrize("widths,slots,lane,threads", [
    ([1] * 49, 1, 0, None), ([3] * 17, 1, 0, None), ([18, 8, 8, 8, 5, 2], 4, 2, None), ([2] * 25, 3, 1, 1)])
def test_a_lanes_bits_do_not_depend_on_push_width_batch_or_threads(codec, widths, slots, lane, threads):
    """What the batch engine's codec relies on (higgs_rt.batch_codec pushes every lane at whatever width another
    lane's chunk is due, in a bucket of lanes, on its own thread): the same bits as one lane in chunks of 8."""
    delayed = delayed_frames(random_codes(40, 7), K)  # 49 frames: all-BOS, 40 + 7 delay frames, all-EOS

    def run(widths, slots, lane):
        stream = StreamingCodec(codec, slots)
        stream.start(lane, bos_at=0)
        out, at = [], 0
        for n in widths:
            frames = torch.randint(0, K, (slots, n, Q), generator=torch.Generator().manual_seed(at))
            frames[lane] = delayed[at: at + n] if at + n <= len(delayed) else torch.cat(
                [delayed[at:], torch.zeros(at + n - len(delayed), Q, dtype=torch.int64)])[:n]
            pcm, spans = stream.push(frames)
            out.append(pcm[lane, spans[lane][0]: spans[lane][1]])
            at += n
        stream.end(lane, len(delayed) - 1)
        pcm, spans = stream.flush()
        return torch.cat([*out, pcm[lane, spans[lane][0]: spans[lane][1]]])

    want = run([8] * 7, 1, 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        got = run(widths, slots, lane)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (40 * HOP,) and torch.equal(got, want)


@pytest.mark.parametrize("moves", [[(1, 2, 0)], [(3, 2, 1), (5, 1, 0)], [(6, 2, 0)]])
def test_a_lane_moved_mid_stream_gives_the_bits_it_would_have_given_in_place(codec, moves):
    """`move` (the batch engine's codec compacts its busy lanes with it): a lane carried to another slot after
    push i, before its end, after its end while it drains, or twice, gives one lane's bits in chunks of 8; the
    slot it left is free, and a lane streaming beside it (slot 3) is not disturbed."""
    delayed = delayed_frames(random_codes(40, 7), K)  # 49 frames
    other = delayed_frames(random_codes(30, 8), K)

    def run(moves):
        stream = StreamingCodec(codec, 4)
        lane, beside = 2, 3
        stream.start(lane, bos_at=0)
        stream.start(beside, bos_at=0)
        out, side, at = [], [], 0
        for i in range(8):
            frames = torch.randint(0, K, (4, 8, Q), generator=torch.Generator().manual_seed(i))
            for slot, codes in ((lane, delayed), (beside, other)):
                piece = codes[at: at + 8]
                frames[slot, :len(piece)] = piece
            pcm, spans = stream.push(frames)
            out.append(pcm[lane, spans[lane][0]: spans[lane][1]])
            side.append(pcm[beside, spans[beside][0]: spans[beside][1]])
            at += 8
            if i == 5:
                stream.end(lane, len(delayed) - 1)
            if i == 3 and stream.remaining(beside) is None:
                stream.end(beside, len(other) - 1)
            for after, src, dst in moves:
                if after == i:
                    assert src == lane
                    stream.move(src, dst)
                    lane = dst
                    with pytest.raises(RuntimeError, match=f"slot {src} has no stream"):
                        stream.end(src)
        assert stream.done(lane) and stream.done(beside)
        return torch.cat(out), torch.cat(side)

    want, want_side = run([])
    got, got_side = run(moves)
    assert got.shape == (40 * HOP,) and torch.equal(got, want) and torch.equal(got_side, want_side)


def test_a_lane_moves_only_into_a_free_slot(codec):
    stream = StreamingCodec(codec, 3)
    stream.start(0)
    stream.start(1)
    with pytest.raises(RuntimeError, match="slot 1 is streaming: release it before moving slot 0 there"):
        stream.move(0, 1)
    with pytest.raises(RuntimeError, match="slot 2 has no stream"):
        stream.move(2, 0)
    with pytest.raises(IndexError, match="out of range"):
        stream.move(0, 3)
    stream.move(1, 2)
    stream.start(1)  # free again


@pytest.mark.parametrize("slots,widths", [(1, [1, 2, 8, 3]), (3, [8, 1, 4, 8, 2])])
def test_the_gemm_path_equals_the_convolution_path(codec, slots, widths):
    """`codec.gemm` (the CUDA default) against the convolutions, step by step on the CPU: lanes that start
    before, at and after the first push and end apart, the same state carried between calls."""
    conv, gemm = StatefulDecoder(codec, 4), StatefulDecoder(codec, 4, gemm=True)
    assert gemm.gemm and not conv.gemm
    first, length = torch.tensor([0, -3, 6][:slots]), torch.tensor([15, 9, 21][:slots])
    g = torch.Generator().manual_seed(slots)
    outs = [], []
    for n in widths:
        codes = torch.randint(0, K, (slots, n, Q), generator=g)
        for out, decoder in zip(outs, (conv, gemm)):
            out.append(decoder.step(codes, first, length))
        first = first + n
    want, got = torch.cat(outs[0], 1), torch.cat(outs[1], 1)
    assert got.shape == want.shape == (slots, sum(widths) * HOP)
    assert want.abs().max() > 0.1 and snr_db(want, got) >= MIN_SNR_DB


@pytest.mark.parametrize("frames", [1, 2, 7, 40])
def test_the_gemm_offline_decode_equals_the_modules(codec, frames):
    """`gemm.decode` (what `Code2Wav.decode` runs on CUDA) against the modules' convolutions, on the CPU."""
    codes = torch.stack([random_codes(frames, 300 + frames), random_codes(frames, 400 + frames)])
    with torch.inference_mode():
        want = codec.decode(codes)
        got = gemm.decode(codec.acoustic_decoder, codec.fc2(rvq_lookup(codes, codec.table)))
    assert got.shape == want.shape == (2, frames * HOP)
    assert snr_db(want, got) >= MIN_SNR_DB and not torch.equal(got[0], got[1])


def test_lane_misuse(codec):
    stream = StreamingCodec(codec, 2)
    with pytest.raises(IndexError, match="out of range"):
        stream.start(2)
    with pytest.raises(ValueError, match="bos_at"):
        stream.start(0, bos_at=-2)
    with pytest.raises(RuntimeError, match="start"):
        stream.end(1)
    with pytest.raises(ValueError, match=r"frames must be \[m, n, 8\] with 1 <= m <= 2"):
        stream.push(torch.zeros(3, 1, Q, dtype=torch.int64))
    stream.start(0)
    with pytest.raises(ValueError, match="eos_at"):
        stream.end(0, 0)
    with pytest.raises(RuntimeError, match=r"slot\(s\) \[0\] have not ended"):
        stream.flush()
    pcm, spans = stream.push(torch.zeros(2, 3, Q, dtype=torch.int64))
    assert pcm.shape == (2, 3 * HOP) and spans == [(0, 0), (0, 0)]  # all of it is the lag
    assert stream.remaining(0) is None and not stream.done(0)
    stream.end(0)  # no EOS: the utterance is its complete frames so far (none)
    assert stream.done(0) and stream.flush()[1] == [(0, 0), (0, 0)]
    stream.start(1)
    with pytest.raises(ValueError, match=r"would leave streaming slot\(s\) \[1\] behind"):
        stream.push(torch.zeros(1, 1, Q, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lanes_on_cuda_never_sync_and_match_the_cpu(codec, tmp_path):
    cuda = load_codec(make_codec(tmp_path, size="tiny", seed=0), device="cuda")
    codes = random_codes(30, 40)
    delayed = delayed_frames(codes, K).cuda()
    stream = StreamingCodec(cuda, 2)
    stream.start(0)
    stream.start(1, bos_at=1)
    pieces = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(len(delayed) + 12):
            frame = delayed[min(i, len(delayed) - 1)]
            if i == len(delayed) - 1:
                stream.end(0, i)
            pcm, spans = stream.push(torch.stack([frame, frame])[:, None])
            pieces.append(pcm[0, spans[0][0]: spans[0][1]])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    wav = torch.cat(pieces).cpu()
    assert wav.shape == (30 * HOP,)
    assert snr_db(codec.decode(codes[None])[0], wav) >= MIN_SNR_DB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_chunks_equal_eager_and_the_offline_decode_on_cuda(tmp_path):
    """The first chunk and the 8-frame chunks replay CUDA graphs (captured mid-stream, the state put back); a
    decoder reused across utterances (reset) gives, bit for bit, the eager decoder's samples; both are within
    float rounding of the offline decode (IEEE fp32 convolutions on both sides)."""
    cuda = load_codec(make_codec(tmp_path, size="tiny", seed=0), device="cuda")
    graphed, eager = StreamingDecoder(cuda), StreamingDecoder(cuda)
    eager._lanes.graph_widths = set()
    widths = {1 + Q - 1 + graphed.lookahead, 2, 4, 8}  # the first push, the ramp's chunks (2, 4), the steady ones
    assert graphed._lanes.graph_widths == widths
    for seed, frames in ((50, 40), (51, 23)):
        codes = random_codes(frames, seed)
        delayed = delayed_frames(codes, K).cuda()
        outs = []
        for dec in (graphed, eager):
            dec.reset()
            pieces = [dec.push(delayed[i: i + 1], host=delayed[i: i + 1].cpu()) for i in range(len(delayed))]
            outs.append(torch.cat([*pieces, dec.flush()]).cpu())
        assert outs[0].shape == (frames * HOP,) and torch.equal(outs[0], outs[1])
        assert snr_db(cuda.decode(codes[None].cuda())[0].cpu(), outs[0]) >= MIN_SNR_DB
    assert sorted(graphed._lanes._graphs) == [(1, n) for n in sorted(widths)]
