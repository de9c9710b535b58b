"""`python -m inferbook.compiled _worker ...`: the compiling subprocess (see `inferbook.compiled.inspect`)."""
import sys

from . import _main

sys.exit(_main(sys.argv[1:]))
