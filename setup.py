"""The package list only (everything else is in pyproject.toml): peagle_trt and its subpackages,
plus model_repo/ shipped as `peagle_trt.model_repo` (the Triton templates `peagle-trt build` renders)."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["peagle_trt", "peagle_trt.*"]) + ["peagle_trt.model_repo"],
      package_dir={"peagle_trt.model_repo": "model_repo"})
