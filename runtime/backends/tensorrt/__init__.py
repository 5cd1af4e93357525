"""TensorRT: engine building (`build`), the engine metadata and its checks (`meta`,
`profiles`), and the backend (`backend`). Only `build` and `backend` import tensorrt, and
only when called; the rest is plain logic that the CPU test suite covers. No TensorRT
engine has been built or run in this project's development environment."""
