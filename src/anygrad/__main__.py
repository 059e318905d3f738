"""`python -m anygrad ...`, which is how torchrun starts each rank: `torchrun -m anygrad train ...`."""
import sys

from .cli import main

sys.exit(main())
