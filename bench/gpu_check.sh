#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the `gpu` tests, then the compiled step's benchmark on E2B in
# bfloat16 (`python -m bench.compiled`). Run from the repository root on the GPU host, with the engine built
# for that host's torch (`make engine-wheel`; DEVELOPERS.md, "On a GPU host"). Logs go to the folder given
# (default gpu-check/). Each part runs under a time limit (TESTS_S, BENCH_S seconds), and the bench prints each
# batch as it finishes, so a run cut short keeps what it measured.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/gemma-inductor}
python3 -c 'import torch, gemma_engine; print(torch.__version__, gemma_engine.BUILD, torch.cuda.get_device_name())' \
  || exit 1
# Each part ends with os._exit: with torch 2.11 an Inductor process can wait minutes at exit for its compile
# workers.
timeout "${TESTS_S:-170}" python3 -c \
  'import os, sys, pytest; rc = pytest.main(sys.argv[1:]); sys.stdout.flush(); os._exit(int(rc))' \
  -q -p no:cacheprovider -m gpu tests/engine/test_compiled.py tests/engine/test_batching.py \
  tests/engine/test_parity.py tests/engine/test_media.py 2>&1 | tee "$out/gpu_tests.log"
timeout "${BENCH_S:-330}" python3 -c \
  'import os, sys; from bench.compiled import main; main(sys.argv[1:]); sys.stdout.flush(); os._exit(0)' \
  --config "${CONFIG:-e2b}" --device cuda --dtype bfloat16 --batches "${BATCHES:-1,8,32}" --repeats 3 \
  --transformers 2>&1 | tee "$out/bench.log"
