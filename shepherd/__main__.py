import sys

from shepherd.cli import main

sys.exit(main())
