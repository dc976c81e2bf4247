import sys

from dspark.cli import main

sys.exit(main())
