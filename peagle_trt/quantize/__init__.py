"""Stage `quantize` (`peagle-trt quantize`): FP8 post-training quantization of the target with ModelOpt.

fp8.py quantizes and writes the checkpoint; calib.py holds the calibration prompts; cli.py is the
subcommand.
"""

from peagle_trt.quantize.fp8 import (
                                     QuantizeOptions,
                                     calibrate,
                                     export_checkpoint,
                                     quant_config,
                                     quantize_target,
                                     verify_fp8_checkpoint,
)

__all__ = ["QuantizeOptions", "calibrate", "export_checkpoint", "quant_config", "quantize_target",
           "verify_fp8_checkpoint"]
