#!/usr/bin/env bash
# A site directory holding the real TensorRT 11 Python API, for tests/test_tensorrt_api.py on a
# machine without a GPU: PyPI's tensorrt-cu13 bindings wheel (about 1.2 MB) and the `tensorrt`
# package of its tensorrt-cu13 sdist, unpacked into DIR, beside STUB libnvinfer.so.11,
# libnvonnxparser.so.11 and libnvinfer_plugin.so.11 whose every function returns 0. The real
# libraries come in tensorrt-cu13-libs, whose PyPI sdist downloads the wheel from
# pypi.nvidia.com (not reachable from this project's VM). The bindings' RPATH is $ORIGIN, so
# they load the stubs: the module imports and its classes and signatures can be read, but
# nothing can be built or run (a Builder or Runtime raises "factory function returned
# nullptr"). Needs pip, tar, nm and gcc.
#
#   scripts/tensorrt_api_site.sh /tmp/trt11 && DSPARK_REAL_TENSORRT=/tmp/trt11 python -m pytest tests/test_tensorrt_api.py
set -euo pipefail
DIR=${1:?usage: $0 DIR (a new site directory)}
VERSION=${TENSORRT_VERSION:-11.4.0.106}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pip download --quiet --no-deps -d "$TMP" "tensorrt-cu13-bindings==$VERSION" "tensorrt-cu13==$VERSION"
python -m zipfile -e "$TMP"/tensorrt_cu13_bindings-"$VERSION"-*.whl "$DIR"
tar -xzf "$TMP/tensorrt_cu13-$VERSION.tar.gz" -C "$TMP"
cp -r "$TMP/tensorrt_cu13-$VERSION/tensorrt" "$DIR/"
LIB="$DIR/tensorrt_bindings"
# The symbols the bindings take from NVIDIA's libraries (all functions), by library.
undefined=$(nm -D --undefined-only "$LIB/tensorrt.so" | awk '{print $2}')
stub() {  # stub SONAME PATTERN: every undefined symbol matching PATTERN, returning 0
    printf '%s\n' "$undefined" | grep -E "$2" | sed 's/.*/void *&(void) { return 0; }/' > "$TMP/$1.c"
    gcc -shared -fPIC -Wl,-soname,"$1" -o "$LIB/$1" "$TMP/$1.c"
}
stub libnvinfer.so.11 '^(createInfer|get(Builder)?PluginRegistry)'
stub libnvonnxparser.so.11 'NvOnnxParser'
stub libnvinfer_plugin.so.11 '^initLibNvInferPlugins$'
python -c "import sys; sys.path.insert(0, '$DIR'); import tensorrt; print('tensorrt', tensorrt.__version__, 'API from', '$DIR', '(stub native libraries)')"
