import sys

from quantprep.cli import main

sys.exit(main())
