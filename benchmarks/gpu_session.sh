#!/usr/bin/env bash
# Prepare `python -m benchmarks.gpu_check` for a GPU machine that has Python 3.12, torch, transformers and
# accelerate but no package index and no `datasets` (the H200 lent on 2026-12-04), and print what to run there.
#
#   bash benchmarks/gpu_session.sh                                        # every check
#   bash benchmarks/gpu_session.sh --only generation generation_tokens    # arguments for gpu_check
#
# Run it from this machine (any directory). It downloads the wheels gpu_check needs beyond that machine's packages
# into .whl/ and copies the Tiny Shakespeare folder (DATA, default ../shared/data/tiny_shakespeare) into
# .gpu-data/; both are ignored by git, so they travel only where named (the device tool's `carry`). A copied tree
# has no .git: the printed command passes this checkout's commit (--commit), which the results file then records.
# The command writes the JSON and a log into $OUT, the folder that comes back; copy the JSON into
# benchmarks/results/ and run `python -m benchmarks.report`.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/tiny_shakespeare}
PYTHON=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}  # the GPU machine's Python, not this one's

if [ ! -d "$DATA" ]; then
    echo "error: DATA=$DATA is not a folder; point DATA at the Tiny Shakespeare dataset folder (Hub layout)." >&2
    exit 2
fi
rm -rf .whl .gpu-data
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_17_x86_64 -d .whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
mkdir -p .gpu-data
cp -r "$DATA" .gpu-data/tiny_shakespeare
cp "$(dirname "$DATA")/tinyshakespeare/input.txt" .gpu-data/input.txt  # the nanoGPT reference recipe's text
for path in .whl .gpu-data; do
    if ! git check-ignore -q "$path"; then
        echo "error: $path is not ignored by git; add /$path/ to .gitignore before carrying it." >&2
        exit 1
    fi
done

commit=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "warning: this checkout has uncommitted changes; the copied tree runs them, but the results file will" \
        "name commit ${commit:0:7}. Commit first." >&2
fi
echo "prepared: .whl/ ($(ls .whl | tr '\n' ' ')) and .gpu-data/tiny_shakespeare; $(du -shc .whl .gpu-data | tail -1 | cut -f1) to carry"
echo
echo "device tool: carry [\".whl\", \".gpu-data\"], timeout_s 600 (gpu_check keeps within 540 s, skipping with a row" \
    "what would end later: run those next with --only NAME ...); command:"
echo
extra=""
for arg in "$@"; do extra+=" $(printf '%q' "$arg")"; done
echo "set -o pipefail; python -m pip install --quiet --no-index --no-deps .whl/*.whl && HF_HUB_OFFLINE=1" \
    "HF_DATASETS_OFFLINE=1 PYTHONPATH=. python -m benchmarks.gpu_check --dataset_name .gpu-data/tiny_shakespeare" \
    "--nanogpt_data .gpu-data/input.txt" \
    "--commit $commit --json_out \"\$OUT\"$extra 2>&1 | tee \"\$OUT/gpu_check.log\""
