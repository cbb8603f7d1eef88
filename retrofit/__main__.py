"""`python -m retrofit ...` and `accelerate launch -m retrofit train RECIPE`."""

import sys

from .cli import main

sys.exit(main())
