"""`python -m corelm.entrypoints.cli`, the same as the installed `corelm` command."""
import sys

from . import main

sys.exit(main())
