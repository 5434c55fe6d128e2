"""Package discovery for setuptools (the metadata is in pyproject.toml). Installed: every package
found under kvcalib/, the Triton kernels of kernels/ (and their subpackages) as kvcalib_kernels
(``kernels`` is another PyPI package, one that transformers probes for), and the shipped presets
of recipes/presets as kvcalib.presets. Not installed: benchmarks/, experiments/, tests/, scripts/.
(pyproject.toml alone cannot combine package discovery with packages whose import name differs
from their folder, hence this file.)"""

from setuptools import find_packages, setup

packages = [p for p in find_packages(include=["kvcalib", "kvcalib.*"]) if p != "kvcalib.presets"]
packages += ["kvcalib_kernels", *(f"kvcalib_kernels.{p}" for p in find_packages("kernels"))]
packages += ["kvcalib.presets"]

setup(packages=packages,
      package_dir={"kvcalib": "kvcalib", "kvcalib_kernels": "kernels", "kvcalib.presets": "recipes/presets"})
