"""`python -m anygrad.cli ...`, as the tests run the command in a child process (the same main()
as `anygrad` and `python -m anygrad`)."""
import sys

from .entry import main

sys.exit(main())
