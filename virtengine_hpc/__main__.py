import sys

from virtengine_hpc.cli import main

sys.exit(main())
