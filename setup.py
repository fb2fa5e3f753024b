"""The compiled parts of feather-gym: the Chunked Hash Tree's core, the observation's
arithmetic and the policy network's evaluator."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(ext_modules=[
    Pybind11Extension("cache_core.cht._native", ["cache_core/cht/native/cht.cpp"], cxx_std=17),
    Pybind11Extension("feather_gym._dense", ["feather_gym/native/dense.cpp"], cxx_std=17),
    Pybind11Extension("feather_gym._observation", ["feather_gym/native/observation.cpp"], cxx_std=17),
])
