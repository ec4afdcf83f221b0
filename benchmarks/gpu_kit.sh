#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("The GPU kit"; what each lease measured:
# docs/speed-notes.md) in two commands, for a session that is lent a GPU machine. That
# machine has PyTorch with CUDA, numpy, scipy, matplotlib, networkx, pytest and pytest-xdist,
# but reaches no package registry and has no Fashion-MNIST files; `prepare` gathers what it
# lacks into .gpu_kit/ (ignored by git, about 50 MB: the device tool carries at most 64 MiB
# with the tree).
#
#   benchmarks/gpu_kit.sh prepare   # here, with PyPI: wheels + Fashion-MNIST
#   benchmarks/gpu_kit.sh test      # there (carry .gpu_kit): install, the test suite
#   benchmarks/gpu_kit.sh bench     # there: synthetic 200 rounds, operations, the CNN
#   benchmarks/gpu_kit.sh all       # there: both in one call (shorter limits; 15-minute leases)
#   benchmarks/gpu_kit.sh cnn       # there: the CNN's two forms of convolutions (4 to 8 minutes)
#
# The synthetic runs and the CNN's rounds are also timed on the $BASE tree (below), archived
# by `prepare`, side by side in the same call.
#
# `test` and `bench` each fit one 10-minute call and write their logs to $OUT (at most 8
# files come back: more are packed into $OUT/gpu_kit_out.tgz at the end). Each installs
# first, so either may run on a fresh machine.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT=.gpu_kit
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_kit}
ANCHOR=5e626a6  # the speed issue's anchor: 15.5 s for 200 synthetic rounds on an H100
BASE=59c9f43  # the last tree timed on a GPU (the fifth lease, an H200: docs/speed-notes.md;
              # 74a0301 before it)

# cvxpy 1.6 (not 1.9: its extra solvers would not fit the carry) with SCS and Clarabel for
# the FMMC weights, pyzmq for the peer-to-peer transport, pytest >= 8.4 (pyproject.toml's
# addopts use its --disable-plugin-autoload; the image's version is not documented) with the
# pluggy and iniconfig it needs
WHEELS=("cvxpy==1.6.*" "scs<3.3" clarabel osqp pyzmq cffi pycparser "pytest==9.0.*" pluggy iniconfig)

prepare() {
    rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/fashion-mnist" || exit 2
    # the machine's Python is CPython 3.12 on x86_64 (docs of the device tool, KINDS.md)
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$KIT/wheels" "${WHEELS[@]}" || exit 2
    cp /usr/share/datasets/fashion-mnist/*-ubyte.gz "$KIT/fashion-mnist/" || {
        echo "gpu_kit: no Fashion-MNIST here: apt-get install -y dataset-fashion-mnist" >&2
        exit 2
    }
    # the issue's anchor commit, to time it side by side on the same GPU (bench_wall.py needs
    # the git history, which the device tool does not carry), and this machine's solved FMMC
    # weights (a 300-node SDP takes seconds of the lease)
    mkdir -p "$KIT/anchor" "$KIT/base" "$KIT/cache" || exit 2
    git archive "$ANCHOR" | tar -x -C "$KIT/anchor" && git archive "$BASE" | tar -x -C "$KIT/base" \
        || exit 2
    echo "$BASE" > "$KIT/base/COMMIT"  # the tree there (bench_cnn.py reads this checkout's HEAD)
    cp -r "${GOSSIP_PFL_CACHE:-$HOME/.cache/gossip-pfl}/fmmc" "$KIT/cache/" 2>/dev/null || true
    du -sh "$KIT"
}

sources() {
    echo "sources: $(find gossip_pfl benchmarks tests configs -type f \( -name '*.py' -o \
        -name '*.yaml' -o -name '*.sh' \) -print0 | LC_ALL=C sort -z | xargs -0 sha1sum |
        sha1sum | cut -c1-12)"
}

install() {
    [ -d "$KIT/wheels" ] || { echo "gpu_kit: no $KIT: run 'prepare' here and carry it" >&2; exit 2; }
    mkdir -p "$OUT" || exit 2
    # beside the image's packages, not into them (the device tool's recipe); the project
    # itself runs from this tree
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$KIT"/wheels/*.whl || exit 2
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    mkdir -p /usr/share/datasets/fashion-mnist || exit 2
    cp -n "$KIT"/fashion-mnist/* /usr/share/datasets/fashion-mnist/ || exit 2
    {
        nvidia-smi
        $PY -c "import torch, cvxpy, zmq; print('torch', torch.__version__, torch.cuda.get_device_name(), 'cvxpy', cvxpy.__version__, 'pyzmq', zmq.__version__)"
        git rev-parse --short HEAD 2>/dev/null || echo "commit: not a git checkout"
        echo "base: $(cat "$KIT/base/COMMIT" 2>/dev/null || echo "unknown: run prepare again")"
        # the device's copy of the tree can carry a stale HEAD (it read 424f8af for fb043e2):
        # `benchmarks/gpu_kit.sh sources` here prints the same hash for the same sources
        sources
    } > "$OUT/machine.txt" 2>&1
    tail -3 "$OUT/machine.txt"
}

# stage NAME SECONDS COMMAND...: COMMAND's output and exit status into $OUT/NAME.txt; the
# script exits with the worst status of its stages (3 for a stage past its time limit)
worst=0
stage() {
    local name=$1 limit=$2 rc t0=$SECONDS
    shift 2
    # ONLY="tests synthetic ...": run these stages alone (a lease split into two calls)
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
    echo "== $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    echo "exit $rc after $((SECONDS - t0)) s" >> "$OUT/$name.txt"
    tail -4 "$OUT/$name.txt"
    [ "$rc" -gt "$worst" ] && worst=$rc
    return 0
}

# bench SYNTHETIC_S OPS_S PROFILE_S CNN_S MAX_PEERS CNN_MODES BASE_S [STEP_GRAPHS]: 200
# synthetic rounds on the GPU (this tree without CUDA graphs once, then with them twice,
# alternating with the $BASE tree; then the anchor), operations per round, each
# operation's first call in a fresh process, a profile of a round (both ways), the
# planner's host work, the CNN (with a profile of a round, the most clients up to
# MAX_PEERS, 0: none, and each mode with its steps eager and as CUDA graphs where
# STEP_GRAPHS is off,on), the CNN on the $BASE tree
bench() {
    export OMP_NUM_THREADS=1 PY DEV=${DEV:-cuda} GOSSIP_PFL_CACHE=$PWD/$KIT/cache
    # a failed run shows its last lines, the others still run, and the stage then fails
    stage synthetic "$1" bash -c 'failed=0; here=$PWD
    for run in new:false base:true new:true base:true new:true; do
        tree=${run%%:*}; g=${run##*:}; echo "$tree, runtime.cuda_graphs=$g:"
        dir=$here; [ "$tree" = base ] && dir=$here/.gpu_kit/base
        (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH $PY -m gossip_pfl run \
            configs/synthetic/dfedem.yaml --no-plots --overwrite --set runtime.device=$DEV \
            --set runtime.cuda_graphs=$g --out /tmp/synthetic_run) > /tmp/synthetic.log 2>&1 \
            && grep -E "wall_s|test_acc" /tmp/synthetic.log \
            || { failed=1; echo "failed:"; tail -5 /tmp/synthetic.log; }
    done
    if [ -d .gpu_kit/anchor ]; then echo "anchor:"; cd .gpu_kit/anchor && \
        PYTHONPATH=$PWD:$PYTHONPATH $PY -m gossip_pfl run configs/synthetic/dfedem.yaml \
            --overwrite --set runtime.device=$DEV --out /tmp/anchor_run \
            | grep -E "wall_s|test_acc" || failed=1
    fi
    exit $failed'
    # its JSON into its log: the device tool returns at most 8 files
    stage ops "$2" bash -c '$PY benchmarks/bench_ops.py --rounds 5 --set runtime.device=$DEV \
        --json /tmp/bench_ops.json && cat /tmp/bench_ops.json'
    # FedLi-LS's line search eager and as step graphs (the graphs read one value back a
    # trial; untimed before), twice each, alternating: wall time and accuracy
    stage line_search 80 bash -c 'for g in false true false true; do
        echo "runtime.cuda_graph_steps=$g:"
        $PY -m gossip_pfl run configs/synthetic/fedli_ls.yaml --no-plots --overwrite \
            --set runtime.device=$DEV --set runtime.cuda_graph_steps=$g --out /tmp/ls_run \
            > /tmp/ls.log 2>&1 && grep -E "wall_s|test_acc|graph" /tmp/ls.log \
            || { echo "failed:"; tail -5 /tmp/ls.log; exit 1; }
    done'
    # D-FedEM with momentum: the fused round's terms (untimed before) against the $BASE tree's
    # solver steps, wall time and accuracy (one run each: the call's 10 minutes are near full)
    stage momentum 40 bash -c 'here=$PWD; failed=0; for tree in new base; do
        dir=$here; [ "$tree" = base ] && dir=$here/.gpu_kit/base; echo "$tree:"
        (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH $PY -m gossip_pfl run \
            configs/synthetic/dfedem.yaml --no-plots --overwrite --set runtime.device=$DEV \
            --set algorithm.momentum=0.9 --out /tmp/momentum_run) > /tmp/momentum.log 2>&1 \
            && grep -E "wall_s|test_acc" /tmp/momentum.log \
            || { failed=1; echo "failed:"; tail -5 /tmp/momentum.log; }
    done; exit $failed'
    # each operation's first call in a fresh process (a fresh run's one-time costs), then
    # a round's phases and profile, without the CUDA graphs and with them
    stage profile "$3" bash -c '$PY benchmarks/gpu_first_use.py; first=$?
        $PY benchmarks/gpu_profile.py --set runtime.cuda_graphs=false &&
        $PY benchmarks/gpu_profile.py && exit $first'
    # the planner's host work and the round's thread's stalls, on a machine of many cores
    stage planner 25 $PY benchmarks/bench_planner.py --repeats 15
    stage cnn "$4" $PY benchmarks/bench_cnn.py --device $DEV --rounds 3 --max-peers "$5" \
        --modes "$6" --step-graphs "${8:-off}" --profile --json "$OUT/bench_cnn.json"
    cnn_base "$7"
}

# cnn_base SECONDS: the full CNN's rounds (float32, the patch products) on the $BASE tree,
# to set beside this tree's
cnn_base() {
    stage cnn_base "$1" bash -c 'cd .gpu_kit/base && PYTHONPATH=$PWD:$PYTHONPATH \
        $PY benchmarks/bench_cnn.py --device $DEV --rounds 3 --modes float32 --no-floor \
        --json /tmp/bench_cnn_base.json'
}

case "${1:-}" in
    prepare) prepare ;;
    sources) sources ;;
    test)
        install
        # the whole suite, with the GPU visible (CPU tests pin the CPU; `cuda` tests run);
        # pyproject's --maxprocesses 4 (for 2-core CI machines) would cap -n
        stage tests 500 $PY -m pytest -n 8 --maxprocesses 8 -rs
        ;;
    bench) install; bench 170 60 95 240 3200 float32,tf32,bf16 60 off,on ;;
    all)
        install
        # under the device tool's 10-minute call; the H100 lease's stages took: the suite
        # 48 to 72 s (8 workers), synthetic 98 s (four runs and the anchor), ops 20 s,
        # profile 24 s, the CNN 169 s (bench_conv.py's 33 s is in `cnn`); the H200's (fourth
        # lease): 83, 114, 16, 24, 71 and 15 s (the base's CNN), 335 s with the install
        # the CNN's steps eager and as CUDA graphs, not its most clients (800 fit an H200)
        # (1,700 tests in 71 s at 08e70fe on lease 5's H200: 12 workers of its 16 cores)
        stage tests 170 $PY -m pytest -n 12 --maxprocesses 12 -rs -q --durations=12
        export OMP_NUM_THREADS=1 PY DEV=${DEV:-cuda} GOSSIP_PFL_CACHE=$PWD/$KIT/cache
        # the solver's forms side by side (by peer: 9 passes; one size: the fused kernel)
        stage solver 30 $PY benchmarks/bench_solver.py --device $DEV --iters 10 --no-compile
        # the conv forms' training step, and their forward alone at an E-step call's size
        stage conv 60 $PY benchmarks/bench_conv.py --device $DEV --iters 10 --no-profile
        bench 150 35 55 200 0 float32,bf16 60 off,on
        ;;
    cnn)
        # the CNN's two forms of the convolutions side by side, for a short lease: the CUDA
        # tests, one step in each layout, the solver's step eager and compiled, rounds in each
        # form and mode, the most clients
        install
        export OMP_NUM_THREADS=1 PY DEV=${DEV:-cuda} GOSSIP_PFL_CACHE=$PWD/$KIT/cache
        stage tests 60 $PY -m pytest -n 4 --maxprocesses 4 -rs -q -m cuda tests
        stage conv 45 $PY benchmarks/bench_conv.py --device $DEV
        stage solver 60 $PY benchmarks/bench_solver.py --device $DEV
        stage cnn 200 $PY benchmarks/bench_cnn.py --device $DEV --rounds 3 --max-peers 800 \
            --bisect 2 --modes float32,tf32,bf16 --step-graphs off,on --conv products \
            --no-floor --profile --json "$OUT/bench_cnn.json"
        stage cnn_groups 100 $PY benchmarks/bench_cnn.py --device $DEV --rounds 3 \
            --modes float32,bf16 --conv groups --no-floor --json /tmp/bench_cnn_groups.json
        cnn_base 60
        ;;
    *)
        echo "usage: benchmarks/gpu_kit.sh prepare|test|bench|all|cnn|sources" >&2
        exit 2
        ;;
esac
# the device tool brings back at most 8 files from $OUT (`all` writes 13): past that, the
# checks' logs go back as one archive (a call stopped before this point leaves them as they are)
case "${1:-}" in
    test | bench | all | cnn)
        n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
        if [ "$n" -gt 8 ] && tar czf /tmp/gpu_kit_out.tgz -C "$OUT" . &&
            mv /tmp/gpu_kit_out.tgz "$OUT/gpu_kit_out.tgz"; then
            find "$OUT" -mindepth 1 -maxdepth 1 ! -name gpu_kit_out.tgz -exec rm -rf {} +
            echo "gpu_kit: the $n files are in $OUT/gpu_kit_out.tgz"
        fi
        ;;
esac
# a stage's timeout (124, or 137 when killed) would read as the device call's own timeout
if [ "$worst" -eq 124 ] || [ "$worst" -eq 137 ]; then
    echo "gpu_kit: a stage ran past its time limit (exit $worst; see its log)" >&2
    exit 3
fi
exit "$worst"
