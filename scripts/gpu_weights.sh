# Sourced by the scripts a lent GPU runs with real weights (gpu_check.sh, gpu_train.sh), after
# they set ROOT: the GGUF that scripts/gpu_prep.sh split into .gpu/gguf.part1..N (N such that one
# part and the tracked tree fit the 64 MiB a call carries) is stashed part by part as calls carry
# it, then reassembled and verified against .gpu/gguf.sha256, which lists every part.
#   stash_parts      copy the parts this call carried to $GGUF_DIR/parts: the next call's .gpu/
#                    replaces this one's
#   assemble_gguf    reassemble $GGUF_DIR/target.gguf and install .gpu/whl into $WHEEL_SITE; on
#                    failure, `incomplete` says why (a message naming the part) and nothing is left
#                    half-written
GPU="$ROOT/.gpu"
GGUF_DIR="${GGUF_DIR:-/tmp/dspark-gguf}"
WHEEL_SITE="${WHEEL_SITE:-/tmp/site}"
incomplete=""

stash_parts() {
  mkdir -p "$GGUF_DIR/parts"
  local p
  for p in "$GPU"/gguf.part*; do [ -f "$p" ] && cp "$p" "$GGUF_DIR/parts/"; done
  ls -l "$GGUF_DIR/parts"
}

assemble_gguf() {
  local parts="$GGUF_DIR/parts" names name
  incomplete=""
  stash_parts > /dev/null
  names=$(grep -o 'gguf\.part[0-9]*$' "$GPU/gguf.sha256")
  for name in $names; do
    [ -f "$parts/$name" ] || { incomplete="$name is missing: carry .gpu/$name in an earlier call that runs the script with --stash (scripts/gpu_prep.sh splits the GGUF into $(echo $names | wc -w) parts; each call carries one)"; return; }
  done
  (cd "$parts" && grep ' gguf\.part[0-9]*$' "$GPU/gguf.sha256" | sha256sum -c --quiet) \
    || { incomplete="a part of the GGUF does not match its sha256 in .gpu/gguf.sha256 (see above): carry it again"; return; }
  (cd "$parts" && cat $names) > "$GGUF_DIR/target.gguf.tmp"
  mv "$GGUF_DIR/target.gguf.tmp" "$GGUF_DIR/target.gguf"
  (cd "$GGUF_DIR" && grep ' target\.gguf$' "$GPU/gguf.sha256" | sha256sum -c --quiet) \
    || { incomplete="the reassembled GGUF does not match its sha256"; rm -f "$GGUF_DIR/target.gguf"; return; }
  if compgen -G "$GPU/whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WHEEL_SITE" \
      "$GPU"/whl/*.whl || { incomplete="installing .gpu/whl failed"; return; }
    export PYTHONPATH="$PYTHONPATH:$WHEEL_SITE"
  fi
}
