import sys

from cflow.cli import main

sys.exit(main())
