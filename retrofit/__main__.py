"""`python -m retrofit ...` and `accelerate launch -m retrofit train RECIPE`."""

import sys

from .cli import main

# Guarded: a process started by the spawn method (vLLM's engine for `retrofit eval --engine vllm` may be) imports the
# parent's __main__ as __mp_main__, and must not run the command again.
if __name__ == "__main__":
    sys.exit(main())
