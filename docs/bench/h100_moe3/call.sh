#!/bin/bash
# device call D: GPU parity of the mixture-of-experts families on this tree, then gpt-oss-120b's first step and peak
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/bitsandbytes*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1
(nvidia-smi -L; python3 -c "import torch,transformers,peft,bitsandbytes;print(torch.__version__,transformers.__version__,peft.__version__,bitsandbytes.__version__)"; free -g; nproc) > $OUT/env.txt 2>&1
S=$(date +%s)
POROS_FX_GPU_STEPS=3 POROS_FX_GPU_REPORT=$OUT timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_families.py -k "(moe or gpt_oss or mixtral) and nf4" -rA > $OUT/parity_moe.log 2>&1; echo "rc $? elapsed $(( $(date +%s)-S ))" >> $OUT/parity_moe.log
timeout 270 poros-fx bench --models gpt-oss-120b --methods poros --block-sizes 1 --accums 1 --seqs 512 --steps 3 --warmup 1 --memory-profile /tmp/mem2 --json $OUT/gptoss120b.json --plot /tmp/g.png > $OUT/bench.log 2>&1; echo "== gptoss rc $? elapsed $(( $(date +%s)-S ))" >> $OUT/bench.log
tail -14 $OUT/parity_moe.log; grep -E "^==|Error|error" $OUT/bench.log | tail; cat $OUT/gptoss120b.md
