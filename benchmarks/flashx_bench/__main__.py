import sys

from flashx_bench.cli import main

sys.exit(main(prog="python -m flashx_bench"))
