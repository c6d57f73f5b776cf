"""``python -m yafsdp.plan``: the same as ``python -m yafsdp plan``."""
import sys

from .cli import main

main(sys.argv[1:], prog="python -m yafsdp.plan")
