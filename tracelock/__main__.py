import sys

from tracelock.cli import main

sys.exit(main())
