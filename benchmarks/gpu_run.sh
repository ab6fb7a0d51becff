#!/usr/bin/env bash
# One call on the GPU machine (the device tool): build the kernels for Hopper, then the steps named on the command
# line, each logged to $OUT, with the benchmarks' JSON copied there; at exit all of it is packed into
# $OUT/run.tgz (the device tool brings back at most 8 files).
#   bash benchmarks/gpu_run.sh [build] [tests] [fused-tests] [frame] [frame-ringR] [frame-xring0] [frame-ring-res8]
#                              [frame-prenorm0] [frame-twoblocks0] [frame-attltN] [prenorm-tests]
#                              [attention-tests] [attention-tests-ltN] [kernels-attention] [kernels-attention-lt1]
#                              [kernels] [gemv-ringR] [export]
#                              [export-tests] [export-probe] [graph-tests] [conv-tests] [codec] [codec-layers]
#                              [server] [engine] [session]
#                              [cold-start] [server-p1024] [server-chunk16] [server-rows128] [frame-rows128]
#                              [server-text]
#                              [invariance] [invariance-res8] [invariance-pdl0]
#                              [prefill-tests] [sampler-tests] [frame@VAR=VALUE] [gemv-tests@VAR=VALUE]
#                              [attention-tests@VAR=VALUE] [server@VAR=VALUE] [server-text@VAR=VALUE]
#                              [graph-tests@VAR=VALUE] [codec-layers@VAR=VALUE] [kernels-step@VAR=VALUE]
#                              [tiled-tests] [tiled-tests@VAR=VALUE] [sampler-tests@VAR=VALUE] [fused-tests@VAR=VALUE]
#                              [apply@PATCH build ...]
#                              [codec-tf32] [server-tf32] [engine-tf32] [host (after export)] [server-spy] [http] ...
# Carried wheels in .whl/ (benchmarks/gpu_wheels.sh fetches them: the server steps and the tokenizer fixture need
# them) are installed first.
set -u
FINAL=${OUT:-/tmp/higgs-rt-out}
OUT=$FINAL/run
mkdir -p "$OUT"
trap 'tar -czf "$FINAL/run.tgz" -C "$FINAL" run && rm -rf "$OUT"' EXIT
export HIGGS_RT_COMMIT=${HIGGS_RT_COMMIT:-unknown}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
KERNELS=unchecked
step() {  # name, command...: run, time, log to $OUT/name.log, print the tail; all steps end by $DEADLINE s
  local name=$1; shift
  if [ "$name" != build ] && [ "$name" != full-checkpoint ] && [ $KERNELS = unchecked ]; then
    # a fresh machine without the build step would measure the torch fallbacks: refuse once, here
    python3 -c "import sys; from higgs_rt import ops; sys.exit(0 if ops.HAS_CUDA_KERNELS else 1)" 2>/dev/null \
      || { echo "== $name: higgs-rt's CUDA kernels are not built on this machine: name the build step first"; exit 1; }
    KERNELS=built
  fi
  local t0=$SECONDS left=$(( ${DEADLINE:-560} - SECONDS ))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, the deadline is near"; return 1; fi
  name=$name${TAG:-}  # after apply@: the patched tree's logs apart
  timeout "$left" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
  return $rc
}
test_set() {  # step name, test set, [VAR=VALUE ...]: one GPU test set, under the switches given (its plain and @ steps)
  local name=$1 set=$2
  shift 2
  case $set in
    gemv-tests) step $name env "$@" python3 -m pytest -q -rf --maxfail=20 tests/test_gemv.py ;;
    tiled-tests) step $name env "$@" python3 -m pytest -q -rf tests/test_gemv.py -k "tiled or invariant" ;;
    attention-tests) step $name env "$@" python3 -m pytest -q -rf tests/test_decode_attention.py ;;
    sampler-tests) step $name env "$@" python3 -m pytest -q -rf tests/test_sample_frame.py tests/test_sampling.py ;;
    fused-tests) step $name env "$@" python3 -m pytest -q -rf --maxfail=10 tests/test_fused_step.py tests/test_gpu.py ;;
  esac
}
FULL=/tmp/full
full_checkpoint() {  # the released shapes with random weights: written (atomically) once per machine; the one
  # cold-start writes (Boson's layout) serves as well
  [ -f /tmp/higgs-rt-bench-cold/full/done ] && FULL=/tmp/higgs-rt-bench-cold/full
  [ -f $FULL/config.json ] \
    || step full-checkpoint python3 -m higgs_rt.cli make-random-checkpoint /tmp/full --size full
}
server_levels() {  # suffix of the step and its JSON, then more `serve` arguments; step_b64_ms from this call's
  local step_json=()  # frame-quick or frame, when one ran before it (the committed JSON may be another card's)
  for f in "$OUT/frame_latency_gpu_quick.json" "$OUT/frame_latency_gpu.json"; do
    [ -f "$f" ] && step_json=(--step-json "$f") && break
  done
  full_checkpoint && step server$1 python3 -m benchmarks.bench_server --model $FULL --compute cuda \
    --dtype bf16 --slots 64 --concurrency 1 8 64 --requests 4 --max-new-tokens 300 --ignore-eos \
    --out "$OUT/server_gpu$1.json" --serve-args "${2:-}" "${step_json[@]}"
}
engine_levels() {
  full_checkpoint && step engine$1 python3 -m benchmarks.bench_engine --model $FULL --compute cuda \
    --dtype bf16 --slots 64 --concurrency 8 64 --requests 4 --max-new-tokens 300 --out "$OUT/engine_gpu$1.json" \
    --profile-dir "$OUT/profile$1"
}
server_text() {  # whole texts, nine sentences a request (60 frames at most each): the codec's width and pushes
  full_checkpoint && step server-text python3 -m benchmarks.bench_server --model $FULL --compute cuda \
    --dtype bf16 --slots 64 --concurrency 8 64 --requests 1 --max-new-tokens 60 --probes 0 \
    --out "$OUT/server_gpu_text${TAG:-}.json"
}
graph_tests() {  # the codec's graphed pushes, its kernels and the batch codec on CUDA
  step graph-tests python3 -m pytest -q -rf --maxfail=10 tests/test_codec_stream.py tests/test_snake.py \
    tests/test_codec_stream_ops.py tests/test_codec_conv.py tests/test_prefill.py tests/test_batch_codec.py
}
codec_layers() {  # an 8-frame push's GPU time layer by layer, 8 and 64 lanes
  step codec-layers python3 -m benchmarks.bench_codec_stream --device cuda --layers-only 8 64 \
    --out "$OUT/codec_layers_gpu${TAG:-}.json"
}
# the step's GEMVs and attention (kernels-step, kernels-step@VAR=VALUE)
STEP_OPS=gemv,gemv_residual,norm_gemv_silu,norm_gemv_logits,norm_qkv_rope,decode_attention
for what in "$@"; do
  case $what in
    build)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
      CUDAARCHS=${CUDAARCHS:-90a-real} HIGGS_RT_REQUIRE_CUDA=1 step build \
        python3 -m pip install --no-build-isolation --no-deps -e . || exit 1 ;;
    tests) step tests python3 -m pytest -q -rf --maxfail=20 tests/test_gemv.py tests/test_decode_attention.py \
        tests/test_sample_frame.py tests/test_ops.py ;;
    gemv-tests|tiled-tests|attention-tests|sampler-tests|fused-tests) test_set $what $what ;;
    rowwise-tests) step rowwise-tests python3 -m pytest -q -rf tests/test_rowwise.py ;;
    batch-codec-tests) step batch-codec-tests python3 -m pytest -q -rf tests/test_batch_codec.py ;;
    attention-tests-lt1|attention-tests-lt2) HIGGS_RT_ATTN_LT=${what#attention-tests-lt} step $what \
        python3 -m pytest -q -rf tests/test_decode_attention.py ;;
    kernels-attention|kernels-attention-lt1)  # decode attention alone, graphed, rotating caches
      [ $what = kernels-attention-lt1 ] && export HIGGS_RT_ATTN_LT=1
      step $what python3 -m benchmarks.bench_kernels --iters 50 --ops decode_attention --out "$OUT/${what//-/_}.json"
      unset HIGGS_RT_ATTN_LT ;;
    prefill-tests) step prefill-tests python3 -m pytest -q -rf tests/test_gpu.py -k "prefill or admitted" ;;
    frame) step frame python3 -m benchmarks.bench_frame_latency --hf-frames 100 \
        && cp benchmarks/results/frame_latency_gpu.json "$OUT/" ;;
    frame-quick) step frame-quick python3 -m benchmarks.bench_frame_latency --hf-frames 0 --cold-start-runs 0 \
        --out "$OUT/frame_latency_gpu_quick${TAG:-}.json" ;;  # the steps only (no transformers, no cold start)
    apply@*)  # a patch (`git diff` output, carried as an untracked file) applied to the tree; name build again
      # after it: the steps that follow log as NAME_PATCH (frame-quick's JSON too), so one call measures both trees
      f=${what#apply@}; TAG=_$(basename "$f" .patch)
      step apply git apply "$f" || exit 1 ;;
    cold-start) step cold-start python3 -m benchmarks.bench_frame_latency --cold-start-only --cold-start-runs 5 \
        --out "$OUT/cold_start_gpu.json" ;;  # fresh `higgs-rt speak` processes, a full random checkpoint (Boson layout)
    kernels-step) step kernels-step python3 -m benchmarks.bench_kernels --iters 50 --ops $STEP_OPS \
        --out "$OUT/kernels_step.json" ;;
    frame-ring4|frame-ring8) HIGGS_RT_GEMV_RING=${what#frame-ring} step $what python3 -m benchmarks.bench_frame_latency \
        --hf-frames 0 --cold-start-runs 0 --out "$OUT/frame_latency_gpu_${what#frame-}.json" ;;
    frame-ring-res8) HIGGS_RT_GEMV_RING_RESIDUAL=8 step $what python3 -m benchmarks.bench_frame_latency --hf-frames 0 \
        --cold-start-runs 0 --out "$OUT/frame_latency_gpu_ring_res8.json" ;;  # o-proj/down 8 steps ahead (not 12)
    frame-prenorm0) HIGGS_RT_GEMV_PRENORM=0 step $what python3 -m benchmarks.bench_frame_latency --hf-frames 0 \
        --cold-start-runs 0 --out "$OUT/frame_latency_gpu_prenorm0.json" ;;  # above 16 slots the norm in every block
    frame-twoblocks0) HIGGS_RT_GEMV_TWO_BLOCKS=0 step $what python3 -m benchmarks.bench_frame_latency --hf-frames 0 \
        --cold-start-runs 0 --out "$OUT/frame_latency_gpu_twoblocks0.json" ;;  # above 16 slots one GEMV block an SM
    frame@*|gemv-tests@*|tiled-tests@*|attention-tests@*|server@*|server-text@*|graph-tests@*|codec-layers@*|\
    kernels-step@*|sampler-tests@*|fused-tests@*)
      # measurement switches for one step: frame@HIGGS_RT_ATTN_LT=2[,VAR=VALUE]
      kv=${what#*@}; tag=$(echo "${kv#HIGGS_RT_}" | tr 'A-Z=,' 'a-z__')
      case $what in
        server@*) (export ${kv//,/ }; server_levels "_$tag") ;;
        server-text@*) (export ${kv//,/ }; TAG=_$tag${TAG:-} server_text) ;;
        graph-tests@*) (export ${kv//,/ }; TAG=_$tag${TAG:-} graph_tests) ;;
        codec-layers@*) (export ${kv//,/ }; TAG=_$tag${TAG:-} codec_layers) ;;
        frame@*) step $what env ${kv//,/ } python3 -m benchmarks.bench_frame_latency --hf-frames 0 --cold-start-runs 0 \
            --out "$OUT/frame_latency_gpu_$tag${TAG:-}.json" ;;
        kernels-step@*) step $what env ${kv//,/ } python3 -m benchmarks.bench_kernels --iters 50 --ops $STEP_OPS \
            --out "$OUT/kernels_step_$tag.json" ;;
        *) test_set $what ${what%@*} ${kv//,/ } ;;  # gemv-, tiled-, attention-, sampler-, fused-tests
      esac ;;
    frame-attlt1|frame-attlt2) HIGGS_RT_ATTN_LT=${what#frame-attlt} step $what \
        python3 -m benchmarks.bench_frame_latency --hf-frames 0 --cold-start-runs 0 \
        --out "$OUT/frame_latency_gpu_${what#frame-}.json" ;;
        # attention a tile a load at every batch (1), whole chunks a load up to 16 slots (2)
    prenorm-tests) step prenorm-tests python3 -m pytest -q -rf tests/test_gemv.py -k "invariant or epilogues_cuda or rope_cuda" ;;
    frame-xring0) HIGGS_RT_GEMV_XRING=0 step $what python3 -m benchmarks.bench_frame_latency --hf-frames 0 \
        --cold-start-runs 0 --out "$OUT/frame_latency_gpu_xring0.json" ;;  # above 16 slots x in registers (before XR)
    gemv-ring4|gemv-ring8) HIGGS_RT_GEMV_RING=${what#gemv-ring} step $what python3 -m benchmarks.bench_kernels --iters 50 \
        --ops gemv,gemv_residual,norm_gemv_silu,norm_gemv_logits,norm_qkv_rope --out "$OUT/kernels_${what#gemv-}.json" ;;
    export) step export python3 benchmarks/bench_export.py --paths eager exported --work /tmp/bench-export --jobs 5 \
        --out "$OUT/export_gpu.json" ;;
    export-b1) step export-b1 python3 benchmarks/bench_export.py --paths eager exported --batch 1 \
        --work /tmp/bench-export --out "$OUT/export_gpu_b1.json" ;;  # one step package: fits one call
    export-probe) PYTHONFAULTHANDLER=1 HIGGS_RT_EXPORT_LOGS=$OUT/export-logs TORCH_LOGS=${PROBE_LOGS:-} \
        step export-probe bash -c '[ -n "$TORCH_LOGS" ] || unset TORCH_LOGS; python3 benchmarks/bench_export.py --paths eager \
        exported --batch 1 --work /tmp/bench-export --out /tmp/probe.json & \
        for t in ${PROBE_S:-150} 20; do sleep $t; ps -eo pid,ppid,etime,pcpu,rss,args --sort=-pcpu | cut -c1-200 | head -30; \
        if [ -x .tools/py-spy ]; then for pid in $(pgrep -f "^[^ ]*python3 -m tools[.]export[.]worker"); do \
          echo "== py-spy $pid"; timeout 20 .tools/py-spy dump --native --pid $pid 2>&1 | uniq -c | head -200; done; fi; done; \
        pkill -ABRT -f "^[^ ]*python3 -m tools[.]export[.]worker"; wait' ;;
        # where the export's workers are PROBE_S s in and 20 s later: the processes, each worker's native stacks
        # (py-spy, carried in .tools/; repeated frames counted), then their faulthandler stacks; the workers' logs in
        # export-logs/. Leave PROBE_LOGS empty for a timing: TORCH_LOGS=inductor prints every lowered node, whose
        # text nests its inputs' text, exponential in the depth of the step's op chain (8 layers: > 300 s).
    graph-tests) graph_tests ;;
    codec) step codec python3 -m benchmarks.bench_codec_stream --device cuda --frames 400 --out "$OUT/codec_stream_gpu.json" ;;
    codec-layers) codec_layers ;;
    conv-tests) step conv-tests python3 -m pytest -q -rf tests/test_codec_conv.py ;;
    codec-tf32) HIGGS_RT_CODEC_TF32=1 step codec-tf32 python3 -m benchmarks.bench_codec_stream --device cuda --frames 400 \
        --out "$OUT/codec_stream_gpu_tf32.json" ;;  # the codec's GEMMs on TF32 tensor cores (measurement only)
    server-tf32) HIGGS_RT_CODEC_TF32=1 server_levels _tf32 ;;  # the codec on TF32 (measurement only)
    engine-tf32) HIGGS_RT_CODEC_TF32=1 engine_levels _tf32 ;;
    codec-conv) HIGGS_RT_CODEC_GEMM=0 step codec-conv python3 -m benchmarks.bench_codec_stream --device cuda --frames 400 \
        --out "$OUT/codec_stream_gpu_conv.json" ;;  # the streaming codec on cuDNN's convolutions
    server) server_levels "" ;;
    invariance|invariance-res8|invariance-pdl0)  # a request beside 63 others vs alone, 8 times
      case $what in invariance-res8) export HIGGS_RT_GEMV_RING_RESIDUAL=8 ;; invariance-pdl0) export HIGGS_RT_PDL=0 ;;
      esac
      full_checkpoint && step $what python3 -m benchmarks.bench_server --model $FULL --compute cuda --dtype bf16 \
        --slots 64 --concurrency 64 --requests 1 --max-new-tokens 300 --ignore-eos --probes 8 \
        --out "$OUT/${what}.json"
      unset HIGGS_RT_GEMV_RING_RESIDUAL HIGGS_RT_PDL ;;
    server-text) server_text ;;
    server-p1024) server_levels _p1024 "--prefill-tokens 1024" ;;  # twice the admission budget per tick
    server-chunk16) server_levels _chunk16 "--chunk 16" ;;  # half the codec calls beside the steps
    server-rows128) HIGGS_RT_PREFILL_GROUP_ROWS=128 server_levels _rows128 ;;  # 2 sentences a prefill forward (CUDA's
    # default is 512 since the nineteenth session)
    frame-rows128) HIGGS_RT_PREFILL_GROUP_ROWS=128 step $what python3 -m benchmarks.bench_frame_latency --hf-frames 0 \
        --cold-start-runs 0 --out "$OUT/frame_latency_gpu_rows128.json" ;;  # prefill_sentence and admit_11 at 128
    server-prio0) HIGGS_RT_CODEC_PRIORITY=0 server_levels _prio0 ;;  # the codec's stream at normal priority
    engine) engine_levels "" ;;
    session) full_checkpoint && step session python3 -m benchmarks.bench_session --model $FULL --compute cuda \
        --dtype bf16 --slots 64 --runs 20 --out "$OUT/session_gpu.json" ;;
    host) step host bash -c 'set -e; A=/tmp/bench-export/artifacts; [ -f $A/manifest.json ] || { echo "no full-size
        artifacts: run the export or export-b1 step first"; exit 1; }
        { cmake -S examples -B /tmp/host-build -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(command -v python3) \
          && cmake --build /tmp/host-build --parallel 8; } > /tmp/host-cmake.log 2>&1 || { tail -40 /tmp/host-cmake.log; exit 1; }
        python3 -c "import sys; from higgs_rt.prompt import PromptBuilder; print(*PromptBuilder(sys.argv[1]).tts(sys.argv[2]).ids.tolist())" \
          /tmp/bench-export/model "The sun rises in the east and sets in the west." > /tmp/host-ids.txt
        TIMEFORMAT="host wall %R s"
        for run in 1 2; do time /tmp/host-build/higgs_rt_host --artifacts $A --ids /tmp/host-ids.txt --out /tmp/host.wav \
          --codes /tmp/host-codes.txt --seed 3 --max-frames 200; done
        python3 -c "import soundfile as sf; a, r = sf.read(\"/tmp/host.wav\"); print(f\"host.wav: {len(a) / r:.2f} s at {r} Hz\")"' ;;
        # issue 20's C++ host at full size: the exported packages and weights.pt -> WAV, twice (the second warm)
    server-spy) full_checkpoint && step server-spy bash -c 'python3 -m benchmarks.bench_server --model '$FULL' \
          --compute cuda --dtype bf16 --slots 64 --concurrency 64 --requests 6 --max-new-tokens 300 --ignore-eos \
          --out '$OUT'/server_spy.json & bench=$!
        for i in $(seq 120); do pid=$(pgrep -f "higgs_rt[.]cli serve" | head -1); [ -n "$pid" ] && break; sleep 0.5; done
        [ -n "$pid" ] && .tools/py-spy record --pid $pid --threads --idle --native --rate 100 --format speedscope \
          --output '$OUT'/serve_c64.speedscope.json > '$OUT'/py-spy.log 2>&1 &
        wait $bench' ;;  # serve at c64 under py-spy (every thread, idle ones too): where the loop thread waits
    http) step http bash -c '[ -f /tmp/tiny-http/config.json ] || python3 -m higgs_rt.cli make-random-checkpoint \
        /tmp/tiny-http; python3 benchmarks/bench_http.py --model /tmp/tiny-http --out "$0"' "$OUT/http_gpu_machine.json" ;;
        # the HTTP layer alone on this machine's CPU (the engine stubbed): its cost a request in a burst of 64
    export-tests) step export-tests python3 -m pytest -q -rf --maxfail=10 tests/test_export_cuda.py ;;
    kernels) step kernels python3 -m benchmarks.bench_kernels --iters 100 && cp benchmarks/results/kernels.json "$OUT/" ;;
    *) echo "unknown step $what"; exit 2 ;;
  esac
done
