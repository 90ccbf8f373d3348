#!/bin/bash
# Submit BERT pretraining as two Slurm jobs: phase 1, then phase 2, which starts
# only after phase 1 completed successfully (--dependency=afterok) and begins
# from phase 1's weights (--init-checkpoint). If phase 1 fails, Slurm cancels
# phase 2 (--kill-on-invalid-dep=yes). A requeued phase 1 (preemption, time
# limit) keeps phase 2 waiting until it really finishes.
#
#   slurm/submit_bert_phases.sh --phase1-data data/bert128 --phase2-data data/bert512 \
#       --output-dir runs/bert [--phase1 "--steps 7038"] [--phase2 "--steps 1563"] \
#       [--sbatch "--nodes=4 --gpus-per-node=8 --ntasks-per-node=8"] [-- ARGS FOR BOTH PHASES]
#
# Phase 1 writes OUTPUT_DIR/phase1, phase 2 OUTPUT_DIR/phase2. --phase1, --phase2
# and --sbatch take space-separated options (no quoting inside). LAUNCHER and
# the rest of your environment reach both jobs. Prints the two job ids.
set -euo pipefail

usage_error() { echo "${0##*/}: error: $*" >&2; exit 2; }

phase1_data="" phase2_data="" output_dir="" phase1_args="" phase2_args="" sbatch_args=""
while [ $# -gt 0 ]; do
    case "$1" in
        --phase1-data|--phase2-data|--output-dir|--phase1|--phase2|--sbatch)
            [ $# -ge 2 ] || usage_error "$1 needs a value"
            case "$1" in
                --phase1-data) phase1_data=$2 ;;
                --phase2-data) phase2_data=$2 ;;
                --output-dir) output_dir=$2 ;;
                --phase1) phase1_args=$2 ;;
                --phase2) phase2_args=$2 ;;
                --sbatch) sbatch_args=$2 ;;
            esac
            shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) usage_error "unknown argument '$1' (options for pretrain_bert.py go after --)" ;;
    esac
done
[ -n "$phase1_data" ] || usage_error "--phase1-data is required"
[ -n "$phase2_data" ] || usage_error "--phase2-data is required"
[ -n "$output_dir" ] || usage_error "--output-dir is required"
for dir in "$phase1_data" "$phase2_data"; do
    [ -f "$dir/metadata.json" ] || usage_error "$dir has no metadata.json: prepare it with scripts/prepare_bert_data.py"
done

# The jobs find the venv and scripts through HVD_REPO (sbatch passes the
# environment on); relative paths stay relative to where you run this.
HVD_REPO=$(cd "$(dirname "$0")/.." && pwd)
export HVD_REPO
read -r -a sbatch_extra <<< "$sbatch_args"
read -r -a phase1_extra <<< "$phase1_args"
read -r -a phase2_extra <<< "$phase2_args"

phase1=$(sbatch --parsable --job-name=bert-phase1 "${sbatch_extra[@]}" "$HVD_REPO/slurm/pretrain_bert.sbatch" \
    --data "$phase1_data" --output-dir "$output_dir/phase1" "$@" "${phase1_extra[@]}")
phase1=${phase1%%;*}
phase2=$(sbatch --parsable --job-name=bert-phase2 --dependency="afterok:$phase1" --kill-on-invalid-dep=yes \
    "${sbatch_extra[@]}" "$HVD_REPO/slurm/pretrain_bert.sbatch" \
    --data "$phase2_data" --init-checkpoint "$output_dir/phase1" --output-dir "$output_dir/phase2" \
    "$@" "${phase2_extra[@]}")
phase2=${phase2%%;*}
echo "phase 1: job $phase1 -> $output_dir/phase1"
echo "phase 2: job $phase2 -> $output_dir/phase2 (after job $phase1 completes successfully)"
