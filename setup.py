"""Build script: the package, plus the `megatron_rl._C` extension once csrc/ holds kernels."""
from setuptools import setup

setup()
