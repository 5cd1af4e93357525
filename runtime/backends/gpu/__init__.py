"""The shared GPU layer: shape buckets, static device buffers, CUDA-graph capture and
replay, and a `Backend` built from them (`GraphBackend`). Engine-specific code (TensorRT in
`backends/tensorrt`, the PyTorch models in `dspark.export.cuda_graph_backend`) only says
how to launch one step; everything else lives here. Nothing in this package imports a GPU
library at import time: CuPy is imported by `cupy_device` when a device is opened."""
