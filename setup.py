"""The compiled parts of feather-gym: the Chunked Hash Tree's core, the observation's
arithmetic, the policy network's evaluator, the step log's batch composition and the prefix-cache
lookup of the deployed observation."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(ext_modules=[
    Pybind11Extension("cache_core.cht._native", ["cache_core/cht/native/cht.cpp"], cxx_std=17),
    Pybind11Extension("feather_gym._dense", ["feather_gym/native/dense.cpp"], cxx_std=17),
    Pybind11Extension("feather_gym._observation", ["feather_gym/native/observation.cpp"], cxx_std=17),
    Pybind11Extension("deploy._composition", ["deploy/native/composition.cpp"], cxx_std=17),
    Pybind11Extension("deploy._prefix_hits", ["deploy/native/prefix_hits.cpp"], cxx_std=17),
])
