# Triton Python-backend entry point of the `peagle` model. Everything lives in the installed
# peagle_trt package (pip install peagle-trt in the serving environment); see
# peagle_trt/serve/triton_model.py.
from peagle_trt.serve.triton_model import TritonPythonModel  # noqa: F401
