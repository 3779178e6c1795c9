"""What the machine's toolchain offers the tests: inductor's CPU code needs a C++ compiler (the machine
images here have gcc); tests that compile a step skip without one."""

import shutil

import pytest

needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                               reason="no C++ compiler for inductor")
