#!/usr/bin/env bash
# One call on a lent GPU machine (docs/gpu.md): every `gpu` test, the gather/scatter benchmark in device time and
# per call, and `kvstage bench --backend cuda_ipc --device cuda`; each step's log goes to $OUT (default ./out).
# Missing wheels (msgspec, pyzmq: docs/gpu.md) are installed from .whl/ when it exists. Each step has
# its own time limit, so a stuck step costs only its own share of the call. Usage: bash
# benchmarks/gpu_session.sh [STEP ...], in the order
# given (default: tests gs_device gs_call bench; also gs_shapes, the other shapes in device time, bench_c4, the
# bench with 4 requests at once, nixl_tests and bench_nixl (bench_nixl_ucx_defaults: without UCX_TLS), the nixl
# backend on GPU memory (needs a NIXL wheel for the host's CUDA in .whl/, nixl-cu13 on the lent H200s), and
# ncu_scatter, Nsight Compute on one launch each of a copy kernel, the scatter and the gather: the report's raw
# metrics in $OUT/ncu_raw.csv, the key ones in the log; sharing, what N processes on one GPU cost each small
# operation; bench_p1d1 and bench_chunk2048, the bench with 2 processes, and with 4x fewer, 4x larger chunks;
# step_time, the vLLM connector's host time per engine step, benchmarks/connector_step_time.py; tests3, every `gpu`
# test three times in a row (logs tests_run1..3); handoff_p2d1, handoff_p4d2, handoff_p4d2_c2048, the handoff scenario side by side with
# the runtime of a baseline tree whose src lies in .base/ (`git archive REF src | tar -x -C .base`, its commit in
# .base/COMMIT; carried like .whl/), 5 invocations each; HANDOFF_RUNS overrides the count); handoff_p2d1_mps and
# handoff_p4d2_mps, the same with every rank process a client of one MPS server started for the step and stopped
# after it (the processes then share the GPU without time-slicing between their contexts, closer to a GPU per rank);
# profile_p2d1, one P2->D1 handoff invocation under py-spy (its wheel in .whl/), samples in $OUT/reactor_samples.txt,
# summarized by benchmarks/reactor_profile.py; profile_p2d1_mps, the same under an MPS server of its own.
set -u -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="$PWD/src:/tmp/site"
else
    export PYTHONPATH="$PWD/src"
fi
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; nproc;
  git log --oneline -1 2>/dev/null; } > "$OUT/machine.txt" 2>&1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T))"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "rc=$? $name"
    tail -n 12 "$OUT/$name.log"
}

GS="python3 benchmarks/gather_scatter.py --tokens 4096 16384"
BENCH_ARGS="--device cuda --model llama3-8b --prefill-tp 4 --decode-tp 2 --tokens 4096 --page-size 16 --repeats 5 --slice-rounds 1 --json"
BENCH="python3 -m kvstage bench --backend cuda_ipc $BENCH_ARGS"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
NCU_RUN="$NCU --set full --clock-control none --profile-from-start off --kernel-name 'regex:_copy_kernel|_stream_copy'"
GPU_TESTS="tests/transport/test_cuda_ipc.py tests/transport/test_cuda_ipc_late_copies.py tests/transport/test_nixl_vram.py
    tests/runtime/test_gpu_agents.py tests/dataplane/test_kernels_gpu.py tests/integrations/test_vllm_worker_gpu.py
    tests/dataplane/test_dataplane_roundtrip.py tests/runtime/test_agents.py"
HANDOFF="python3 benchmarks/handoff_ab.py --baseline-src .base/src --runs ${HANDOFF_RUNS:-5}"
HANDOFF_ARGS="--backend cuda_ipc --device cuda --model llama3-8b --tokens 4096 --page-size 16"
PROFILE="/tmp/site/bin/py-spy record --subprocesses --nonblocking -r 2000 -f raw -o $OUT/reactor_samples.txt -- \
    python3 -m kvstage bench --handoff $HANDOFF_ARGS --prefill-tp 2 --decode-tp 1 --json &&
    python3 benchmarks/reactor_profile.py $OUT/reactor_samples.txt"
mps() {  # mps STEP-NAME SECONDS COMMAND...: run one step under an MPS server of its own
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/kvstage-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/kvstage-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        step "$@"
        echo quit | nvidia-cuda-mps-control
        sleep 2
    else
        echo "rc=1 $1: nvidia-cuda-mps-control did not start"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests gs_device gs_call bench)
for STEP in "${STEPS[@]}"; do
    case $STEP in
    tests) step tests 270 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" --timeout 120 $GPU_TESTS ;;
    tests3) for i in 1 2 3; do step "tests_run$i" 290 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
        --timeout 120 $GPU_TESTS; done ;;
    handoff_p2d1) step handoff_p2d1 540 $HANDOFF -- $HANDOFF_ARGS --prefill-tp 2 --decode-tp 1 ;;
    handoff_p2d1_mps) mps handoff_p2d1_mps 540 $HANDOFF -- $HANDOFF_ARGS --prefill-tp 2 --decode-tp 1 ;;
    handoff_p4d2_mps) mps handoff_p4d2_mps 540 $HANDOFF -- $HANDOFF_ARGS --prefill-tp 4 --decode-tp 2 ;;
    profile_p2d1) step profile_p2d1 150 bash -c "$PROFILE" ;;
    profile_p2d1_mps) mps profile_p2d1_mps 150 bash -c "$PROFILE" ;;
    handoff_p4d2) step handoff_p4d2 540 $HANDOFF -- $HANDOFF_ARGS --prefill-tp 4 --decode-tp 2 ;;
    handoff_p4d2_c2048) step handoff_p4d2_c2048 540 $HANDOFF -- $HANDOFF_ARGS --prefill-tp 4 --decode-tp 2 \
        --chunk-tokens 2048 ;;
    step_time) step step_time 240 python3 benchmarks/connector_step_time.py --runs 7 ;;
    gs_device) step gs_device 100 $GS --runs 7 --repeats 10 --batch 10 ;;
    gs_call) step gs_call 70 $GS --runs 7 --repeats 20 ;;
    gs_shapes) step gs_shapes 120 bash -c "$GS --page-size 1 64 --runs 5 --repeats 10 --batch 10 &&
        $GS --dtype float8_e4m3fn --runs 5 --repeats 10 --batch 10 && $GS --tp 16:2 --runs 5 --repeats 10 --batch 10" ;;
    bench) step bench 170 $BENCH ;;
    bench_c4) step bench_c4 170 $BENCH --concurrency 4 ;;
    bench_p1d1) step bench_p1d1 170 python3 -m kvstage bench --backend cuda_ipc ${BENCH_ARGS/--prefill-tp 4 --decode-tp 2/--prefill-tp 1 --decode-tp 1} ;;
    bench_chunk2048) step bench_chunk2048 170 $BENCH --chunk-tokens 2048 ;;
    sharing) step sharing 200 python3 benchmarks/gpu_sharing.py --procs 1 2 6 --runs 5 ;;
    nixl_tests) step nixl_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" --timeout 60 -k nixl \
        tests/transport/test_nixl_vram.py tests/runtime/test_gpu_agents.py ;;
    bench_nixl) step bench_nixl 150 env UCX_TLS=cuda_ipc,cuda_copy,tcp python3 -m kvstage bench --backend nixl $BENCH_ARGS ;;
    bench_nixl_ucx_defaults) step bench_nixl_ucx_defaults 150 python3 -m kvstage bench --backend nixl $BENCH_ARGS ;;
    ncu_scatter) step ncu_scatter 150 bash -c "$NCU_RUN -f -o /tmp/scatter_vs_copy python3 benchmarks/ncu_scatter.py &&
        $NCU --import /tmp/scatter_vs_copy.ncu-rep --page raw --csv > $OUT/ncu_raw.csv &&
        python3 benchmarks/ncu_scatter.py --summarize $OUT/ncu_raw.csv" ;;
    *) echo "unknown step $STEP" ;;
    esac
done
