import sys

from freetoken.cli import main

sys.exit(main())
