# Sourced by the scripts a lent GPU runs (gpu_check.sh, gpu_profile.sh), after they set ROOT and
# OUT: makes `dspark` importable from this checkout as the editable install maps it (a temporary
# site, removed at exit; nothing is installed), records the GPU in $OUT/nvidia-smi.txt, and sets
# the environment the Python scripts run in.
SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
mkdir -p "$SITE/dspark"
ln -s "$ROOT/export" "$SITE/dspark/export"
ln -s "$ROOT/runtime" "$SITE/dspark/runtime"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi: not available") \
  > "$OUT/nvidia-smi.txt" 2>&1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
