"""The package version and distribution name, in a module of its own so that any module can read them without
importing the package root.

PyPI's `retrofit` is an unrelated project (ML scoring; its wheel installs a top-level `retrofit` module with
`MachineLearning.py` in it): this one is distributed as `retrofit-attention`, imported and run as `retrofit`.
"""

VERSION = "0.1.0"
DISTRIBUTION = "retrofit-attention"
INSTALL = f"pip install {DISTRIBUTION}"
# a file only the unrelated `retrofit` distribution installs: its presence beside ours means both were installed
# into one folder and one overwrote the other's files
FOREIGN_MARKER = "MachineLearning.py"
