#!/usr/bin/env bash
# The shipped samples replayed under each torch the README claims: the oldest (2.4.1, what pyproject's torch>=2.4
# allows) and the newest run here. One fresh venv per version (under $TMPDIR, outside the checkout), nanforensics
# installed from this checkout without its dependencies' versions changing torch, then every shipped sample's
# README command from the checkout's root; each line says the exit code and the headline.
#
#     scripts/torch_versions.sh [VERSION...]          # default: 2.4.1 2.13.0
#
# Set TORCH_INDEX=https://download.pytorch.org/whl/cpu where that index is reachable: its CPU wheels are ~200 MB;
# PyPI's Linux wheels are the CUDA builds (~800 MB, and their nvidia-* dependencies, ~2.5 GB, which torch needs to
# import even on a machine without a GPU). CI keeps the one version it pins (.ci/run); this is run by hand.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.4.1 2.13.0)
index=(${TORCH_INDEX:+--index-url "$TORCH_INDEX"})

for v in "${versions[@]}"; do
    venv="${TMPDIR:-/tmp}/nf-torch-$v"
    if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet "${index[@]}" "torch==$v" || { echo "torch $v: not installable here"; continue; }
    fi
    # nanforensics and its other dependencies, torch left as installed
    "$venv/bin/pip" install --quiet --no-deps "$repo"
    "$venv/bin/pip" install --quiet "typer>=0.12" "rich>=13" "safetensors>=0.4" numpy
    echo "== torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'), nanforensics from $repo"
    cd "$repo"
    for cmd in "replay sample_runs/seed_adam" "replay sample_runs/sgd_momentum" "replay sample_runs/clean" \
               "replay sample_runs/ddp_two_ranks" \
               "replay --checkpoint sample_runs/unrecorded/ckpts/step_000010.pt --code sample_runs/unrecorded/train.py"; do
        # shellcheck disable=SC2086
        out="$(COLUMNS=400 "$venv/bin/nanforensics" $cmd --quiet --no-explain 2>&1)"
        code=$?
        head="$(printf '%s\n' "$out" | grep -m1 -E 'NON-FINITE|CLEAN|NOT REPRODUCED|LOSS ONLY|error:' \
                | sed -E 's/^[^A-Za-z]*//; s/ *[─╮]+$//' | tr -s ' ')"
        echo "torch $v  exit $code  nanforensics $cmd  ->  $head"
    done
done
